"""Writing saved storages to the spill file: the save side of :class:`tba.runtime._store.StorageStore`.

* :meth:`StoreWrites.save` finds the entry of a tensor's storage (Note [Dedup by storage identity])
  or creates one and starts its write: host storages straight from their own memory through the
  host engine (in batches, ``_host_io.py``), device storages through their route
  (``tba/device/_router.py``).
* When a write completes (:meth:`StoreWrites._finish_write`) the entry is ON_DISK and its memory is
  dropped, unless the prefetch window asked to hold it; a failed write turns it KEPT (memory kept,
  one warning); a write nobody needs any more is skipped (:meth:`StoreWrites._write_wanted`).

Every state change happens under the store's lock; completion callbacks run on engine or device threads.
"""

from __future__ import annotations

import functools
import logging
import threading
import weakref
from typing import TYPE_CHECKING, Any

import torch

from tba import _trace, defaults
from tba._trace import traced
from tba._untrack import untrack
from tba.device import WRITE_NOT_NEEDED
from tba.runtime._entry import State, StorageEntry, storage_bytes
from tba.runtime._store_lifetime import CLOCKED, COUNTED, IN_WINDOW, MAPPED, REGISTERED, WRITING
from tba.runtime._trim import hands_back_pages, owns_its_memory

try:
    from tba import _save
except ImportError:  # the optional extension was not built (setup.py)
    _save = None

if TYPE_CHECKING:
    from tba.device import Route, Routes
    from tba.io import SpillFile
    from tba.runtime._host_io import HostBatch
    from tba.runtime._prefetch import PrefetchWindow
    from tba.runtime._stats import BusyClock, OffloadStats

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
# Nor is an entry shared once its storage has another size: `untyped_storage().resize_()` bumps no
# version, and a view saved after the storage grew reached past the bytes the entry had written
# (torch's bare "Trying to resize storage that is not resizable" at unpack: helper-95). Nor once it
# has other memory: freed with `resize_(0)` and grown back to its size (FSDP's pattern), it is new
# memory, which the program refills through a tensor with a counter of its own; a tensor saved after
# the refill shared the entry written before it, and backward got the old bytes with no error
# (helper-159). An allocator may hand the same address back (tcmalloc does for the same size): nothing
# tba can see tells that memory from the old, so such a save still shares the entry, and gets the new
# bytes only while the program holds the storage (Note [A storage the program still holds is not read
# back] in tba/runtime/_reads.py); read back, the old ones.

# Note: [A host save in C]
# A CPU storage of less than DISCARD_MIN_BYTES on the host route, with no NVTX range to mark (the common save: tens
# of thousands per step, each on the control thread that the forward waits for), is started by the optional
# extension tba._save (native/tba_save.c): `_start_write`'s Python from the storage's bytes to the host batch's
# `write`, in one C call, the same calls on the same objects in the same order (the record's type passed with each
# call, the window, `_resident`, the spill file, the write clock and the host batch stay Python), its own_memory
# False as the expression below gives it for such a storage. Without the extension, or with a build whose ABI or
# record keywords differ from this file's (one warning), the Python below serves; tests/runtime/test_native_save.py
# trains through both (docs/host-cost.md, thirty-second pass).
_SAVE_ABI = 2
_RECORD_KEYWORDS = ("seq", "layer", "nbytes", "phase_bytes", "address", "version", "data", "root", "device", "route",
                    "own_memory", "cdata")


def _native_save() -> Any:
    """``tba._save.start_host_write`` where the extension is built and current, else None (Note [A host save in C])."""
    if _save is None:
        return None
    try:
        _save.configure(_SAVE_ABI, _RECORD_KEYWORDS, torch.ByteTensor, untrack, functools.partial)
    except (RuntimeError, TypeError) as err:  # its ABI or keywords differ; its configure takes other arguments
        logger.warning("tba: %s; tba starts host writes in Python meanwhile (python setup.py build_ext --inplace, or "
                       "reinstall tba)", err)
        return None
    return _save.start_host_write


_start_host_write = _native_save()
NATIVE = _start_host_write is not None
"""Whether a host storage's fresh save runs in ``tba._save`` (Note [A host save in C])."""


class EmptyStorage(Exception):
    """Raised by :meth:`StoreWrites.save` for a storage of no bytes, before it counts anything.

    Note: [An empty storage is not saved]
    A saved view of no elements passes the save's geometry check (``SavedView.uncovered`` in
    ``tba/runtime/_views.py``) whatever its storage holds, and the program may free that storage
    (``untyped_storage().resize_(0)``) between pack and save. There was nothing to write: the spill file
    refused an extent of 0 bytes, after the entry had been counted live and booked in the store, and no view
    ever pointed at it, so it never died, and a warning said the tensor could not be written. The offloader
    never saw its last entry go: a one-shot offloader never closed (its spill file and engine stayed open), and
    a reusable one counted the entry live for good and went on looking for it with full collections as it was
    entered again (Note [Collecting dropped graphs costs a full collection] in ``tba/runtime/_store_owner.py``).
    The save job keeps such a tensor instead (``_save_job`` in ``tba/runtime/_hooks.py``), without a warning:
    it holds no bytes, and backward gets the empty tensor it would get without tba. It is counted as kept
    (``stats.kept_by_reason["empty storage"]``, ``KeepReason.EMPTY_STORAGE``), as every tensor tba keeps in
    memory is: counted nowhere, it made ``tensors_offloaded + tensors_kept`` fall short of the tensors saved.
    """


