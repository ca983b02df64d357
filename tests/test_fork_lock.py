"""Note [A lock held at a fork] in tba/_fork_lock.py: a ForkSafeLock is free in every forked child."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
import weakref

from tba._fork_lock import ForkSafeLock

HELD_BY_A_THREAD_AT_FORK = textwrap.dedent("""
    import os, sys, threading
    from tba._fork_lock import ForkSafeLock
    lock, plain = ForkSafeLock(), threading.Lock()
    holding, done = threading.Event(), threading.Event()

    def hold():
        with lock, plain:
            holding.set()
            done.wait()

    threading.Thread(target=hold, daemon=True).start()
    holding.wait()
    pid = os.fork()
    if pid == 0:
        free = lock.acquire(timeout=10)
        lock.release()
        still_held = not plain.acquire(timeout=0.1)  # the plain lock stays held: what the note is about
        os._exit(0 if free and still_held else 3)
    _, status = os.waitpid(pid, 0)
    done.set()
    assert lock.acquire(timeout=10), "the parent's lock must still work once its holder let go"
    sys.exit(os.waitstatus_to_exitcode(status))
""")


def test_a_lock_another_thread_held_at_fork_is_free_in_the_child():
    result = subprocess.run([sys.executable, "-c", HELD_BY_A_THREAD_AT_FORK], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]


def test_it_is_a_lock():
    lock = ForkSafeLock()
    with lock:
        assert lock.locked() and not lock.acquire(blocking=False)
        assert repr(lock) == "<ForkSafeLock locked>"
    assert not lock.locked() and lock.acquire(timeout=1)
    lock.release()


def test_the_fork_hook_does_not_keep_a_lock_alive():
    ref = weakref.ref(ForkSafeLock())
    gc.collect()
    assert ref() is None
