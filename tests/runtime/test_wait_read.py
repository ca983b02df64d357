"""What ``StoreReadWait.wait_read`` raises (Note [A device error reading back is a read error] in
``tba/runtime/_read_wait.py``): the read's own failure as a TbaReadError, anything raised in the waiting
thread meanwhile (a signal handler's exception) as it is."""

from __future__ import annotations

import threading
import types

import pytest

from tba import TbaReadError
from tba._outcome import Outcome
from tba.runtime import _read_wait
from tba.runtime._read_wait import StoreReadWait


class Interrupted(Exception):
    """What a user's signal handler raises."""


def _reads_of():
    window = types.SimpleNamespace(note_wait=lambda: None)
    stats = types.SimpleNamespace(unpacks_waited=0, unpack_wait_s=0.0)
    return types.SimpleNamespace(spill=types.SimpleNamespace(directory="/d"), lock=threading.Lock(), stats=stats,
                                 window=window)


ENTRY = types.SimpleNamespace(describe=lambda: "a storage", offset=0, extent_bytes=4096)


def test_the_reads_own_failure_is_a_read_error():
    done = Outcome()
    done.set_exception(RuntimeError("CUDA error: an illegal memory access"))
    with pytest.raises(TbaReadError, match="cannot read back a storage.*illegal memory access"):
        StoreReadWait.wait_read(_reads_of(), ENTRY, done)


def test_an_exception_raised_while_waiting_reaches_the_caller_as_it_is(monkeypatch):
    def interrupted(outcome):
        raise Interrupted  # as a signal handler does while the thread is blocked

    monkeypatch.setattr(_read_wait, "wait", interrupted)
    with pytest.raises(Interrupted):
        StoreReadWait.wait_read(_reads_of(), ENTRY, Outcome())
