"""The O_DIRECT probe tells a full disk from a file system without O_DIRECT (Note [A full disk says nothing
about O_DIRECT] in tba/io/_directory.py)."""

from __future__ import annotations

import errno
import logging

import pytest
import torch

import tba
from tba.io import _directory


def _failing(code: int):
    def round_trip(fd: int) -> None:
        raise OSError(code, "probe failed")
    return round_trip


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT])
def test_a_full_disk_keeps_o_direct_and_warns_only_of_the_full_disk(spill_dir, monkeypatch, caplog, code):
    if _directory.probe_direct_io(spill_dir) is not None:
        pytest.skip("this directory has no O_DIRECT")
    monkeypatch.setattr(_directory, "_direct_round_trip", _failing(code))
    assert _directory.probe_direct_io(spill_dir) is None
    x = torch.randn(256, 1024, requires_grad=True)
    with caplog.at_level(logging.WARNING, logger="tba"):
        with tba.offload_activations(spill_dir, policy="offload", direct_io=True) as off:
            loss = x.exp().sin().sum()
        loss.backward()
    assert off.resolved_direct_io is True
    assert not [r for r in caplog.records if "O_DIRECT" in r.getMessage() or "buffered" in r.getMessage()]
    assert torch.equal(x.grad, x.detach().exp().cos() * x.detach().exp())


def test_an_o_direct_failure_that_is_not_a_full_disk_is_reported(spill_dir, monkeypatch):
    monkeypatch.setattr(_directory, "_direct_round_trip", _failing(errno.EINVAL))
    reason = _directory.probe_direct_io(spill_dir)
    assert reason is not None and "O_DIRECT I/O" in reason


@pytest.mark.parametrize("code", [errno.EMFILE, errno.ENFILE])
def test_no_descriptor_for_the_probe_says_nothing_about_o_direct(spill_dir, monkeypatch, code):
    """Out of descriptors, the probe blamed the file system: a buffered-I/O warning, and with direct_io=True a
    TbaConfigError telling to move to ext4 or xfs, which also kept the shared runtimes from closing idle ones."""
    if _directory.probe_direct_io(spill_dir) is not None:
        pytest.skip("this directory has no O_DIRECT")

    def no_descriptor(directory, *, direct):
        raise OSError(code, "no descriptor")

    monkeypatch.setattr(_directory, "open_anonymous", no_descriptor)
    assert _directory.probe_direct_io(spill_dir) is None


def test_a_file_size_limit_below_the_probe_says_nothing_about_o_direct(spill_dir):
    """Note [A file-size limit says nothing about O_DIRECT]: under ``ulimit -f`` below one block the probe's aligned write
    was cut at the limit, O_DIRECT refused the unaligned rest (EINVAL), and tba warned that the file system lacked
    O_DIRECT (with direct_io=True: a TbaConfigError telling to move to ext4 or xfs); the limit is the cause, which the
    spill file's own failed writes name (helper-161)."""
    import subprocess
    import sys

    script = (
        "import logging, resource, sys, torch, tba\n"
        "from tba.io import _directory\n"
        "logging.basicConfig(level=logging.WARNING, format='%(message)s')\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (1000, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))\n"
        "print('probe:', _directory.probe_direct_io(sys.argv[1]))\n"
        "x = torch.randn(256, 1024, requires_grad=True)\n"
        "with tba.offload_activations(sys.argv[1], policy='offload', direct_io=True) as off:\n"
        "    loss = x.exp().sin().sum()\n"
        "loss.backward()\n"
        "print('exact:', torch.equal(x.grad, x.detach().exp().cos() * x.detach().exp()))\n"
    )
    done = subprocess.run([sys.executable, "-c", script, spill_dir], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "probe: None" in done.stdout and "exact: True" in done.stdout, done.stdout + done.stderr
    assert "O_DIRECT" not in done.stderr and "ulimit -f" in done.stderr, done.stderr
