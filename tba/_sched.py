"""Scheduling of tba's own threads: opt in to have them yield to compute instead of preempting it (Linux).

Every thread tba starts (the control thread, the I/O engines' reapers and workers, the stagers,
the heap trimmer, the checkpoint writer) calls :func:`background` first. Under the policy
``batch`` (``TBA_THREAD_POLICY=batch``; the default is ``normal``, which changes nothing) the
thread runs under ``SCHED_BATCH``: the same share of CPU as any other thread (same nice value),
but a wake-up does not preempt a thread that is running. The policy is read from
``$TBA_THREAD_POLICY`` (``batch`` or ``normal``) when each thread starts; the control thread
starts when tba is imported, so set it before that. Threads and processes inherit the policy of
the thread that starts them, so user code that tba calls on its own threads (a checkpoint's
``on_done``) runs under the ordinary policy again (:func:`ordinary`); io_uring's kernel workers,
started by the control thread's submissions, run under ``SCHED_BATCH`` too.

Note: [tba's threads do not preempt compute]
On a CPU training machine whose cores torch's threads fill, every completion or deferred save that
woke a tba thread preempted a compute thread at once. An OpenMP parallel region then waits at its
barrier for the preempted thread, so the whole region is late by the tba thread's run: on the
2-core VM, offload-all on the ``bench`` GPT added 0.45 s of CPU per step to torch's two threads
while tba's own threads used 0.16 s. Under ``SCHED_BATCH`` a woken tba thread waits for the
running thread's time slice, or runs at once where a core is idle, as on a GPU machine's host.
Alternating processes (reusable offload-all on ``bench``, jemalloc, median of steps 2-5, against
keep-all in the same round): six rounds gave 1.00-1.12x (mean 1.08x) under ``batch`` against
1.07-1.21x (mean 1.13x) under ``normal``, ``batch`` ahead in five; an earlier probe that moved the
threads after the first step, 1.03-1.13x (mean 1.07x) against 1.08-1.15x (mean 1.12x), ahead in all
five. With the bare adaptive context (``tools/bench_e2e.py --usage bare``, six pairs) the two were
within noise: 1.06-1.16x (mean 1.11x) under ``batch``, 1.05-1.24x (mean 1.12x) under ``normal``;
there the plan, which varies from run to run, moves the step time more. (An earlier session
found ``nice 10`` and ``SCHED_IDLE`` within noise: 1.06x and 1.05x against 1.08x,
docs/cpu-memory.md.)

Why it is not the default: on a model whose forward and backward take a few milliseconds, with
every core busy, a batch control thread may not run at all before backward has used the saved
tensors, so that step writes nothing and saves nothing (``tests/policy/test_adaptive_default.py``
saw steps with no byte written in about half its runs); and with the bare adaptive context,
what ``make demo`` and the benchmarks run, the gain was within noise.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator

logger = logging.getLogger("tba")

ENV = "TBA_THREAD_POLICY"
POLICIES = ("batch", "normal")
DEFAULT_POLICY = "normal"

_warned = False


def thread_policy() -> str:
    """The policy tba's threads start under: ``$TBA_THREAD_POLICY``, else :data:`DEFAULT_POLICY`."""
    global _warned
    value = os.environ.get(ENV, "").strip().lower() or DEFAULT_POLICY
    if value in POLICIES:
        return value
    if not _warned:
        _warned = True
        logger.warning("tba: %s=%r is not one of %s; using %r", ENV, value, ", ".join(POLICIES), DEFAULT_POLICY)
    return DEFAULT_POLICY


def background() -> None:
    """Put the calling thread under :func:`thread_policy` (a no-op where the platform has no ``SCHED_BATCH``).

    Only a thread under the ordinary policy (``SCHED_OTHER``) moves: one the user started under
    ``SCHED_IDLE`` (never raised) or a real-time policy (never demoted) stays as it is.

    Note: [A dead thread object of tba's runs no Python]
    ``threading.Thread.__init__`` adds every thread object to the module's ``_dangling`` weak set,
    whose weak-reference callback is Python code. A tba thread's object often dies with its owner
    (an engine, an offloader) when the cycle collector frees them, in whatever thread of the user's
    allocates at that moment, and a Ctrl-C landing in that callback was printed as "Exception
    ignored" and dropped (Note [Asynchronous exceptions] in ``tba/_control.py``): an adversarial
    review swallowed 99 of 100. The set only serves CPython's own test suite, so each tba thread
    takes itself out of it here, first thing (a pool's workers too, through their initializer).
    """
    dangling = getattr(threading, "_dangling", None)
    if dangling is not None:
        dangling.discard(threading.current_thread())
    if thread_policy() != "batch" or not hasattr(os, "SCHED_BATCH"):
        return
    try:
        if os.sched_getscheduler(0) == os.SCHED_OTHER:
            os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    except OSError as err:  # a sandbox that forbids it: the thread runs as before
        logger.debug("tba: SCHED_BATCH refused for a tba thread: %s", err)


@contextlib.contextmanager
def ordinary() -> Iterator[None]:
    """Run the user's code (a callback on a tba thread) under the ordinary policy: whatever it
    starts (threads, processes) inherits the policy of the thread that starts it."""
    moved = False
    try:
        if hasattr(os, "SCHED_BATCH") and os.sched_getscheduler(0) == os.SCHED_BATCH:
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
            moved = True
    except OSError as err:
        logger.debug("tba: could not leave SCHED_BATCH for a user callback: %s", err)
    try:
        yield
    finally:
        if moved:
            try:
                os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
            except OSError:
                pass


def current_policy() -> str:
    """``batch`` when the calling thread runs under ``SCHED_BATCH``, else ``normal`` (what the tests check)."""
    if not hasattr(os, "SCHED_BATCH"):
        return "normal"
    return "batch" if os.sched_getscheduler(0) == os.SCHED_BATCH else "normal"
