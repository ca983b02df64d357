"""The control thread's deferred jobs (tba/_control.py, Note [Deferred jobs])."""

from __future__ import annotations

import threading

from tba import _control


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


def test_a_job_deferred_while_the_control_thread_drains_is_not_stranded():
    """The flag is cleared before draining: a save deferred during a drain either runs in it or wakes again."""
    done = threading.Event()
    seen: list[int] = []

    def defer_more(index: int) -> None:
        seen.append(index)
        if index < 50:
            threading.Thread(target=lambda: (_control.defer(defer_more, index + 1), _control.wake())).start()
        else:
            done.set()

    _control.defer(defer_more, 0)
    _control.wake()
    assert done.wait(10), f"stranded after {len(seen)} jobs"
    assert seen == list(range(51))
