"""Bookkeeping out of reach of asynchronous exceptions: one control thread and C-level finalizers.

Note: [Asynchronous exceptions]
Python runs signal handlers in the main thread, between two bytecodes of whatever runs there. An
exception raised by a handler (``KeyboardInterrupt`` from SIGINT, or a user's own from a timer
signal) can therefore strike between any two statements of tba's bookkeeping: after a request went
to the kernel but before its completion callback was attached (the entry then waits forever and
its spill file stays open), after a read buffer was handed to the kernel but before anything else
referenced it (the buffer is freed while the kernel writes into it: heap corruption), half way
through starting a thread, or inside a ``__del__``, where Python prints ``Exception ignored`` and
drops it (a swallowed Ctrl-C). Three rules keep every state change whole:

* Every state change of an offloader (save, load, prefetch, drop, open, close) runs as a job on
  one control thread (:func:`call`, :func:`post`, :func:`defer`). Handlers never run there. The main thread only waits for the
  job's result: an exception during that wait reaches the caller at once, the job still runs to
  its end, and what it returns is dropped like any other garbage (and cleaned up by the next rule).
* Finalizers run no Python code. A saved view or a read buffer that dies fires a weak reference
  whose callback is :meth:`queue.SimpleQueue.put`, a C function, so nothing can be raised (or
  swallowed) inside it; the control thread does the work (:func:`on_death`).
* Engines keep each request, and through its ``owner`` the memory it moves, until the transfer is
  over (``tba/io/_engine.py``), whatever happens to the caller.

Work that only waits (``flush``, waiting for a read) stays in the caller's thread: an exception
while waiting leaves nothing half done, since the wait holds no Python-level lock (Note [Waiting
without a Python lock] in ``tba/_outcome.py``). The offloader's ``__exit__``, which a handler could
otherwise skip before its first line, is C (Note [An exit that always runs] in
``tba/_whole_exit.py``).

Note: [Deferred jobs]
A hop to the control thread and back costs a thread wake-up and two hand-overs of the GIL: tens
of microseconds on an idle machine, milliseconds on a busy one, per saved tensor. Work whose result
the caller does not need now (a save, the bookkeeping after an unpack served from memory) is
*deferred* instead (:func:`defer`): appended to a deque, one C call that either happens or not, and
run by the control thread before any other job, in order, once a caller wakes it
(:func:`wake`) or the next job arrives. So a job never overtakes deferred work queued before it,
and the control thread runs many deferred jobs per wake-up. A wake-up already queued is not
queued again (``wake_pending``, cleared by the control thread before it drains the deque): when the
control thread falls behind, every further save used to queue one more wake-up, each a queue put,
a futex wake and a pass of the control loop. Callbacks registered with
:func:`after_batch` run once the deferred jobs queued so far have run (a batch of writes is
submitted to the engine at once).
"""

from __future__ import annotations

import atexit
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from tba._control_loop import STOP, WAKE, CallFinalizer, Control, Finalizer, run_queued
from tba._outcome import Outcome
from tba.defaults import DEFER_WAKE_BYTES, DEFER_WAKE_JOBS

_control = Control()
F = TypeVar("F", bound=Finalizer)


def in_control_thread() -> bool:
    """Whether the caller is the control thread itself."""
    return threading.current_thread() is _control.thread


def call(fn: Callable[..., Any], *args: Any) -> Any:
    """Run ``fn(*args)`` on the control thread and return its result (or raise its exception).

    From the control thread itself, ``fn`` runs inline.
    """
    if threading.current_thread() is _control.thread or _control.stopped:
        return fn(*args)
    _control.ensure_started()
    reply: queue.SimpleQueue = queue.SimpleQueue()
    _control.jobs.put((reply, fn, args))
    error, result = reply.get()
    if error is not None:
        try:
            raise error
        finally:
            # Note: [A raised error is no local of the frame it leaves]
            # Raising adds this frame to the error's traceback, and the frame's local holds the error: a cycle
            # that kept every frame of the traceback, the caller's included (its model outputs, a step's graph
            # and the offloader holding its spill file, fd and I/O thread) until the cycle collector ran. An
            # adaptive context refused at planning (memory_budget) left them so (tests/test_control.py). call_whole
            # drops its own, and the control thread's job frame the result that carried one (call_whole's
            # _capture): the error's frames keep that frame alive as their caller (f_back).
            del error
    return result


