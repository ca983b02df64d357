"""The end of entries and of a store: a view's death, closing, detaching, forgetting after a fork.

The lifetime half of :class:`tba.runtime._store.StorageStore`, which sets every attribute used here:

* :meth:`StoreLifetime.drop_view` runs when autograd frees a saved view (on the control thread,
  through ``tba._control.on_death``); the last view of a storage frees its entry, and the extent once
  no transfer uses it;
* :meth:`StoreLifetime.close` ends the store's I/O and closes what it owns;
* :meth:`StoreLifetime.detach` stops using a shared spill file, engine and read pool without closing them;
* :meth:`StoreLifetime.forget_after_fork` drops, in a forked child, everything that is the parent's;
* :meth:`StoreLifetime._write_not_queued` settles an entry whose save failed between its registration and its
  write being queued (Note [A save that fails after its entry is registered]).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from tba.io import BufferPool
from tba.runtime._entry import State, StorageEntry

if TYPE_CHECKING:
    from tba._outcome import Outcome
    from tba.device import Routes
    from tba.io import Engine, SpillFile
    from tba.runtime._host_io import HostBatch
    from tba.runtime._prefetch import PrefetchWindow
    from tba.runtime._stats import BusyClock

# Note: [A save that fails after its entry is registered]
# A fresh save (``StoreWrites._start_write``, and its C twin ``start_host_write`` in native/tba_save.c) counts its
# entry live, maps it by storage, adds it to the window, counts it resident, allocates its extent, counts it as being
# written, starts the write clock and queues the write. An error between the first step and the last (a MemoryError
# from the host batch's append, a spill file that refuses an extent, a route's write that raises) left the entry
# registered, and from the allocation on counted in ``_writing``, with no write to ever end it: a reusable
# offloader's ``flush`` waited for ever, and the entry counted live for good (and with it the offloader's spill file
# and engine, for a one-shot one). Each path counts the steps that took effect (``done``; ``steps`` in C: the numbers
# below, which both builds use; a step that raises took none) and hands the error to ``_write_not_queued``:
# * an ``Exception`` once the entry is registered whole (REGISTERED) keeps the storage in memory as a failed write
#   does (``_keep_after_write_error``: KEPT, its extent freed, ``stats.tensors_kept_on_error``, one warning per
#   directory and cause), and the save goes on with that entry: training stays exact;
# * anything else (an ``Exception`` inside the registration, or a ``BaseException`` such as KeyboardInterrupt) has
#   every step undone, the entry dead, and goes up: the save job keeps the tensor in memory with a warning for an
#   ``Exception`` (``_keep_unsaved`` in tba/runtime/_hooks.py), and for the others backward raises a TbaError naming
#   the failed save. A write that raised is taken as not queued: the host batch's ``write`` queues it in one append,
#   and takes it back out when the scheduling of the flush after it fails (Note [A flush that could not be
#   scheduled] in tba/runtime/_host_io.py); a queued write's own completion settles its entry.
COUNTED, MAPPED, IN_WINDOW, REGISTERED, WRITING, CLOCKED = range(1, 7)
"""The steps of a fresh save, counted as they take effect: ``live_entries`` counted, ``_by_storage`` mapped, the
window's ``add``, ``_resident`` (the entry is registered), the extent allocated with ``_writing`` and
``unwritten_bytes`` counted, ``transfer_in_flight`` set with the write clock started."""


class StoreLifetime:
    """Ends of entries and of the store; mixed into :class:`~tba.runtime._store.StorageStore`."""

    lock: threading.RLock
    window: PrefetchWindow
    write_clock: BusyClock
    read_clock: BusyClock
    spill: SpillFile | None
    engine: Engine | None
    routes: Routes | None
    read_pool: BufferPool
    live_entries: int
    unwritten_bytes: int
    fork_seq: int
    _host: HostBatch | None
    _by_storage: dict[int, StorageEntry]
    _lingering: collections.deque[tuple[StorageEntry, torch.Tensor]]
    _writing: int
    _reading: int
    _next_seq: int
    _prefetch_to: StorageEntry | None
    _unpacked: list[StorageEntry]
    _idle_waiters: list[Outcome]
    _sweep_written: Callable[..., None]
    _keep_after_write_error: Callable[[StorageEntry], None]
    release: Callable[[StorageEntry], None]
    _free_extent: Callable[[StorageEntry], None]
    _wait_until: Callable[[Callable[[], bool]], None]

    def drop_view(self, entry: StorageEntry, view_id: int) -> bool:
        """A view of ``entry`` was freed; returns True when no entry is left alive."""
        with self.lock:
            if self._lingering:
                self._sweep_written()
            entry.live_views -= 1
            if entry.unpacked_views:
                entry.unpacked_views.discard(view_id)
            if entry.live_views > 0:
                return False
            if self._by_storage.get(entry.cdata) is entry:
                del self._by_storage[entry.cdata]
            entry.state = State.DEAD
            if entry.data is not None:  # a storage read back was released when its last view was unpacked
                self.release(entry)
            self.window.forget(entry)
            if not entry.transfer_in_flight:
                self._free_extent(entry)
            self.live_entries -= 1
            if self.live_entries:
                return False
            # Note: [Nothing lingers past the step]
            # A written storage that the program still used when its write completed lingers until a
            # sweep finds tba its only owner (Note [A bounded sweep per tensor]); a reusable offloader
            # saw no sweep between the last view's death and the next step's first save, so such a
            # storage stayed alive through the optimizer step (test_no_retention, racing writes).
            # When the last entry dies, what can be discarded is, and tba lets go of the rest.
            self._sweep_written(limit=None)
            self._lingering.clear()
            self._unpacked.clear()
            return True

    def _write_not_queued(self, entry: StorageEntry, error: BaseException, done: int) -> bool:
        """Settle ``entry``, whose save raised ``error`` after ``done`` of its steps took effect; True when it is kept
        in memory and the save goes on with it, False when every step was undone and ``error`` goes up (Note [A save
        that fails after its entry is registered])."""
        if done >= CLOCKED:
            self.write_clock.stop()
        if done >= WRITING:
            self._writing -= 1
            self.unwritten_bytes -= entry.nbytes
        entry.transfer_in_flight = False
        if done >= REGISTERED and isinstance(error, Exception):
            entry.io_error = error
            self._keep_after_write_error(entry)
            return True
        self._free_extent(entry)
        entry.state = State.DEAD
        if done >= REGISTERED:
            self.release(entry)
        else:
            entry.data = None
        if done >= IN_WINDOW:
            self.window.forget(entry)
        if done >= MAPPED and self._by_storage.get(entry.cdata) is entry:
            del self._by_storage[entry.cdata]
        if done >= COUNTED:
            self.live_entries -= 1
        return False

    def close(self, engine_owned: bool) -> None:
        """Finish in-flight I/O, close routes, engine (when ``engine_owned``) and file; drop all bytes."""
        with self.lock:
            if self._host is not None:
                self._host.drop_waiting_writes()
                self._host.flush()
            engine, self.engine = self.engine, None
        if self.routes is not None:
            self.routes.stop()
        if engine is not None and engine_owned:
            engine.close()
        elif engine is not None:
            # A shared engine outlives this store: its requests on our file must end before the file
            # closes, or the descriptor number, reused by the next open, would receive them.
            self._wait_until(lambda: self._writing == 0 and self._reading == 0)
        try:
            if self.routes is not None:
                self.routes.close()
        finally:
            if self.spill is not None:
                self.spill.close()
            with self.lock:
                for entry in self._by_storage.values():
                    self.release(entry)
                self._by_storage.clear()
                self._lingering.clear()
                self._unpacked.clear()
                self.read_pool.clear()

    def detach(self) -> None:
        """Stop using a spill file, engine and read pool that others share, without closing them.

        Transfers still in flight complete into this store: a dead entry's extent is then given
        back to the shared file, whose allocator is thread-safe.
        """
        with self.lock:
            if self._host is not None:
                self._host.drop_waiting_writes()
                self._host.flush()
            self.engine = None
            self.routes = None
            for entry in self._by_storage.values():
                self.release(entry)
            self._lingering.clear()
            self._unpacked.clear()
            self.read_pool.prefetch_budget_bytes = self.window.budget_bytes  # the pool outlives this store
            self.read_pool = BufferPool(0)

    def forget_after_fork(self) -> None:
        """In a forked child: drop the parent's file, engine and entries without any I/O.

        Locks are replaced (a parent thread may have held one at the fork); the engine is dropped
        unused (its threads do not exist here, its ring is the parent's); the child's copy of the
        file descriptor is closed, so the next entry opens a file of the child's own.
        """
        self.lock = threading.RLock()
        # Note: [A forked child's clocks count none of the parent's transfers]
        # A busy clock counts transfers in flight and adds time only once none is. A child forked while
        # a write was in flight kept that count, and the write never ends in the child: its offloader's
        # write_busy_s stopped growing for good (stats.write_gbps rose with every step), and a profile
        # taken there saw writes take no time (an infinitely fast disk) and planned on that. A
        # completion thread inside the clock's lock at the fork left the child's first transfer
        # waiting for ever. The clocks keep their seconds, and forget the rest.
        self.write_clock.forget_after_fork()
        self.read_clock.forget_after_fork()
        self._writing = self.unwritten_bytes = 0
        self._reading = 0
        self._prefetch_to = None
        self._unpacked = []
        self._idle_waiters = []
        self.fork_seq = self._next_seq
        self._by_storage.clear()
        self._lingering.clear()
        self.live_entries = 0
        self.window.clear()
        if self.spill is not None:
            self.spill.forget_after_fork()
        self.spill = self.engine = self.routes = self._host = None

