"""tools/soak.py tells the expected refusal to re-enter a retired offloader from a real failure: its
text once drifted from the offloader's message, and every reopen after a signal counted as a failure."""

from __future__ import annotations

import pathlib

import pytest
import torch
from utils import load_script

import tba
from tba.errors import TbaError

SOAK = pathlib.Path(__file__).resolve().parents[1] / "tools" / "soak.py"


def test_the_soak_expects_the_offloaders_own_refusal(spill_dir):
    soak = load_script(SOAK)
    x = torch.randn(64, 64, requires_grad=True)
    offloader = tba.Offloader(spill_dir, min_offload_bytes=0)
    with pytest.raises(RuntimeError, match="a signal's exception"):
        with offloader:
            torch.tanh(x)
            raise RuntimeError("a signal's exception")
    with pytest.raises(TbaError) as refused:
        with offloader:
            pass
    offloader.close()
    assert soak.is_discarded_reentry(refused.value), str(refused.value)
    assert not soak.is_discarded_reentry(TbaError("this Offloader cannot be entered now: it is already entered"))


def test_sigterm_removes_the_spill_directory(tmp_path, monkeypatch):
    # `timeout` ended the soak with its tba-soak-* directory left in the temp dir.
    import os
    import signal

    soak = load_script(SOAK)
    alarm_handler = signal.getsignal(signal.SIGALRM)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    real_rss = soak.rss_bytes
    monkeypatch.setattr(soak, "rss_bytes", lambda: os.kill(os.getpid(), signal.SIGTERM) or real_rss())
    with pytest.raises(SystemExit) as exit_:
        soak.main(["--steps", "20", "--backend", "threads", "--signal-rate", "0", "--progress-every", "1000"])
    assert exit_.value.code == 128 + signal.SIGTERM
    assert list(tmp_path.iterdir()) == []
    # The soak's SIGALRM handler (raise_injected) stayed installed in the pytest worker for every later test, which
    # also kept conftest's faulthandler off SIGALRM (Note [A worker ended by a signal says which] in tests/conftest.py).
    assert signal.getsignal(signal.SIGALRM) is alarm_handler
