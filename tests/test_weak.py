"""WeakRegistry shared by threads while the cycle collector runs finalizers (Note [A registry that
threads and the collector can share] in tba/_weak.py): no KeyError, no "dictionary changed size during
iteration", dead objects pruned, and a fork's child can add although another thread held the lock."""

from __future__ import annotations

import os

import pytest
from utils import threads_under_the_collector

from tba._weak import WeakRegistry


class _Member:
    pass


def test_threads_adding_while_the_collector_runs_finalizers():
    registry = WeakRegistry()

    def new_body():
        held = []

        def body() -> None:
            member = _Member()
            registry.add(member)
            held.append(member)
            if len(held) > 50:
                held.clear()
            registry.alive()
        return body

    assert threads_under_the_collector(new_body) == []


def test_dead_members_are_pruned_and_live_ones_kept():
    registry = WeakRegistry()
    kept = _Member()
    registry.add(kept)
    registry.add(_Member())  # dies at once
    registry.add(_Member())
    assert registry.alive() == [kept]
    assert repr(registry) == "WeakRegistry(remembered=2)"  # the last add's dead member goes at the next add


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_adds_although_the_lock_was_held():
    registry = WeakRegistry()
    member = _Member()
    registry._lock.acquire()  # as if another thread were adding when the process forked
    try:
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                registry.add(member)
                code = 0 if registry.alive() == [member] else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
    finally:
        registry._lock.release()
    assert os.waitstatus_to_exitcode(status) == 0
