"""An exception from a signal handler inside ``tba.shutdown()`` leaves no spill file open (Note [Shutdown
closes on the control thread] in ``tba/runtime/_shared.py``)."""

from __future__ import annotations

import os
import sys

import torch

import tba
from tba.runtime import _shared


def _spill_fds(directory: str) -> list[str]:
    names = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(directory + "/"):
            names.append(target)
    return names


def _interrupt_the_first_engine_close() -> list[str]:
    """A trace function that raises ``KeyboardInterrupt`` (as a SIGINT handler would) when this thread
    first calls an engine's or a spill file's ``close``; returns where it struck (empty if it did not)."""
    struck: list[str] = []

    def trace(frame, event, arg):
        if event == "call" and not struck and frame.f_code.co_name == "close" and "/tba/io/" in frame.f_code.co_filename:
            struck.append(frame.f_code.co_filename)
            sys.settrace(None)
            raise KeyboardInterrupt
        return None

    sys.settrace(trace)
    return struck


def test_an_interrupt_inside_shutdown_leaves_no_spill_file_open(spill_dir, backend):
    x = torch.randn(64, 1024, requires_grad=True)
    with tba.offload_activations(spill_dir, backend=backend, min_offload_bytes=0):
        loss = (x * 2).sin().exp().sum()
    loss.backward()
    assert _shared.idle_runtimes() == 1 and _spill_fds(spill_dir)
    _interrupt_the_first_engine_close()
    try:
        tba.shutdown()
    except KeyboardInterrupt:
        pass
    finally:
        sys.settrace(None)
    tba.shutdown()
    assert _shared.idle_runtimes() == 0
    assert _spill_fds(spill_dir) == []
