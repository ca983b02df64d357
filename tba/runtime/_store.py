"""Storages in flight between memory and the spill file.

The store owns every :class:`StorageEntry` of an offloader and moves their bytes:

* :meth:`StorageStore.save` finds the entry of a tensor's storage (Note [Dedup by storage identity])
  or creates one and starts its write: host storages straight from their own memory through the
  host engine, device storages through their route (``tba/device/_router.py``).
* When a write completes the entry is ON_DISK and its memory is dropped, unless the prefetch window
  asked to hold it; a failed write turns it KEPT (memory kept, one warning).
* :meth:`StorageStore.load` returns an entry's bytes: resident ones at once, otherwise after a read,
  and moves the prefetch window so that the next storages are read meanwhile.
* :meth:`StorageStore.drop_view` frees an entry's file extent once autograd has freed its last view.

Every state change happens under one lock. Completion callbacks run on engine or device threads;
none of them waits for anything while holding the lock.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from concurrent.futures import Future
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from tba import defaults
from tba._control import wait
from tba._trace import nvtx_range
from tba.device import Routes
from tba.errors import TbaReadError
from tba.io import BufferPool, Engine, SpillFile, checksum
from tba.runtime._host_io import HostBatch
from tba.runtime._prefetch import PrefetchWindow
from tba.runtime._stats import BusyClock, OffloadStats
from tba.runtime._trim import discard_pages, owns_its_memory, sole_owner, trimmer
from tba.runtime._views import State, StorageEntry

logger = logging.getLogger("tba")

# A full disk is reported once per process, directory and errno, not once per context: successive
# one-shot contexts (one per step) would otherwise repeat the same warning every step.
_WARNED_WRITE_ERRORS: set[tuple[str, int | None]] = set()
_WARNED_LOCK = threading.Lock()

# Note: [Dedup by storage identity]
# A storage is recognised by its StorageImpl address (`untyped_storage()._cdata`), the same for
# every view of it, and never by its data pointer: the allocator hands a freed data pointer to the
# next allocation of that size, and a key built on it would serve one tensor's bytes for another.
# The entry holds a weak reference to the StorageImpl (StorageWeakRef), which keeps that address
# from being reused for as long as the entry exists, so a key match always means the same storage.
# The tensor's version counter is recorded too: a storage modified in place after it was saved is
# a new snapshot and gets a new entry.


class StorageStore:
    """Entries, their I/O and their lifetime, for one offloader.

    Args:
        stats: Counters to update.
        window: Prefetch decisions; its budget also bounds the idle read buffers kept for reuse.
    """

    def __init__(self, stats: OffloadStats, window: PrefetchWindow) -> None:
        self.stats = stats
        self.window = window
        self.read_pool = BufferPool(window.budget_bytes)
        self.lock = threading.RLock()
        self.write_clock = BusyClock()
        self.read_clock = BusyClock()
        self.live_entries = 0
        self.spill: SpillFile | None = None
        self.engine: Engine | None = None
        self.routes: Routes | None = None
        self._host: HostBatch | None = None
        self._writing = 0
        self._reading = 0
        self._idle_waiters: list[Future] = []
        """Futures set whenever a transfer ends; :meth:`_wait_until` re-checks its condition then."""
        self._by_storage: dict[int, StorageEntry] = {}
        self._lingering: dict[int, tuple[StorageWeakRef, torch.Tensor]] = {}
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
            self.read_pool = read_pool
            self._sync_pool_capacity()
        host = routes.host
        self._host = HostBatch(host.engine, host.pool, host.block_size_bytes)

    def _sync_pool_capacity(self) -> None:
        """Idle read buffers follow the prefetch budget in force."""
        self.read_pool.prefetch_budget_bytes = self.window.budget_bytes
        if self.read_pool.idle_bytes > self.read_pool.prefetch_budget_bytes:
            self.read_pool.clear()

    def end_forward(self) -> None:
        """Forward is over: size the window for backward, then hold or read what backward needs first."""
        with self.lock:
            self._sweep_written(limit=None)
            self.window.end_forward()
            self._sync_pool_capacity()
        self.prefetch(None)

    @property
    def is_open(self) -> bool:
        return self.engine is not None

    def set_prefetch_budget(self, nbytes: int) -> None:
        """Bound bytes read ahead or held for backward, and idle read buffers, from now on."""
        self.window.prefetch_budget_bytes = nbytes
        self.read_pool.prefetch_budget_bytes = nbytes
        if self.read_pool.idle_bytes > nbytes:
            self.read_pool.clear()

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

    # ----------------------------------------------------------------- write
    def save(self, tensor: torch.Tensor, layer: int | None, version: int) -> tuple[StorageEntry, bool]:
        """The entry holding ``tensor``'s storage at ``version``, and whether it was created (and its write started)."""
        storage = tensor.untyped_storage()
        with self.lock:
            if self._lingering:
                self._sweep_written()
            entry = self._by_storage.get(storage._cdata)
            fresh = entry is None or entry.version != version or entry.state is State.DEAD or entry.ref.expired()
            if fresh:
                entry = self._start_write(tensor, storage, layer, version)
            else:
                self.stats.bytes_deduplicated += entry.nbytes
            entry.live_views += 1
            self.stats.tensors_offloaded += 1
        return entry, fresh

    def _start_write(self, tensor: torch.Tensor, storage: torch.UntypedStorage, layer: int | None,
                     version: int) -> StorageEntry:
        route = self.routes.for_device(tensor.device)
        entry = StorageEntry(
            seq=self._next_seq,
            layer=layer,
            nbytes=storage.nbytes(),
            phase_bytes=route.phase_bytes(storage.data_ptr()),
            version=version,
            ref=StorageWeakRef(storage),
            data=torch.empty((0,), dtype=torch.uint8, device=tensor.device).set_(storage),
            device=tensor.device,
            route=route,
            own_memory=owns_its_memory(storage),
        )
        self._next_seq += 1
        self.live_entries += 1
        self._by_storage[storage._cdata] = entry
        self.window.add(entry)
        self._resident(entry.nbytes)
        entry.offset = self.spill.allocate(entry.extent_bytes)
        self._writing += 1
        entry.transfer_in_flight = True
        self.write_clock.start()
        with nvtx_range("write"):
            on_done = functools.partial(self._on_write_done, entry)
            if route is self.routes.host:
                self._host.write(entry.data, entry.phase_bytes, self.spill.fd, entry.offset, on_done)
            else:
                route.write(entry.data, entry.phase_bytes, self.spill.fd, entry.offset, on_done)
        return entry

    def _on_write_done(self, entry: StorageEntry, error: BaseException | None) -> None:
        self.write_clock.stop()
        if self.verify and error is None:
            self._checksum_written(entry)
        with self.lock:
            entry.transfer_in_flight = False
            entry.io_error = error
            self._finish_write(entry)

    def _checksum_written(self, entry: StorageEntry) -> None:
        """Record the CRC-32C of the bytes just written (a function of its own: no reference outlives it)."""
        data = entry.data
        if data is None:
            return
        if data.device.type == "cpu":
            entry.checksum = checksum(data)
        elif not self._warned_verify_device:
            self._warned_verify_device = True
            logger.warning("tba: verify=True checks host storages only; %s storages are not checksummed",
                           data.device.type)

    def _finish_write(self, entry: StorageEntry) -> None:
        self._writing -= 1
        if entry.state is State.DEAD:
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
                ended: Future = Future()
                self._idle_waiters.append(ended)
            wait(ended)

    def _keep_after_write_error(self, entry: StorageEntry) -> None:
        error, entry.io_error = entry.io_error, None
        entry.state = State.KEPT
        self.window.discount(entry)
        self._free_extent(entry)
        self.stats.tensors_kept_on_error += 1
        self.stats.bytes_kept_on_error += entry.nbytes
        key = (self.spill.directory, getattr(error, "errno", None))
        with _WARNED_LOCK:
            first = key not in _WARNED_WRITE_ERRORS
            _WARNED_WRITE_ERRORS.add(key)
        if not first:
            logger.debug("tba: write to %s failed again (%s); kept in memory", self.spill.directory, error)
        else:
            logger.warning(
                "tba: writing activations to %s failed (%s); keeping them in memory instead and "
                "training goes on (stats.bytes_kept_on_error counts them). Free space there or "
                "pass another directory.",
                self.spill.directory,
                error,
            )

    def flush(self) -> None:
        """Block until every write queued so far has completed (or failed over to memory)."""
        self._wait_until(lambda: self._writing == 0)

    # ----------------------------------------------------------------- read
    def resident(self, entry: StorageEntry) -> tuple[torch.Tensor | None, Any]:
        """``entry``'s bytes and event when they are in memory now, else ``(None, None)``; changes nothing.

        Note: [An unpack holds its own reference]
        The caller rebuilds its view outside the lock. Handing it ``entry.data`` itself left the
        storage with one tensor: a write completing meanwhile found tba the only owner and
        discarded the pages, and backward read zeros. An alias made under the lock counts as a
        second owner until the caller is done with it. Taking the lock in the training thread is
        safe from asynchronous exceptions: ``with`` releases it, and nothing here changes state.
        """
        with self.lock:
            data = entry.data
            return (data.detach(), entry.ready_event) if data is not None else (None, None)

    def served_from_memory(self, entry: StorageEntry, view_id: int) -> None:
        """After an unpack found ``entry`` resident: count it, move the window, release what is done."""
        with self.lock:
            if self._lingering:
                self._sweep_written()
            self.stats.unpacks_from_memory += 1
            self.window.note_served_from_memory()
        self.prefetch(entry)
        self.note_unpacked(entry, view_id)

    def start_load(self, entry: StorageEntry) -> tuple[torch.Tensor | None, Any, Future | None]:
        """``(bytes, event, None)`` when resident, else ``(None, None, read)`` for :meth:`wait_read`.

        Starts the read if needed and moves the prefetch window; never waits. The caller counts
        the unpack with :meth:`note_unpacked` (or :meth:`served_from_memory` when it was resident).
        """
        with self.lock:
            if self._lingering:
                self._sweep_written()
            data, done = (entry.data.detach() if entry.data is not None else None), entry.read_done
            if data is None and done is None:
                done = self._start_read(entry)
                self._host.flush()
        self.prefetch(entry)
        if data is not None:
            with self.lock:
                self.stats.unpacks_from_memory += 1
                self.window.note_served_from_memory()
                return data, entry.ready_event, None
        return None, None, done

    def _start_read(self, entry: StorageEntry) -> Future:
        """Queue the read of ``entry``; the future resolves to ``(bytes, event)``."""
        done = entry.read_done = Future()
        entry.transfer_in_flight = True
        self._reading += 1
        self.read_clock.start()
        with nvtx_range("read"):
            on_done = functools.partial(self._on_read_done, entry)
            if entry.route is self.routes.host:
                self._host.read(entry.nbytes, entry.phase_bytes, self.spill.fd, entry.offset, on_done)
            else:
                entry.route.read(entry.device, entry.nbytes, entry.phase_bytes, self.spill.fd, entry.offset, on_done)
        return done

    def _on_read_done(self, entry: StorageEntry, error: BaseException | None, data: Any, event: Any) -> None:
        self.read_clock.stop()
        if error is None and entry.checksum is not None:
            error = self._verify(entry, data)
        with self.lock:
            entry.transfer_in_flight = False
            self._reading -= 1
            self._transfer_ended()
            done, entry.read_done = entry.read_done, None
            if entry.state is State.DEAD:
                self._free_extent(entry)
                done.cancel()
            elif error is not None:
                done.set_exception(error)
            else:
                entry.data, entry.ready_event = data, event
                self._resident(entry.nbytes)
                self.stats.bytes_read += entry.nbytes
                done.set_result((entry.data, event))

    def _verify(self, entry: StorageEntry, data: torch.Tensor) -> TbaReadError | None:
        """None when ``data`` has the checksum ``entry`` was written with, else the error to raise."""
        got = checksum(data)
        with self.lock:
            self.stats.bytes_verified += entry.nbytes
        if got == entry.checksum:
            return None
        return TbaReadError(
            f"verify: {entry.describe()} read back from the spill file in {self.spill.directory} (offset "
            f"{entry.offset}, {entry.extent_bytes} bytes) differs from what was written (CRC-32C {got:#010x}, "
            f"written {entry.checksum:#010x}): the file was changed underneath tba (another process, a punched "
            "hole, a failing disk); its gradients cannot be computed, run the step again"
        )

    def wait_read(self, entry: StorageEntry, done: Future) -> tuple[torch.Tensor, Any]:
        start = time.perf_counter()
        try:
            with nvtx_range("wait_read"):
                result = wait(done)
        except OSError as err:
            raise TbaReadError(
                f"cannot read back {entry.describe()}: spill file in {self.spill.directory}, "
                f"offset {entry.offset}, {entry.extent_bytes} bytes: {err}"
            ) from err
        with self.lock:
            self.stats.unpacks_waited += 1
            self.stats.unpack_wait_s += time.perf_counter() - start
            self.window.note_wait()
            self.read_pool.prefetch_budget_bytes = self.window.budget_bytes
        return result

    def note_unpacked(self, entry: StorageEntry, view_id: int) -> None:
        """After every live view of a storage was unpacked, its bytes are not needed in memory.

        Views are counted by identity, not unpack calls: autograd may unpack one view twice before
        another view of the same storage is used, and that must not drop the bytes early.
        """
        with self.lock:
            entry.unpacked_views.add(view_id)
            if len(entry.unpacked_views) < entry.live_views:
                return
            entry.unpacked_views.clear()
            entry.fully_unpacked = True
            self.window.discount(entry)
            entry.hold_for_backward = False
            if entry.state is State.ON_DISK:
                self.release(entry)

    def prefetch(self, entry: StorageEntry | None) -> None:
        """Move the prefetch window to ``entry`` (None: the end of forward) and queue its work."""
        with self.lock, nvtx_range("prefetch"):
            if not self.is_open:
                return
            to_read, to_hold = self.window.select(entry)
            for held in to_hold:
                held.hold_for_backward = True
            for target in to_read:
                self._start_read(target)
            self._host.flush()

    # ----------------------------------------------------------------- lifetime
    def drop_view(self, entry: StorageEntry, view_id: int) -> bool:
        """A view of ``entry`` was freed; returns True when no entry is left alive."""
        with self.lock:
            if self._lingering:
                self._sweep_written()
            entry.live_views -= 1
            entry.unpacked_views.discard(view_id)
            if entry.live_views > 0:
                return False
            if self._by_storage.get(entry.ref.cdata) is entry:
                del self._by_storage[entry.ref.cdata]
            entry.state = State.DEAD
            self.release(entry)
            self.window.forget(entry)
            if not entry.transfer_in_flight:
                self._free_extent(entry)
            self.live_entries -= 1
            return self.live_entries == 0

    def close(self, engine_owned: bool) -> None:
        """Finish in-flight I/O, close routes, engine (when ``engine_owned``) and file; drop all bytes."""
        with self.lock:
            if self._host is not None:
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
        if self.routes is not None:
            self.routes.close()
        if self.spill is not None:
            self.spill.close()
        with self.lock:
            for entry in self._by_storage.values():
                self.release(entry)
            self._by_storage.clear()
            self._lingering.clear()
            self.read_pool.clear()

    def detach(self) -> None:
        """Stop using a spill file, engine and read pool that others share, without closing them.

        Transfers still in flight complete into this store: a dead entry's extent is then given
        back to the shared file, whose allocator is thread-safe.
        """
        with self.lock:
            if self._host is not None:
                self._host.flush()
            self.engine = None
            self.routes = None
            for entry in self._by_storage.values():
                self.release(entry)
            self._lingering.clear()
            self.read_pool = BufferPool(0)

    def forget_after_fork(self) -> None:
        """In a forked child: drop the parent's file, engine and entries without any I/O.

        Locks are replaced (a parent thread may have held one at the fork); the engine is dropped
        unused (its threads do not exist here, its ring is the parent's); the child's copy of the
        file descriptor is closed, so the next entry opens a file of the child's own.
        """
        self.lock = threading.RLock()
        self._writing = 0
        self._reading = 0
        self._idle_waiters = []
        self.fork_seq = self._next_seq
        self._by_storage.clear()
        self._lingering.clear()
        self.live_entries = 0
        self.window.clear()
        if self.spill is not None:
            self.spill.forget_after_fork()
        self.spill = self.engine = self.routes = self._host = None

    def _free_extent(self, entry: StorageEntry) -> None:
        if entry.offset >= 0:
            self.spill.free(entry.offset)
            entry.offset = -1

    def _release_written(self, entry: StorageEntry) -> None:
        """Drop a written storage's bytes; a host storage's pages go back to the kernel (``tba/runtime/_trim.py``).

        Its pages are discarded only while tba holds the last reference. While the program still
        uses the tensor, the entry is released as usual (unpack reads the file), but a hidden
        reference lingers in ``_lingering`` until :meth:`_sweep_written`, at the next save or
        unpack, finds it the last one: then the pages go back to the kernel before the memory is freed.
        """
        data = entry.data
        if data is not None and entry.own_memory and self.routes is not None and entry.route is self.routes.host:
            if sole_owner(entry.ref):
                self.pages_discarded_bytes += discard_pages(data.data_ptr(), entry.nbytes)
            else:
                self._lingering[entry.seq] = (entry.ref, data)
        self.release(entry)

    def _sweep_written(self, limit: int | None = defaults.LINGER_SWEEP_PER_CALL) -> None:
        """Free lingering written storages that the program has stopped using, pages first.

        Note: [A bounded sweep per tensor]
        Saves and unpacks each look at ``limit`` lingering storages, oldest first, and move those still in
        use to the back: a program that holds thousands of saved outputs (a list of per-sample results)
        made every save and unpack scan all of them, quadratic in the tensors per step. ``limit=None``
        (at the end of forward and of backward) looks at every one.
        """
        count = len(self._lingering) if limit is None else min(limit, len(self._lingering))
        for _ in range(count):
            seq = next(iter(self._lingering))
            ref, data = self._lingering.pop(seq)
            if sole_owner(ref):
                self.pages_discarded_bytes += discard_pages(data.data_ptr(), data.numel())
            else:
                self._lingering[seq] = (ref, data)

    def release(self, entry: StorageEntry) -> None:
        """Drop tba's reference to ``entry``'s bytes in memory."""
        if entry.data is not None:
            entry.data = None
            entry.ready_event = None
            self._resident(-entry.nbytes)
            trimmer.note_released(entry.nbytes)

    def _resident(self, delta_bytes: int) -> None:
        stats = self.stats
        stats.resident_bytes += delta_bytes
        stats.peak_resident_bytes = max(stats.peak_resident_bytes, stats.resident_bytes)
