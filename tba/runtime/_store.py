"""Storages in flight between memory and the spill file.

The store owns every :class:`StorageEntry` of an offloader and moves their bytes:

* :meth:`~tba.runtime._writes.StoreWrites.save` finds the entry of a tensor's storage (Note [Dedup by
  storage identity] in ``tba/runtime/_writes.py``) or creates one and starts its write: host storages
  straight from their own memory through the host engine, device storages through their route
  (``tba/device/_router.py``). When a write completes the entry is ON_DISK and its memory is dropped,
  unless the prefetch window asked to hold it; a failed write turns it KEPT (memory kept, one
  warning). The write side is ``_writes.py`` (:class:`~tba.runtime._writes.StoreWrites`).
* Reading back, the prefetch window and the release after unpack are in ``_reads.py`` (with ``_unpacked.py``)
  (:class:`~tba.runtime._reads.StoreReads`); releasing bytes, discarding pages and keeping a storage
  whose write failed in ``_release.py`` (:class:`~tba.runtime._release.StoreRelease`). Host
  storages' transfers go to the engine in batches (``_host_io.py``).
* :meth:`~tba.runtime._store_lifetime.StoreLifetime.drop_view` frees an entry's file extent once
  autograd has freed its last view; closing, detaching from a shared runtime and forgetting the
  parent's entries after a fork are there too (``_store_lifetime.py``).

Every state change happens under one lock. Completion callbacks run on engine or device threads;
none of them waits for anything while holding the lock.
"""

from __future__ import annotations

import collections
import logging
import threading
from typing import Any

import torch

from tba._control import wait
from tba._outcome import Outcome
from tba.device import Route, Routes
from tba.io import BufferPool, Engine, SpillFile
from tba.runtime._entry import StorageEntry
from tba.runtime._host_io import HostBatch
from tba.runtime._prefetch import PrefetchWindow
from tba.runtime._reads import StoreReads
from tba.runtime._release import StoreRelease
from tba.runtime._stats import BusyClock, OffloadStats
from tba.runtime._store_lifetime import StoreLifetime
from tba.runtime._writes import StoreWrites

logger = logging.getLogger("tba")

