"""Reading offloaded storages back: the unpack side of :class:`tba.runtime._store.StorageStore`.

* :meth:`StoreReads.resident` hands the training thread an entry's bytes when they are in memory
  (Note [An unpack holds its own reference]); the bookkeeping of that unpack is deferred
  (:meth:`StoreReads.served_from_memory`).
* :meth:`StoreReads.start_load` starts the read of a storage that is not resident and moves the
  prefetch window (:meth:`StoreReads.prefetch`), which queues the reads backward needs next;
  ``wait_read`` (``tba/runtime/_read_wait.py``) waits for one in the caller's thread.
* :meth:`~tba.runtime._unpacked.StoreUnpacked.note_unpacked` (``tba/runtime/_unpacked.py``) releases the bytes
  once every live view was unpacked.

Every state change happens under the store's lock, on the control thread or on an engine thread.
"""

from __future__ import annotations

import functools
import sys
import threading
from typing import TYPE_CHECKING, Any

import torch

from tba._control import after_batch
from tba._outcome import Outcome
from tba._trace import nvtx_range, traced
from tba._untrack import untrack
from tba.errors import TbaError
from tba.runtime._entry import State, StorageEntry, storage_bytes
from tba.runtime._read_wait import StoreReadWait
from tba.runtime._unpacked import StoreUnpacked

if TYPE_CHECKING:
    from collections.abc import Callable

    from tba.device import Routes
    from tba.io import BufferPool, SpillFile
    from tba.runtime._host_io import HostBatch
    from tba.runtime._prefetch import PrefetchWindow
    from tba.runtime._stats import BusyClock, OffloadStats


# Note: [A read nobody waits for has no future]
# Most reads are prefetched: the unpack that needs the bytes finds them resident and never waits. A
# waitable outcome per read was a measurable part of backward's cost per
# storage (docs/host-cost.md), so a read in flight is marked UNWATCHED, and start_load replaces the
# mark with an Outcome (tba/_outcome.py) only when an unpack must wait for that read. A failed read nobody waited for
# leaves the entry on disk: the unpack that needs it reads again and sees the error itself.
UNWATCHED: Any = object()
"""``entry.read_done`` of a read in flight that no unpack waits for yet."""


_GIL = getattr(sys, "_is_gil_enabled", lambda: True)()
"""Whether this interpreter has a GIL (Note [Bytes no one can discard need no lock])."""


