"""A result set once by one thread and awaited by others, with no lock an asynchronous exception can keep.

Note: [Waiting without a Python lock]
``concurrent.futures.Future`` guards its state with a ``threading.Condition``, whose ``__enter__``
and ``__exit__`` are Python methods: every ``done()``, ``result()`` and ``add_done_callback()``
runs ``with self._condition:``. A signal handler's exception that strikes as that ``__exit__``
starts (Note [An exit that always runs] in ``tba/_whole_exit.py``) leaves the condition's lock held
for good. The training thread waits for reads in backward; when that happened there, the
completion thread then blocked in ``set_result`` while holding the store's lock, the control
thread blocked on the store's lock, and the next step blocked on the control thread: the
randomised signal test hung about once in a hundred runs.

An :class:`Outcome` takes no lock. The completing thread stores the result, sets ``done`` and
then puts a token on the queue of every waiter registered so far. A waiter registers its
:class:`queue.SimpleQueue` (a list append) and checks ``done`` again before it blocks in
``get`` (one C call that returns or raises). Under the GIL either the waiter's second check
sees ``done``, or its queue was registered before the completing thread went through the list
(which it goes through live, so a queue added meanwhile is included).
"""

from __future__ import annotations

import queue
from typing import Any


class Outcome:
    """A value or an error, set once (:meth:`set_result`, :meth:`set_exception`) and read by :meth:`wait`."""

    __slots__ = ("_done", "_value", "_error", "_waiters")

    def __init__(self) -> None:
        self._done = False
        self._value: Any = None
        self._error: BaseException | None = None
        self._waiters: list[queue.SimpleQueue] = []

    def __repr__(self) -> str:
        state = "pending" if not self._done else "failed" if self._error is not None else "done"
        return f"Outcome({state})"

    def done(self) -> bool:
        """Whether the value or the error is set."""
        return self._done

    def failed_with(self, error: BaseException) -> bool:
        """Whether ``error`` is the error this outcome was set to (not one raised in the waiting thread while it
        was blocked: a signal handler's)."""
        return self._done and self._error is error

    def set_result(self, value: Any) -> None:
        self._value = value
        self._finish()

    def set_exception(self, error: BaseException) -> None:
        self._error = error
        self._finish()

    def _finish(self) -> None:
        self._done = True
        for arrived in self._waiters:
            arrived.put(None)

    def wait(self) -> Any:
        """Block until set; return the value, or raise the error. An asynchronous exception while
        blocked reaches the caller and leaves nothing held."""
        if not self._done:
            arrived: queue.SimpleQueue = queue.SimpleQueue()
            self._waiters.append(arrived)
            if not self._done:
                arrived.get()
        error = self._error
        if error is None:
            return self._value
        # Note: [A failed outcome is no local of the frames it is raised through]
        # The outcome keeps its error, and raising the error adds to its traceback every frame it passes, which
        # keep their callers (f_back) up to backward's and the training loop's: a frame there that still held the
        # outcome made a cycle, and a read that failed (an I/O error, or running out of memory for its buffer)
        # kept the step's graph, its offloader and spill file after the loop caught the error and dropped the
        # loss, until the cycle collector ran (tests/runtime/test_faults.py). So this frame, tba._control.wait's,
        # StoreReadWait.wait_read's and the unpack's let go of the outcome before the error leaves them (no entry
        # holds a finished read's outcome). Note [A raised error is no local of the frame it leaves] in
        # tba/_control.py is the same for a job of the control thread.
        del self
        try:
            raise error
        finally:
            del error
