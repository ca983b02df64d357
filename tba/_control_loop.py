"""The control thread itself: its queue of jobs, its deque of deferred jobs and its loop.

:class:`Control` is one control thread's state. ``tba/_control.py`` holds the process's one
instance (a new one in a forked child) and the functions every other module calls (``call``,
``defer``, ``on_death``, ...), with the Notes that explain why tba's bookkeeping runs here
(Note [Asynchronous exceptions], Note [Deferred jobs]). The loop takes a job, or wakes every
:data:`FINALIZER_POLL_S` while finalizers or deferred jobs wait; before any job it runs every
deferred job in order, then the callbacks registered with ``after_batch``. A job's exception goes to
the caller waiting for it, or to the log: the thread outlives any one job.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any

from tba import _sched

logger = logging.getLogger("tba")


FINALIZER_POLL_S = 0.01
"""While finalizers are registered, the control thread looks for fired ones at least this often (seconds)."""


class Finalizer(weakref.ref):
    """A weak reference that, once its referent dies, asks the control thread to run :meth:`fire`.

    Subclasses keep what :meth:`fire` needs in slots of their own, so that a finalizer is one object
    for the cycle collector, not two (an arguments tuple that holds objects stays tracked).
    """

    __slots__ = ()

    def fire(self) -> None:
        raise NotImplementedError


class CallFinalizer(Finalizer):
    """Runs ``fn(*args)`` (:func:`tba._control.on_death`)."""

    __slots__ = ("fn", "args")

    def fire(self) -> None:
        self.fn(*self.args)


class Control:
    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.deferred: collections.deque = collections.deque()
        """``(fn, args)`` to run before the next job (Note [Deferred jobs])."""
        self.defer_append = self.deferred.append
        """The finalizers' callback, made once: ``deferred.append`` builds a new bound method at each use."""
        self.wake_pending = False
        """A wake-up is queued and the control thread has not started draining for it (:func:`wake`)."""
        self.batch_end: list[Callable[[], None]] = []
        """Callbacks to run once the deferred jobs have run (:func:`after_batch`)."""
        self.finalizers: dict[int, Finalizer] = {}
        """Finalizers not fired yet, by identity (a weak reference alone would be collected first)."""
        self.thread: threading.Thread | None = None
        self.thread_ident: int | None = None
        """``thread.ident`` as a plain attribute (``native/tba_shield.c`` reads it without running Python)."""
        self.start_lock = threading.Lock()
        self.stopped = False
        """Set at interpreter exit: from then on jobs run inline in the caller."""

    def ensure_started(self) -> None:
        if self.thread is None:
            with self.start_lock:
                if self.thread is None:
                    thread = threading.Thread(target=self.run, name="tba-control", daemon=True)
                    thread.start()
                    self.thread_ident = thread.ident
                    self.thread = thread

    def run(self) -> None:
        _sched.background()
        while True:
            try:
                item = self.jobs.get(timeout=FINALIZER_POLL_S if self.finalizers or self.deferred else None)
            except queue.Empty:
                item = WAKE
            if item is STOP:
                return
            self.process(item)
            item = None  # Note [A worker keeps nothing of its last job] in tba/device/_staged_route.py

    def run_deferred(self) -> None:
        """Run every deferred job, then the batch-end callbacks (errors are logged)."""
        deferred = self.deferred
        while deferred:
            try:
                self._drain(deferred)
            except BaseException:  # noqa: BLE001 - the control thread must outlive any one job
                logger.exception("tba: a deferred job on the control thread failed")
        self.run_batch_end()

    def _drain(self, deferred: collections.deque) -> None:
        """Run deferred jobs in order until none is left, or until one raises (:meth:`run_deferred` logs it and calls
        again for the rest).

        Note: [One try per batch of deferred jobs]
        Backward defers three items per storage read back (its unpack's bookkeeping, its view's death, its read
        buffer's death), and each used to enter a ``try`` and ask ``isinstance`` of its own. The ``try`` is around the
        loop instead, entered again only after a job raised, and an item is told apart by its exact type: a job is
        the ``(fn, args)`` tuple :func:`tba._control.defer` appends, anything else a :class:`Finalizer`. The last item
        is a local of this frame, gone when it returns (Note [A worker keeps nothing of its last job] in
        ``tba/device/_staged_route.py``: a save's job holds its tensor while the batch's writes go out).

        Note: [An unregistered finalizer never fires]
        A finalizer fires only if it is still in the table: :func:`tba._control.unregister` takes it out, and its
        weak reference may still outlive its object. A save job that failed after making a view's finalizer
        unregisters it and drops the view itself (Note [A save job that fails after the store saved] in
        ``tba/runtime/_hooks.py``); its frame, kept by the warning's record (pytest's caplog, a ``MemoryHandler``),
        freed the view first and the finalizer second, so the finalizer fired and dropped the view again
        (``live_entries`` -1, an extent freed twice).
        """
        popleft, unregister = deferred.popleft, self.finalizers.pop
        while deferred:
            item = popleft()
            if item.__class__ is tuple:
                item[0](*item[1])
            elif unregister(id(item), None) is item:  # Note [An unregistered finalizer never fires]
                item.fire()

    def run_batch_end(self) -> None:
        while self.batch_end:
            callback = self.batch_end.pop(0)
            try:
                callback()
            except BaseException:  # noqa: BLE001 - the control thread must outlive any one job
                logger.exception("tba: a batch callback on the control thread failed")

    def process(self, item: Any) -> None:
        # Cleared before draining: a job deferred from now on is either drained below or wakes again.
        self.wake_pending = False
        self.run_deferred()
        if item is WAKE:
            return
        try:
            reply, fn, args = item  # finalizers fire into the deferred jobs, never into this queue
            try:
                result = fn(*args)
                self.run_batch_end()
            except BaseException as err:  # noqa: BLE001 - handed to the waiting caller
                self.run_batch_end()
                if reply is None:
                    raise
                reply.put((err, None))
            else:
                if reply is not None:
                    reply.put((None, result))
                result = None  # Note [A raised error is no local of the frame it leaves] in tba/_control.py
        except BaseException:  # noqa: BLE001 - the control thread must outlive any one job
            logger.exception("tba: a job on the control thread failed")


STOP = object()
"""Ends :meth:`Control.run`."""
WAKE = object()
"""Only drains the deferred jobs (:func:`tba._control.wake`)."""

def run_queued(control: Control) -> None:
    """Run what is queued in ``control`` now, in the calling thread."""
    while True:
        try:
            item = control.jobs.get_nowait()
        except queue.Empty:
            control.run_deferred()
            return
        if item is not STOP:
            control.process(item)
