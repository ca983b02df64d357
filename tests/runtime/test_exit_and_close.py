"""A training step inside an ``atexit`` handler works on every backend, and closing an offloader during
backward gives a ``TbaError`` that names the fix, never a raw engine error (issue 21, item 11)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import USABLE_BACKENDS

import tba
from tba import TbaError
from tba.runtime._store import StorageStore

AT_EXIT = textwrap.dedent("""
    import atexit, sys, torch, tba
    def at_exit():
        x = torch.randn(256, 1024, requires_grad=True)
        with tba.offload_activations(sys.argv[1], backend=sys.argv[2]):
            y = (x * 2).sin()
        y.sum().backward()
        print("exact", torch.equal(x.grad, (x * 2).cos().detach() * 2))
    atexit.register(at_exit)
""")


@pytest.mark.parametrize("backend", USABLE_BACKENDS)
def test_a_step_inside_an_atexit_handler_runs(spill_dir, backend):
    result = subprocess.run([sys.executable, "-c", AT_EXIT, spill_dir, backend], capture_output=True, text=True,
                            timeout=60, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert "exact True" in result.stdout


def test_close_during_backward_is_a_tba_error(spill_dir, monkeypatch):
    offloader = tba.Offloader(spill_dir, backend="threads", min_offload_bytes=0, layers=[], prefetch_budget_bytes=1)
    x = torch.randn(256, 1024, requires_grad=True)
    with offloader:
        h = x * 2
        for _ in range(6):
            h = h.sin()
    offloader.flush()
    original = StorageStore.start_load

    def close_then_load(self, entry):
        offloader._store.engine.close()
        return original(self, entry)

    monkeypatch.setattr(StorageStore, "start_load", close_then_load)
    # No read-ahead: an unpack served from prefetched memory never calls start_load.
    monkeypatch.setattr(StorageStore, "prefetch", lambda self, entry: None)
    with pytest.raises(TbaError, match="closed during backward; call close"):
        h.sum().backward()
    monkeypatch.undo()
    offloader.close()