class StoreReads(StoreReadWait, StoreUnpacked):
    """The read half of :class:`~tba.runtime._store.StorageStore`, which sets every attribute used here
    and provides the lifetime methods it calls (``release``, ``_free_extent``, ``_sweep_written``). Waiting for a read and
    checking what it brought are its base's (``tba/runtime/_read_wait.py``), what an unpack leaves done its other
    base's (``tba/runtime/_unpacked.py``)."""

    lock: threading.RLock
    stats: OffloadStats
    window: PrefetchWindow
    read_pool: BufferPool
    read_clock: BusyClock
    spill: SpillFile | None
    routes: Routes | None
    _host: HostBatch | None
    _reading: int
    _prefetch_to: StorageEntry | None
    _host_route: object
    _unpacked: list[StorageEntry]
    _idle_waiters: list[Outcome]

    def resident(self, entry: StorageEntry) -> tuple[torch.Tensor | None, Any]:
        """``entry``'s bytes and event when they are in memory now, else ``(None, None)``.

        In memory: held by tba, or still held by the program (:meth:`_live_bytes`).

        Note: [An unpack holds its own reference]
        The caller rebuilds its view outside the lock. Handing it ``entry.data`` itself left the
        storage with one tensor: a write completing meanwhile found tba the only owner and
        discarded the pages, and backward read zeros. An alias made under the lock counts as a
        second owner until the caller is done with it. Taking the lock in the training thread is
        safe from asynchronous exceptions: ``with`` releases it, and nothing here changes state.

        Note: [Bytes no one can discard need no lock]
        The lock orders the alias before a discard, and only a storage with ``own_memory`` is ever
        discarded (``tba/runtime/_release.py``). ``own_memory`` only goes from True to False (set at
        save, cleared when a read lands, ``_on_read_done``), and from then on ``entry.data`` is a read
        buffer or None, never the discardable storage again. So once it reads False, the tensor in
        ``entry.data`` (one load under the GIL) holds its storage alive by itself: a storage nobody
        discards, or a read buffer that goes back to its pool only when its storage dies
        (``BufferPool.lease``). A release meanwhile drops tba's reference, not the caller's. Host
        entries only: a device route's ``ready_event`` is set after ``data`` and must be read with it.
        The argument needs the GIL (each load sequentially ordered): a free-threaded build takes the lock.
        The training thread then takes no lock in an unpack served from tba's memory, where it waited
        for a control thread holding the lock across a ring submission (docs/host-cost.md, fourteenth
        pass).
        """
        if _GIL and not entry.own_memory and entry.route is self._host_route:
            data = entry.data
            if data is not None:
                return data, None
        with self.lock:
            data = entry.data
            if data is not None:
                return data.detach(), entry.ready_event
            data = self._live_bytes(entry)
            if data is not None:
                self.stats.unpacks_from_live_storage += 1
            return data, None

    def _live_bytes(self, entry: StorageEntry) -> torch.Tensor | None:
        """The bytes of a written host storage that is still alive with its memory, else None (under the lock).

        Note: [A storage the program still holds is not read back]
        Writing a storage releases tba's reference to it, but the program may still hold it (a list of
        outputs, a tensor kept for logging, a hook's copy of an activation) until backward. Reading it
        back then moved bytes that were still in memory, and held them twice. The entry's weak
        reference tells whether the storage is alive; if it still has the memory it had when saved
        (same address and size: nothing resized or swapped it), backward uses it, exactly as autograd
        would without tba. An in-place change through the saved tensor, its base or any view of them
        is still caught by the version check before this; a change through a tensor with a version
        counter of its own would go unnoticed by autograd without tba too. Under glibc tba hands a
        written storage's pages back to the kernel once it alone holds the storage
        (``tba/runtime/_release.py``); a reference of tba's own that is not counted as an owner (the
        write being sent, in another thread) can keep such a storage alive with pages that now read
        as zeros, so a storage whose pages were handed back is never served live
        (``entry.pages_discarded``, set under the same lock). Device storages are always read back
        (their memory's stream order is not tba's to prove).
        """
        if (entry.state is not State.ON_DISK or entry.pages_discarded or self.routes is None
                or entry.route is not self.routes.host):
            return None
        storage = torch.UntypedStorage._new_with_weak_ptr(entry.cdata)
        if storage is None or storage.data_ptr() != entry.address or storage.nbytes() != entry.nbytes:
            return None
        return storage_bytes(storage)

    def served_from_memory(self, entry: StorageEntry, view_id: int) -> None:
        """After an unpack found ``entry`` resident: count it, release what is done, move the window.

        Note: [One window move per batch of unpacks]
        These run as deferred jobs, several per wake-up of the control thread. Each used to move
        the prefetch window and submit its reads on its own: a walk and a ring submission per
        saved tensor. The window now moves once per batch, to the deepest storage the batch
        unpacked (the lowest ``seq``: backward runs from the last storage to the first), where the
        last of the per-unpack moves would have left it; an unpack that must wait for a read still
        moves it at once (:meth:`start_load`).
        """
        with self.lock:
            if self._lingering:
                self._sweep_written()
            self.stats.unpacks_from_memory += 1
            self.window.note_served_from_memory()
            self._unpacked_view(entry, view_id)
            deepest = self._prefetch_to
            if deepest is None:
                self._prefetch_to = entry
                after_batch(self._prefetch_batch)
            elif entry.seq < deepest.seq:
                self._prefetch_to = entry

    def _prefetch_batch(self) -> None:
        """Move the window once for the unpacks of this batch (Note [One window move per batch of unpacks])."""
        with self.lock:
            entry, self._prefetch_to = self._prefetch_to, None
        if entry is not None:
            self.prefetch(entry)

    def start_load(self, entry: StorageEntry) -> tuple[torch.Tensor | None, Any, Outcome | None]:
        """``(bytes, event, None)`` when resident, else ``(None, None, read)`` for :meth:`wait_read`.

        Starts the read if needed and moves the prefetch window; never waits. The caller counts
        the unpack with :meth:`note_unpacked` (or :meth:`served_from_memory` when it was resident).
        """
        with self.lock:
            if self._lingering:
                self._sweep_written()
            data, done = (entry.data.detach() if entry.data is not None else None), entry.read_done
            if data is None and done is None:
                done = self._start_read(entry, watched=True)
                self._host.flush()
            elif data is None and done is UNWATCHED:
                done = entry.read_done = Outcome()
        self.prefetch(entry)
        if data is not None:
            with self.lock:
                self.stats.unpacks_from_memory += 1
                self.window.note_served_from_memory()
                return data, entry.ready_event, None
        return None, None, done

    def _start_read(self, entry: StorageEntry, watched: bool = False) -> Outcome | None:
        """Queue the read of ``entry``; ``watched``: the caller waits for it, through the future returned.

        An entry whose extent was freed (offset -1) has nothing in the file to read: reading offset -1 gave
        wrong bytes, silently, under a mutant that kept a skipped write's entry as written (helper-58), so
        such a read, which only a fault of tba's own bookkeeping can ask for, raises instead.
        """
        if entry.offset < 0:
            raise TbaError(f"cannot read back {entry.describe()}: its bytes are in neither memory nor the spill file "
                           "(an internal error of tba; please report it); run forward again")
        done = entry.read_done = Outcome() if watched else UNWATCHED
        entry.transfer_in_flight = True
        self._reading += 1
        self.read_clock.start()
        on_done = functools.partial(self._on_read_done, entry)
        traced("read", self._send_read, entry, on_done)  # Note [No range without nvtx] in tba/_trace.py
        return done if watched else None

    def _send_read(self, entry: StorageEntry, on_done: Callable[..., None]) -> None:
        if entry.route is self.routes.host:
            self._host.read(entry.nbytes, entry.phase_bytes, self.spill.fd, entry.offset, on_done)
        else:
            entry.route.read(entry.device, entry.nbytes, entry.phase_bytes, self.spill.fd, entry.offset, on_done)

    def _on_read_done(self, entry: StorageEntry, error: BaseException | None, data: Any, event: Any) -> None:
        self.read_clock.stop()
        if error is None and entry.checksum is not None:
            error = self._verify(entry, data)
        with self.lock:
            entry.transfer_in_flight = False
            self._reading -= 1
            if self._reading == 0:
                self.window.note_reads_idle()
            if self._idle_waiters:
                self._transfer_ended()
            done, entry.read_done = entry.read_done, None
            waited = done is not UNWATCHED
            if entry.state is State.DEAD:
                self._free_extent(entry)
                if waited:  # nobody waits any more (its view is gone), but a waiter must not hang
                    done.set_exception(TbaError(f"{entry.describe()} was freed while it was being read back"))
            elif error is not None:
                if waited:
                    done.set_exception(error)
            else:
                untrack(data)  # Note [Objects the cycle collector need not see] in tba/_untrack.py
                entry.data, entry.ready_event = data, event
                entry.own_memory = False  # a read buffer of tba's pool now, never discarded
                self._resident(entry.nbytes)
                self.stats.bytes_read += entry.nbytes
                if waited:
                    done.set_result((entry.data, event))

    def backward_reached(self, layer: int) -> None:
        """Backward unpacked a kept tensor of ``layer``: read what the layers below it need next
        (Note [Backward through kept layers] in ``tba/runtime/_prefetch.py``). Nothing in forward."""
        if self.window.in_backward:
            self.prefetch(None, layer)

    def prefetch(self, entry: StorageEntry | None, layer: int | None = None) -> None:
        """Move the prefetch window to ``entry`` (None: the end of forward, or ``layer``'s backward) and queue its work."""
        with self.lock, nvtx_range("prefetch"):
            if not self.is_open:
                return
            to_read, to_hold = self.window.select(entry, layer)
            for held in to_hold:
                held.hold_for_backward = True
            for target in to_read:
                if self._live_bytes(target) is not None:
                    self.window.discount(target)  # Note [A storage the program still holds is not read back]
                    continue
                self._start_read(target)
            self._host.flush()