class StorageStore(StoreWrites, StoreReads, StoreRelease, StoreLifetime):
    """Entries, their I/O and their lifetime, for one offloader.

    Args:
        stats: Counters to update.
        window: Prefetch decisions; its budget also bounds the idle read buffers kept for reuse.
    """

    def __init__(self, stats: OffloadStats, window: PrefetchWindow) -> None:
        self.stats = stats
        self.window = window
        self.read_pool = BufferPool(self._budget_bytes)
        self.lock = threading.RLock()
        self.write_clock = BusyClock()
        self.read_clock = BusyClock()
        self.live_entries = 0
        self.spill: SpillFile | None = None
        self.engine: Engine | None = None
        self.routes: Routes | None = None
        self._host_route: object = None
        """``routes.host`` once open (Note [Bytes no one can discard need no lock] in ``tba/runtime/_reads.py``)."""
        self.route_without_consume: object = None
        """The host route where its ``consume`` is :class:`~tba.device.Route`'s no-op, else None."""
        self._host: HostBatch | None = None
        self._writing = 0
        self.unwritten_bytes = 0
        """Bytes of storages whose write is in flight (what a memory budget's write caps bound)."""
        self._reading = 0
        self._unpacked: list[StorageEntry] = []
        """Entries with ``fully_unpacked`` or ``unpacked_views`` set in this backward pass (Note [Each backward pass
        reads ahead] in ``tba/runtime/_unpacked.py``)."""
        self._prefetch_to: StorageEntry | None = None
        """The deepest storage unpacked from memory since the window last moved (Note [One window move
        per batch of unpacks] in ``tba/runtime/_reads.py``)."""
        self._idle_waiters: list[Outcome] = []
        """Outcomes set whenever a transfer ends; :meth:`_wait_until` re-checks its condition then."""
        self._by_storage: dict[int, StorageEntry] = {}
        self._lingering: collections.deque[tuple[StorageEntry, torch.Tensor]] = collections.deque()
        self.pages_discarded_bytes = 0
        """Bytes of storage pages handed back to the kernel early (storages tba proved its own)."""
        self._next_seq = 0
        self.verify = False
        self._warned_verify_device = False
        """Checksum each storage when written and check it when read back (``verify=True``)."""
        self.fork_seq = 0
        """Entries with a smaller ``seq`` were saved by the parent of a forked process: not ours."""

    def open(self, spill: SpillFile, engine: Engine, routes: Routes, read_pool: BufferPool | None = None) -> None:
        """Use ``spill``, ``engine`` and ``routes`` (and ``read_pool``, when they are shared with other stores)."""
        self.spill, self.engine, self.routes = spill, engine, routes
        if read_pool is not None:
            # Note: [One owner of the prefetch budget]
            # The window owns the budget (a fixed one, or its controller's); the read pool asks it
            # whenever a buffer comes back, so nothing copies the number from one to the other.
            read_pool.prefetch_budget_bytes = self._budget_bytes
            self.read_pool = read_pool
            self.read_pool.trim()
        host = routes.host
        self._host_route = host
        # The unpack skips this route's consume (tba/runtime/_unpack_hooks.py): only where it is Route's no-op.
        self.route_without_consume = host if type(host).consume is Route.consume else None
        self._host = HostBatch(host.engine, host.pool, host.block_size_bytes, host.engine.write_ahead_bytes)

    def _budget_bytes(self) -> int:
        """The prefetch budget in force (the window's): the read pool's capacity."""
        return self.window.budget_bytes

    def end_forward(self, last_layer: int | None = None) -> None:
        """Forward is over: size the window for backward, then hold or read what backward needs first.

        ``last_layer``: the last layer forward ran, kept or not (None: unknown; the window takes the last
        one it holds a storage of). Note [Backward through kept layers] in ``tba/runtime/_prefetch.py``.
        """
        with self.lock:
            self._sweep_written(limit=None)
            self.new_pass()
            self.window.end_forward()
            self.read_pool.trim()
        self.prefetch(None, None if last_layer is None else last_layer + 1)

    @property
    def is_open(self) -> bool:
        return self.engine is not None

    def set_prefetch_budget(self, nbytes: int) -> None:
        """Bound bytes read ahead or held for backward, and idle read buffers, from now on."""
        self.window.prefetch_budget_bytes = nbytes
        self.read_pool.trim()

    def update_stats(self) -> None:
        """Bring the counters that live in the clocks and pools into :attr:`stats`."""
        self.stats.write_busy_s = self.write_clock.busy_s
        self.stats.read_busy_s = self.read_clock.busy_s
        self.stats.read_buffers_allocated = self.read_pool.allocated
        self.stats.read_buffers_reused = self.read_pool.reused
        staging = self.routes.staging_pool if self.routes is not None else None
        self.stats.staging_blocks_in_use = staging.capacity_blocks - staging.free_blocks if staging else 0

    def largest_live_storage_bytes(self) -> int:
        """Bytes of the largest storage held for backward now."""
        with self.lock:
            return max((entry.nbytes for entry in self._by_storage.values()), default=0)

    def unwritten_layer_bytes(self) -> int:
        """Bytes of the storages saved in a layer whose write has not finished (one scan of the live
        entries: the profiled steps' measured backlog, once per step)."""
        with self.lock:
            return sum(entry.nbytes for entry in self._by_storage.values()
                       if entry.transfer_in_flight and entry.layer is not None)

    def _transfer_ended(self) -> None:
        waiters, self._idle_waiters = self._idle_waiters, []
        for waiter in waiters:
            waiter.set_result(None)

    def _wait_until(self, done: Any) -> None:
        """Block, without holding the lock, until ``done()`` (checked under the lock) is true."""
        while True:
            with self.lock:
                if done():
                    return
                ended = Outcome()
                self._idle_waiters.append(ended)
            wait(ended)

    def flush(self) -> None:
        """Block until every write queued so far has completed (or failed over to memory)."""
        self._wait_until(lambda: self._writing == 0)

    def hold_back_writes(self, cap_bytes: int) -> None:
        """Block until at most ``cap_bytes`` of storages are being written (none, when ``cap_bytes`` is 0)."""
        self._wait_until(lambda: self.unwritten_bytes <= cap_bytes or self._writing == 0)
