"""What an unpack leaves done: the bookkeeping after backward used a storage, a base of
:class:`~tba.runtime._reads.StoreReads` (the read half of :class:`tba.runtime._store.StorageStore`).

* :meth:`StoreUnpacked.note_unpacked` releases a storage's bytes once every live view of it was unpacked in this
  backward pass (views counted by identity);
* :meth:`StoreUnpacked.new_pass` clears what earlier passes unpacked when a backward pass begins or forward ends.

Every state change happens under the store's lock, on the control thread.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from tba.runtime._entry import State, StorageEntry

if TYPE_CHECKING:
    from tba.runtime._prefetch import PrefetchWindow


class StoreUnpacked:
    """The unpack bookkeeping of :class:`~tba.runtime._reads.StoreReads`, which sets every attribute used here and
    provides the release methods it calls (``release``, ``_release_written``)."""

    lock: threading.RLock
    window: PrefetchWindow
    _prefetch_to: StorageEntry | None
    _unpacked: list[StorageEntry]

    def note_unpacked(self, entry: StorageEntry, view_id: int) -> None:
        """After every live view of a storage was unpacked, its bytes are not needed in memory.

        Views are counted by identity, not unpack calls: autograd may unpack one view twice before
        another view of the same storage is used, and that must not drop the bytes early.
        """
        with self.lock:
            self._unpacked_view(entry, view_id)

    def _unpacked_view(self, entry: StorageEntry, view_id: int) -> None:
        """:meth:`note_unpacked` under the lock, which :meth:`served_from_memory` holds already: one
        acquisition per unpack on the control thread, not two (docs/host-cost.md)."""
        if entry.live_views > 1:
            views = entry.unpacked_views
            if views is None:
                views = entry.unpacked_views = set()
                self._unpacked.append(entry)
            views.add(view_id)
            if len(views) < entry.live_views:
                return
            views.clear()
        elif entry.unpacked_views:
            entry.unpacked_views.clear()
        if not entry.fully_unpacked:
            entry.fully_unpacked = True
            self._unpacked.append(entry)
        self.window.discount(entry)
        entry.hold_for_backward = False
        if entry.state is State.ON_DISK:
            # A storage held since forward (Note [Release after unpack]) is still the program's own memory; bytes
            # read back (no own_memory) are only dropped, which is all _release_written would do with them.
            if entry.own_memory:
                self._release_written(entry)
            else:
                self.release(entry)

    def new_pass(self) -> None:
        """A backward pass begins, or forward ended: what earlier passes unpacked is needed again.

        Note: [Each backward pass reads ahead]
        ``fully_unpacked`` (backward needs the storage no more) and the window's cursor, which only moves down, held
        for good once set: a retained graph's second backward (two losses through one trunk) found every storage used
        up and the cursor at the bottom, read nothing ahead and waited for each read (15 waits in 16 blocks, none in
        the first pass); so did a backward after ``torch.autograd.grad`` inside the ``with`` block (helper-108). They
        belong to one pass: the unpack hook sees a new autograd graph task and this clears them (the entries set since
        the last pass, ``_unpacked``), as the end of forward does.
        """
        with self.lock:
            unpacked, self._unpacked = self._unpacked, []
            for entry in unpacked:
                entry.fully_unpacked = False
                entry.unpacked_views = None
            self._prefetch_to = None  # the last pass's move, not run yet (Note [One window move per batch of unpacks])
            self.window.new_pass()
