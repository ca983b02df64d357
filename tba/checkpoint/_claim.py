"""Which thread a :class:`~tba.checkpoint.TbaStorageWriter`'s save runs in, so that a second one is refused.

Note: [One writer runs one save at a time]
DCP keeps the writer's state (path, staging directory, host image) from one step of a save to the
next; ``dcp.async_save`` runs each save in a thread of its own. Two async saves given one writer,
the first still running, shared it: the second's ``reset`` retargeted the first, whose future
succeeded with nothing published under its path and its partial directory left, silently (helper-99).
A writer is claimed by the thread that runs its save, from ``set_up_storage_writer`` until
``finish`` or a failed ``write_data``; another thread's ``reset`` or save meanwhile raises
:class:`TbaConfigError`, and a save whose path another live thread set after its own ``reset``
fails rather than save there. A claim whose thread has ended, or the same thread's next save (DCP
gives a writer no word when a save fails elsewhere), is not in the way.
"""

from __future__ import annotations

import threading

from tba.checkpoint._io import TbaConfigError

_FIX = ("one writer runs one save at a time; wait for the previous dcp.async_save's future (.result()) first, or give "
        "each save its own writer")


def _other_live(thread: threading.Thread | None) -> bool:
    return thread is not None and thread is not threading.current_thread() and thread.is_alive()


class SaveClaim:
    """The thread running a writer's save, and the thread that last set its path."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.path_by: threading.Thread | None = None
        self.running: threading.Thread | None = None

    def refuse_overlap(self, path: str | None, what: str) -> None:
        """Raise if a save of another live thread runs; call with :attr:`lock` held."""
        if _other_live(self.running):
            raise TbaConfigError(f"this TbaStorageWriter is still saving {path} in thread {self.running.name}, and "
                                 f"cannot {what} meanwhile: {_FIX}")

    def begin(self, path: str | None) -> None:
        """Claim the writer for the save starting in this thread."""
        with self.lock:
            self.refuse_overlap(path, "start another save")
            if _other_live(self.path_by):
                raise TbaConfigError(f"thread {self.path_by.name} retargeted this TbaStorageWriter to {path} after "
                                     f"this save's own reset: {_FIX}")
            self.running = threading.current_thread()

    def end(self) -> None:
        self.running = None

    def end_if_mine(self) -> None:
        """End the calling thread's claim, if it still holds it: its save has ended, however it failed.

        Note: [A failed lazy save lets go of its writer]
        ``write_data`` and ``finish`` end the claim, but a save that failed before them (its staging directory could not
        be made: a full or failing disk, a planner's error) left it held by its thread. A lazy save's thread went on to
        mark the save done and run its ``on_done`` callback, and the checkpointer's next save, which waits only for that
        mark, found the writer claimed by a live thread and failed, "still saving ... in thread tba-ckpt" (helper-160): a
        user's retry after ``wait()`` raised, or a save made by the callback itself. A ``dcp.save`` of the main thread
        that failed so left the writer claimed by that thread for good: every later ``dcp.async_save`` with it was
        refused. A failure to make the staging directory now ends the claim with the staging lock, and the lazy save's
        thread ends its claim as soon as ``dcp.save`` returns or raises, before the save is marked done (a failure in
        DCP's own steps, which the writer never hears of, still leaves a plain DCP save's claim until its thread ends).
        """
        with self.lock:
            if self.running is threading.current_thread():
                self.running = None