class StoreWrites:
    """The write half of :class:`~tba.runtime._store.StorageStore`, which sets every attribute used here
    and provides the methods it calls (``_resident``, ``_sweep_written``, ``_release_written``, ``_free_extent``,
    ``_keep_after_write_error``, ``_moved_under_write``, ``_keep_moved``, ``_skip_unwritten``, ``_warn_write_failed``,
    ``_checksum_written``, ``_transfer_ended``, ``_write_not_queued``)."""

    lock: threading.RLock
    stats: OffloadStats
    window: PrefetchWindow
    write_clock: BusyClock
    spill: SpillFile | None
    routes: Routes | None
    live_entries: int
    unwritten_bytes: int
    verify: bool
    _host: HostBatch | None
    _writing: int
    _next_seq: int
    _by_storage: dict[int, StorageEntry]
    _lingering: Any
    _write_not_queued: Any

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
                     or entry.expired() or entry.nbytes != storage.nbytes() or entry.address != storage.data_ptr())
            if fresh:
                entry = self._start_write(storage, layer, version, ready, root)
            else:
                self.stats.bytes_deduplicated += entry.nbytes
            entry.live_views += 1
            self.stats.tensors_offloaded += 1
        return entry, fresh

    def _start_write(self, storage: torch.UntypedStorage, layer: int | None,
                     version: int, ready: Any, root: torch.Tensor) -> StorageEntry:
        # Note: [The common save inline]
        # Run once per saved storage on the control thread, whose Python the forward waits for (docs/host-cost.md,
        # thirty-second pass): the host route's answer of `Routes.for_device` is inline here, and a host storage's
        # write goes to the host batch directly when there is no NVTX range to mark (`_queue_write` serves the
        # device routes and the range). Each is a Python call less per storage.
        device = storage.device
        routes = self.routes
        nbytes = storage.nbytes()
        if not nbytes:  # before anything is counted: Note [An empty storage is not saved]
            raise EmptyStorage
        if device.type not in routes.staged_devices:
            if (device.type == "cpu" and nbytes < defaults.DISCARD_MIN_BYTES and _start_host_write is not None
                    and _trace._annotate() is None):  # Note [A host save in C]
                return _start_host_write(self, storage, device, layer, version, root, nbytes, StorageEntry)
            route = routes.host
        else:
            route = routes.for_device(device)
        data = storage_bytes(storage)
        root_ref = weakref.ref(root)
        untrack(data, root_ref)  # Note [Objects the cycle collector need not see] in tba/_untrack.py
        address = storage.data_ptr()
        phase_bytes = route.phase_bytes(address)
        entry = StorageEntry(
            seq=self._next_seq,
            layer=layer,
            nbytes=nbytes,
            phase_bytes=phase_bytes,
            address=address,
            version=version,
            data=data,
            root=root_ref,
            device=device,
            route=route,
            # Pages are handed back only under glibc (Note [Only glibc's malloc needs pages handed back] in
            # tba/runtime/_trim.py): under a caching allocator nothing lingers and nothing is discarded.
            # Nor is a small storage (Note [Small storages keep their pages] in tba/runtime/_trim.py).
            own_memory=nbytes >= defaults.DISCARD_MIN_BYTES and hands_back_pages() and owns_its_memory(data),
            cdata=storage._weak_ref(),  # last: nothing may raise between taking it and the entry owning it
        )
        self._next_seq += 1
        done = 0  # the steps that took effect: Note [A save that fails after its entry is registered]
        try:
            self.live_entries += 1
            done = COUNTED
            self._by_storage[storage._cdata] = entry
            done = MAPPED
            self.window.add(entry)
            done = IN_WINDOW
            self._resident(nbytes)
            done = REGISTERED
            entry.offset = offset = self.spill.allocate(entry.extent_bytes)
            self._writing += 1
            self.unwritten_bytes += nbytes
            done = WRITING
            entry.transfer_in_flight = True
            self.write_clock.start()
            done = CLOCKED
            if route is routes.host and _trace._annotate() is None:  # Note [No range without nvtx] in tba/_trace.py
                self._host.write(data, phase_bytes, self.spill.fd, offset,
                                 functools.partial(self._on_write_done, entry), functools.partial(self._write_wanted, entry))
            else:
                traced("write", self._queue_write, entry, route, ready)
        except BaseException as err:
            if not self._write_not_queued(entry, err, done):
                raise
        return entry

    def _queue_write(self, entry: StorageEntry, route: Route, ready: Any) -> None:
        """Hand ``entry``'s write to the host batch or to its device route."""
        on_done = functools.partial(self._on_write_done, entry)
        wanted = functools.partial(self._write_wanted, entry)
        if route is self.routes.host:
            self._host.write(entry.data, entry.phase_bytes, self.spill.fd, entry.offset, on_done, wanted)
        else:
            route.write(entry.data, entry.phase_bytes, self.spill.fd, entry.offset, on_done, ready, wanted)

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
        elif self._moved_under_write(entry):  # whatever the write did (EFAULT, where the old memory was unmapped)
            entry.io_error = None
            self._keep_moved(entry)
        elif entry.io_error is not None:
            self._keep_after_write_error(entry)
        else:
            entry.state = State.ON_DISK
            self.stats.storages_written += 1
            self.stats.bytes_written += entry.nbytes
            if not entry.hold_for_backward:
                self._release_written(entry)
        self._transfer_ended()