def wait(outcome: Outcome) -> Any:
    """``outcome.wait()``, adding the time blocked to :func:`waited_s` (Note [Waiting without a Python
    lock] in ``tba/_outcome.py`` says why tba's waits are not on a ``Future``)."""
    started = None if outcome.done() else time.perf_counter()
    try:
        return outcome.wait()
    finally:
        del outcome  # Note [A failed outcome is no local of the frames it is raised through] in tba/_outcome.py
        if started is not None:
            _waits.seconds = getattr(_waits, "seconds", 0.0) + time.perf_counter() - started


_waits = threading.local()


def waited_s() -> float:
    """Seconds the calling thread has spent blocked in :func:`wait` so far (for a read, for writes to
    drain): what a layer's time must leave out to be the layer's own (``tba/runtime/_timer.py``)."""
    return getattr(_waits, "seconds", 0.0)


def post(fn: Callable[..., Any], *args: Any) -> None:
    """Queue ``fn(*args)`` for the control thread without waiting (errors are logged)."""
    if threading.current_thread() is _control.thread or _control.stopped:
        fn(*args)
        return
    _control.ensure_started()
    _control.jobs.put((None, fn, args))


def defer(fn: Callable[..., Any], *args: Any) -> int:
    """Queue ``fn(*args)`` for the control thread without waking it (Note [Deferred jobs]).

    It runs before the next job, or after :func:`wake`. Returns how many jobs are deferred now
    (0 when ``fn`` ran at once: on the control thread itself, or once the thread has stopped).
    """
    control = _control
    if threading.get_ident() == control.thread_ident or control.stopped:
        fn(*args)
        return 0
    control.deferred.append((fn, args))
    return len(control.deferred)


def wake() -> None:
    """Have the control thread run the deferred jobs now, without waiting for them."""
    control = _control
    if (control.deferred and not control.wake_pending and threading.current_thread() is not control.thread
            and not control.stopped):
        control.wake_pending = True
        control.ensure_started()
        control.jobs.put(WAKE)


class Waker:
    """Wakes the control thread once enough deferred work has piled up (Note [Deferred jobs]).

    Few wake-ups keep the GIL with the training thread; waking after ``jobs`` deferred jobs or
    ``nbytes`` of storages bounds the bytes whose write (or whose window move) waits meanwhile.
    """

    __slots__ = ("jobs", "nbytes", "_bytes")

    def __init__(self, jobs: int = DEFER_WAKE_JOBS, nbytes: int = DEFER_WAKE_BYTES) -> None:
        self.jobs = jobs
        self.nbytes = nbytes
        self._bytes = 0

    def note(self, deferred: int, nbytes: int) -> None:
        """``deferred`` jobs wait now, the last one about ``nbytes`` of storage."""
        self._bytes += nbytes
        if deferred >= self.jobs or self._bytes >= self.nbytes:
            self._bytes = 0
            wake()


def after_batch(callback: Callable[[], None]) -> None:
    """On the control thread: run ``callback()`` once the deferred jobs queued so far have run.

    Outside a batch (a job run inline) it runs at once.
    """
    control = _control
    if threading.current_thread() is control.thread and callback not in control.batch_end:
        control.batch_end.append(callback)
        return
    callback()


def _capture(fn: Callable[..., Any], args: tuple) -> tuple[BaseException | None, Any]:
    try:
        return None, fn(*args)
    except BaseException as err:  # noqa: BLE001 - returned to call_whole
        return err, None


