"""The control thread's deferred jobs (tba/_control.py, Note [Deferred jobs])."""

from __future__ import annotations

import threading

import pytest

from tba import _control, _control_loop


def test_a_control_thread_that_falls_behind_gets_one_wake_up_and_runs_every_deferred_job():
    started, release = threading.Event(), threading.Event()
    busy = threading.Thread(target=_control.call, args=(lambda: (started.set(), release.wait(10)),))
    busy.start()
    assert started.wait(5)
    ran: list[int] = []
    try:
        for index in range(100):
            _control.defer(ran.append, index)
            _control.wake()
        queued = _control._control.jobs.qsize()
    finally:
        release.set()
        busy.join()
    _control.settle()
    assert queued <= 1, f"{queued} wake-ups queued behind the busy control thread"
    assert ran == list(range(100))


def test_a_job_deferred_after_the_drain_loop_still_wakes_the_control_thread():
    """The flag is cleared before draining, not after: a job deferred once the drain's loop is over
    (here by another thread, from a batch-end callback) queues a wake-up of its own."""
    ran = threading.Event()

    def defer_from_another_thread() -> None:
        helper = threading.Thread(target=lambda: (_control.defer(ran.set), _control.wake()))
        helper.start()
        helper.join()

    poll_s = _control_loop.FINALIZER_POLL_S
    _control_loop.FINALIZER_POLL_S = 3600.0  # only a wake-up can run the job, not the control thread's poll
    try:
        _control.defer(_control.after_batch, defer_from_another_thread)
        _control.wake()
        assert ran.wait(5), "the job deferred after the drain was stranded until the next poll"
    finally:
        _control_loop.FINALIZER_POLL_S = poll_s
        _control.settle()  # the control thread waits with the usual poll again


def test_a_deferred_job_that_raises_is_logged_and_the_items_after_it_still_run_in_order(caplog):
    """Note [One try per batch of deferred jobs] in tba/_control_loop.py: a job that raises ends one pass of the drain
    loop, not the drain; jobs and finalizers after it run, in order, and the last one's arguments are not kept."""
    import gc
    import logging
    import weakref

    class Arg:
        pass

    class Told(_control.Finalizer):
        __slots__ = ("ran",)

        def fire(self) -> None:
            self.ran.append("finalizer")

    def fail() -> None:
        raise RuntimeError("a deferred job failed on purpose")

    started, release = threading.Event(), threading.Event()
    busy = threading.Thread(target=_control.call, args=(lambda: (started.set(), release.wait(10)),))
    busy.start()
    assert started.wait(5)
    ran: list[object] = []
    arg = Arg()
    gone = weakref.ref(arg)
    try:
        with caplog.at_level(logging.ERROR, logger="tba"):
            _control.defer(ran.append, 1)
            _control.defer(fail)
            subject = Arg()
            told = _control.finalizer(Told, subject)
            told.ran = ran
            del told, subject  # fires: the finalizer is queued after the failing job
            gc.collect()
            _control.defer(fail)
            _control.defer(ran.append, 2)
            _control.defer(len, (arg,))
            del arg
            release.set()
            busy.join()
            _control.settle()
    finally:
        release.set()
        busy.join()
    assert ran == [1, "finalizer", 2]
    assert sum("deferred job on the control thread failed" in record.getMessage() for record in caplog.records) == 2
    assert gone() is None, "the control thread kept the last deferred job's arguments"


@pytest.mark.parametrize("route", ["call", "call_whole"])
def test_an_error_a_job_raises_holds_no_frame_of_its_caller_once_handled(route):
    """Note [A raised error is no local of the frame it leaves]: once the caller has handled the error, nothing keeps
    it or the caller's frame (here an object of that frame) alive, even with the cycle collector off."""
    import gc
    import weakref

    class Held:
        pass

    class Failed(RuntimeError):  # weakly referable, as a builtin exception is not
        pass

    def fail() -> None:
        raise Failed("a job failed on purpose")

    def caller() -> tuple[weakref.ref, weakref.ref]:
        held = Held()
        try:
            getattr(_control, route)(fail)
        except Failed as err:
            error = weakref.ref(err)
        return error, weakref.ref(held)

    enabled = gc.isenabled()
    gc.disable()
    try:
        error, held = caller()
        _control.call(len, ())  # the control thread is past the failed job, whose frame held its result until it returned
        assert error() is None, f"{route} left the error in a reference cycle"
        assert held() is None, f"{route}'s error kept its caller's frame"
    finally:
        if enabled:
            gc.enable()
