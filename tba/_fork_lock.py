"""Locks that every forked child gets free.

Note: [A lock held at a fork]
``os.fork()`` copies a lock's state but only the forking thread: a child forked while another
thread of the parent held a module's lock (warning at that moment, say) finds it held by a thread it
does not have, and its first use of the lock waits for ever (found by a review for three of tba's
warn-once locks). :class:`ForkSafeLock` is a ``threading.Lock`` that one ``os.register_at_fork``
hook replaces with a new, free one in every child, so a module needs no hook of its own for it.
Only for locks guarding state the child may read as the parent left it (a set of warnings given,
a flag); state a half-finished update could leave broken needs a hook of its own.
"""

from __future__ import annotations

import os
import threading

from tba._weak import WeakRegistry


class ForkSafeLock:
    """A ``threading.Lock`` (``with``, ``acquire``, ``release``) that is free in every forked child
    (Note [A lock held at a fork])."""

    __slots__ = ("_lock", "__weakref__")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        _locks.add(self)

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        return self._lock.acquire(blocking, timeout)

    def release(self) -> None:
        self._lock.release()

    def locked(self) -> bool:
        return self._lock.locked()

    def __enter__(self) -> bool:
        return self._lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()

    def __repr__(self) -> str:
        return f"<ForkSafeLock {'locked' if self._lock.locked() else 'unlocked'}>"


_locks = WeakRegistry()
"""Every :class:`ForkSafeLock` made, weakly."""


def _after_fork_in_child() -> None:
    for lock in _locks.alive():
        lock._lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)