def call_whole(fn: Callable[..., Any], *args: Any) -> Any:
    """Like :func:`call`, but an asynchronous exception does not cut the caller's wait short.

    When one arrives, the call is made again (``fn`` must be idempotent) until it returned, and the
    first such exception is raised after that. ``fn``'s own exception is raised as :func:`call` does.
    """
    interrupted = None
    while True:
        try:
            error, result = call(_capture, fn, args)
            break
        except BaseException as err:  # noqa: BLE001 - re-raised below, once the job has run
            if interrupted is None:
                interrupted = err
    try:  # Note [A raised error is no local of the frame it leaves]
        if interrupted is not None:
            raise interrupted
        if error is not None:
            raise error
        return result
    finally:
        del interrupted, error


def on_death(obj: object, fn: Callable[..., Any], *args: Any) -> CallFinalizer:
    """Run ``fn(*args)`` on the control thread once ``obj`` has been collected.

    ``args`` must not refer to ``obj``. Returns the finalizer (Note [Objects the cycle collector need not see]
    in tba/_untrack.py says when it may be untracked). The callback that fires at collection is
    ``deque.append`` itself: no Python code runs in the thread that drops ``obj``. The finalizer
    runs with the deferred jobs (Note [Deferred jobs]): at the next job or wake-up, and within
    :data:`~tba._control_loop.FINALIZER_POLL_S` otherwise, so that a backward freeing thousands of views does not wake
    the control thread thousands of times.
    """
    ref = finalizer(CallFinalizer, obj)
    ref.fn, ref.args = fn, args
    return ref


def finalizer(kind: type[F], obj: object) -> F:
    """A new ``kind`` of :class:`Finalizer` of ``obj``, registered; the caller fills its slots at once.

    Its :meth:`~Finalizer.fire` runs on the control thread once ``obj`` has been collected, as
    :func:`on_death`'s ``fn(*args)`` does, and must not refer to ``obj``.
    """
    if _control.thread is None:  # ensure_started's own test, asked here: made once per saved storage, on the control thread
        _control.ensure_started()
    ref = kind(obj, _control.defer_append)
    _control.finalizers[id(ref)] = ref
    return ref


def unregister(ref: Finalizer) -> None:
    """``ref``, made by :func:`finalizer` and whose object is alive, never fires: out of the table, it is not
    fired even if it outlives its object (Note [An unregistered finalizer never fires] in ``tba/_control_loop.py``)."""
    _control.finalizers.pop(id(ref), None)


def run_pending() -> None:
    """On the control thread: run what is queued now (finalizers fired by a ``gc.collect()``)."""
    run_queued(_control)


def settle() -> None:
    """Wait until every job and finalizer queued before this call has run."""
    if _control.thread is not None and not in_control_thread():
        call(int)


_at_stop: list[Callable[[], None]] = []


def at_stop(fn: Callable[[], None]) -> None:
    """Have ``fn()`` run at interpreter exit, once the control thread has stopped and what was queued
    for it has run: the last of tba's work that may start transfers (Note [No transfer ends during
    finalization] in ``tba/io/_io_uring.py``)."""
    _at_stop.append(fn)


def _stop_at_exit() -> None:
    """Finish queued work and end the control thread before the interpreter finalizes.

    A daemon thread that wakes during finalization is ended by ``pthread_exit`` wherever it is; in
    the middle of torch's C++ code that aborts the process ("terminate called without an active
    exception"). So the thread is stopped while the interpreter is still whole, and then the
    :func:`at_stop` callbacks wait for the transfers that would wake other threads.
    """
    control = _control
    if control.thread is not None and not in_control_thread():
        control.jobs.put(STOP)
        control.thread.join()
        control.stopped = True
        run_queued(control)
    for fn in _at_stop:
        fn()


atexit.register(_stop_at_exit)


def _after_fork_in_child() -> None:
    global _control
    _control = Control()
    _control.ensure_started()


# The thread starts at import, before a program installs its signal handlers: `Thread.start`
# interrupted half way by a handler's exception can leave a thread started but not recorded.
_control.ensure_started()


os.register_at_fork(after_in_child=_after_fork_in_child)
