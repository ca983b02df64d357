"""An unpack served from memory no one can discard takes no lock.

Note [Bytes no one can discard need no lock] in ``tba/runtime/_reads.py``; the discardable case keeps
Note [An unpack holds its own reference].
"""

from __future__ import annotations

import threading
import time

import torch

import tba
from tba import _control

KIB = 1 << 10


def _resident_view(spill_dir):
    """An offloader and a packed view whose bytes tba holds in memory (the window holds the last storage)."""
    off = tba.Offloader(spill_dir, min_offload_bytes=0)
    x = torch.randn(16 * KIB)
    with off:
        packed = off.pack(x.clone())  # only tba holds it: held since forward, or read back by the window
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline and (packed.entry is None or packed.entry.data is None):
        _control.settle()
        time.sleep(0.01)
    assert packed.entry is not None and packed.entry.data is not None, "the test needs resident bytes"
    return off, x, packed


def _unpack_while_locked(off, packed):
    """Unpack on another thread while this one holds the store's lock; returns (finished while locked, result)."""
    got = []
    done = threading.Event()

    def unpack():
        got.append(off.unpack(packed))
        done.set()

    with off._store.lock:
        worker = threading.Thread(target=unpack)
        worker.start()
        finished_locked = done.wait(2.0)
    worker.join(10.0)
    assert got, "the unpack never finished"
    return finished_locked, got[0]


def test_memory_no_one_discards_is_served_without_the_lock(spill_dir):
    off, x, packed = _resident_view(spill_dir)
    assert not packed.entry.own_memory
    finished_locked, got = _unpack_while_locked(off, packed)
    assert finished_locked, "the unpack waited for the store's lock"
    assert torch.equal(got, x)
    del packed, got
    off.close()


def test_discardable_memory_still_takes_the_lock(spill_dir):
    off, x, packed = _resident_view(spill_dir)
    packed.entry.own_memory = True  # as a glibc storage of 256 KiB or more: its pages may be discarded
    finished_locked, got = _unpack_while_locked(off, packed)
    assert not finished_locked, "a discardable storage was served without ordering its alias before a discard"
    assert torch.equal(got, x)
    del packed, got
    off.close()
