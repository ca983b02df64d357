"""Storages in flight between memory and the spill file.

The store owns every :class:`StorageEntry` of an offloader and moves their bytes:

* :meth:`StorageStore.save` finds the entry of a tensor's storage (Note [Dedup by storage identity])
  or creates one and starts its write: host storages straight from their own memory through the
  host engine, device storages through their route (``tba/device/_router.py``).
* When a write completes the entry is ON_DISK and its memory is dropped, unless the prefetch window
  asked to hold it; a failed write turns it KEPT (memory kept, one warning).
* Reading back, the prefetch window and the release after unpack are in ``_reads.py``
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
import functools
import logging
import threading
import weakref
from typing import Any

import torch

from tba import defaults
from tba._control import wait
from tba._outcome import Outcome
from tba._trace import nvtx_range
from tba.device import WRITE_NOT_NEEDED, Routes
from tba.io import BufferPool, Engine, SpillFile
from tba.runtime._host_io import HostBatch
from tba.runtime._prefetch import PrefetchWindow
from tba.runtime._reads import StoreReads
from tba.runtime._release import StoreRelease
from tba.runtime._stats import BusyClock, OffloadStats
from tba.runtime._store_lifetime import StoreLifetime
from tba.runtime._trim import hands_back_pages, owns_its_memory
from tba.runtime._views import State, StorageEntry, storage_bytes

logger = logging.getLogger("tba")

# Note: [Dedup by storage identity]
# A storage is recognised by its StorageImpl address (`untyped_storage()._cdata`), the same for
# every view of it, and never by its data pointer: the allocator hands a freed data pointer to the
# next allocation of that size, and a key built on it would serve one tensor's bytes for another.
# The entry holds a weak reference to the StorageImpl (StorageWeakRef), which keeps that address
# from being reused for as long as the entry exists, so a key match always means the same storage.
# The tensor's version counter is recorded too: a storage modified in place after it was saved is
# a new snapshot and gets a new entry.
#
# Note: [One entry per version counter]
# A version is a number on one counter, and one storage can carry several counters: the pieces of
# `unsafe_chunk` and `unsafe_split`, which ATen's LSTM cell uses for its gates, share their storage
# but not their counter. The cell saves the first gate after its in-place sigmoid, then applies the
# next one to another piece of the same storage, and saves that piece at the same version number
# on its own counter. Matched by storage and number, the second save shared the first one's entry,
# whose write had sometimes already taken the bytes from before the second sigmoid: an LSTMCell, or
# an LSTM over a PackedSequence, got wrong gradients now and then with no error. So an entry is
# shared only by tensors of one view family, which share one counter: the saved tensor's root (its
# `_base` when it is a view, else itself) must be the entry's. Another family gets an entry and a
# write of its own, each taken after its save. A `detach()` alias is a family of its own although
# it shares its counter: its storage is written twice, which costs time, never exactness. The entry
# holds its root through a weak reference, not by address: a root that died (its storage kept alive
# by the program) left its address to the next tensor made, and a `.data` alias of the same storage
# made after it was saved at the same version number shared the dead root's entry and its bytes.


class StorageStore(StoreReads, StoreRelease, StoreLifetime):
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
        self._host: HostBatch | None = None
        self._writing = 0
        self.unwritten_bytes = 0
        """Bytes of storages whose write is in flight (what a memory budget's write caps bound)."""
        self._reading = 0
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

    # ----------------------------------------------------------------- write
    def save(self, tensor: torch.Tensor, storage: torch.UntypedStorage, layer: int | None, version: int,
             ready: Any = None) -> tuple[StorageEntry, bool]:
        """The entry holding ``storage`` at ``version``, and whether it was created (and its write started).

        ``storage``: the one ``tensor`` had when it was packed (Note [A save writes the storage its tensor
        had at pack] in tba/runtime/_views.py). ``ready``: the route's :meth:`~tba.device.Route.mark_ready`,
        taken when the tensor was produced (None for host tensors); the write's copy is ordered after it.
        """
        base = tensor._base
        root = tensor if base is None else base  # Note [One entry per version counter]
        with self.lock:
            if self._lingering:
                self._sweep_written()
            entry = self._by_storage.get(storage._cdata)
            fresh = (entry is None or entry.version != version or entry.root() is not root or entry.state is State.DEAD
                     or entry.expired())
            if fresh:
                entry = self._start_write(storage, layer, version, ready, weakref.ref(root))
            else:
                self.stats.bytes_deduplicated += entry.nbytes
            entry.live_views += 1
            self.stats.tensors_offloaded += 1
        return entry, fresh

    def _start_write(self, storage: torch.UntypedStorage, layer: int | None,
                     version: int, ready: Any, root: weakref.ref) -> StorageEntry:
        device = storage.device
        route = self.routes.for_device(device)
        data = storage_bytes(storage)
        nbytes = storage.nbytes()
        address = storage.data_ptr()
        entry = StorageEntry(
            seq=self._next_seq,
            layer=layer,
            nbytes=nbytes,
            phase_bytes=route.phase_bytes(address),
            address=address,
            version=version,
            data=data,
            root=root,
            device=device,
            route=route,
            # Pages are handed back only under glibc (Note [Only glibc's malloc needs pages handed back] in
            # tba/runtime/_trim.py): under a caching allocator nothing lingers and nothing is discarded.
            # Nor is a small storage (Note [Small storages keep their pages] in tba/runtime/_trim.py).
            own_memory=hands_back_pages() and nbytes >= defaults.DISCARD_MIN_BYTES and owns_its_memory(data),
            cdata=storage._weak_ref(),  # last: nothing may raise between taking it and the entry owning it
        )
        self._next_seq += 1
        self.live_entries += 1
        self._by_storage[storage._cdata] = entry
        self.window.add(entry)
        self._resident(entry.nbytes)
        entry.offset = self.spill.allocate(entry.extent_bytes)
        self._writing += 1
        self.unwritten_bytes += entry.nbytes
        entry.transfer_in_flight = True
        self.write_clock.start()
        with nvtx_range("write"):
            on_done = functools.partial(self._on_write_done, entry)
            wanted = functools.partial(self._write_wanted, entry)
            if route is self.routes.host:
                self._host.write(entry.data, entry.phase_bytes, self.spill.fd, entry.offset, on_done, wanted)
            else:
                route.write(entry.data, entry.phase_bytes, self.spill.fd, entry.offset, on_done, ready, wanted)
        return entry

    def _on_write_done(self, entry: StorageEntry, error: BaseException | None) -> None:
        self.write_clock.stop()
        if self.verify and error is None:
            self._checksum_written(entry)
        with self.lock:
            entry.transfer_in_flight = False
            entry.io_error = error
            self._finish_write(entry)

    def _write_wanted(self, entry: StorageEntry) -> bool:
        """Whether a write not yet started still serves anything (Note [A write nobody needs is not started]).

        Not once the storage is dead, nor once backward has unpacked every view of it, nor while the
        prefetch window holds it for backward: its bytes are resident, and they stay so (the entry is
        kept) until it dies, for a second backward through a retained graph too.
        """
        with self.lock:
            return entry.state is not State.DEAD and not entry.fully_unpacked and not entry.hold_for_backward

    def _finish_write(self, entry: StorageEntry) -> None:
        self._writing -= 1
        self.unwritten_bytes -= entry.nbytes
        if entry.io_error is WRITE_NOT_NEEDED:
            self._skip_unwritten(entry)
        elif entry.state is State.DEAD:
            if entry.io_error is None:  # written, though nothing will read it: the bytes did move to the file
                self.stats.storages_written += 1
                self.stats.bytes_written += entry.nbytes
            else:
                # Note: [A write that fails after its storage died still warns]
                # Nothing is kept (the storage is gone), but the disk refused a write: a backward faster
                # than the writes can free every storage first, and then a full disk or a file-size limit
                # was never reported, step after step (test_faults' ulimit case saw no warning under load).
                self._warn_write_failed(entry.io_error, entry.offset + entry.extent_bytes, kept=False)
                entry.io_error = None
            self._free_extent(entry)
        elif entry.io_error is not None:
            self._keep_after_write_error(entry)
        else:
            entry.state = State.ON_DISK
            self.stats.storages_written += 1
            self.stats.bytes_written += entry.nbytes
            if not entry.hold_for_backward:
                self._release_written(entry)
        self._transfer_ended()

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
