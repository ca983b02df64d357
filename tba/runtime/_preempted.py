"""Seconds the process's other compute threads waited for a CPU: the part of offloading's cost that
the training thread's own clocks do not show.

Note: [A preempted partner costs the training thread CPU time]
On a CPU box whose cores torch's intra-op threads fill, every time tba's threads or the kernel's
block workers take a core, one compute thread waits in the run queue. When it is the training
thread, its wall-clock grows and its CPU seconds do not: the profile sees that as I/O time (Note
[I/O time is measured within one step] in ``tba/runtime/_profiling.py``). When it is one of
torch's OpenMP workers, the training thread reaches the next barrier and spins there until its
partner is back: its wall-clock and its CPU seconds grow alike, and the step is as much slower,
yet the training thread's clocks show no I/O time at all. On the ``bench`` preset (2-core VM,
alternating keep-all and offload-all steps in one process) the training thread's wall-clock beyond
its CPU time was 0.15-0.19 s per offloaded step, the OpenMP worker's run-queue wait 0.05-0.17 s,
and offload-all's step took 0.20-0.47 s longer than keep-all's: their sum, 0.22-0.32 s, matched
the step's growth (mean 0.26 against 0.27 s); the training thread's gap alone was about 60% of it.

So a profiled step also adds the run-queue wait (``/proc/self/task/<tid>/schedstat``, second
field: nanoseconds runnable but not running) of the process's other *compute* threads: those that
ran for at least :data:`COMPUTE_SHARE` of the interval, leaving out tba's own threads (named
``tba-*``) and the kernel's io_uring workers (``iou-*``). A keep-all step's figure is a few
milliseconds. The waits are summed: with one partner (the 2-core VM) that is the delay; with many
workers preempted at the same moments it counts those moments more than once, an upper bound
(the training thread waits for the last partner back, not for each in turn). Where the kernel
keeps no schedstats, :func:`snapshot` returns None and only the training thread's gap counts.
"""

from __future__ import annotations

import os
import threading

COMPUTE_SHARE = 0.1
"""A thread counts as compute when it ran (CPU seconds) for at least this share of the interval's wall-clock."""

_TASKS = "/proc/self/task"

Snapshot = dict[int, tuple[int, int]]
"""Native thread id -> (CPU nanoseconds, run-queue wait nanoseconds) so far."""


def _excluded() -> set[int]:
    """The calling thread and tba's own threads (native ids)."""
    ids = {threading.get_native_id()}
    ids.update(t.native_id for t in threading.enumerate() if t.name.startswith("tba-") and t.native_id is not None)
    return ids


def snapshot() -> Snapshot | None:
    """CPU and run-queue wait so far of every thread of the process but the caller, tba's and
    io_uring's; None where the kernel keeps no schedstats."""
    if not os.path.exists("/proc/self/schedstat"):
        return None
    try:
        tasks = os.listdir(_TASKS)
    except OSError:
        return None
    excluded = _excluded()
    out: Snapshot = {}
    for name in tasks:
        tid = int(name)
        if tid in excluded:
            continue
        try:
            with open(f"{_TASKS}/{name}/comm", "rb") as comm:  # bytes: a name need not be UTF-8 (prctl)
                if comm.read().startswith(b"iou-"):
                    continue
            with open(f"{_TASKS}/{name}/schedstat") as stat:
                cpu_ns, wait_ns, _ = stat.read().split()
        except (OSError, ValueError):
            continue  # a thread that ended meanwhile
        out[tid] = (int(cpu_ns), int(wait_ns))
    return out


def waited_s(before: Snapshot | None, after: Snapshot | None, wall_s: float) -> float | None:
    """Seconds of run-queue wait between two snapshots ``wall_s`` apart, summed over the threads that
    computed for at least :data:`COMPUTE_SHARE` of it; None when either snapshot is missing."""
    if before is None or after is None:
        return None
    total_ns = 0
    for tid, (cpu_ns, wait_ns) in after.items():
        if tid not in before:
            continue
        cpu0, wait0 = before[tid]
        if (cpu_ns - cpu0) >= COMPUTE_SHARE * wall_s * 1e9:
            total_ns += max(0, wait_ns - wait0)
    return total_ns / 1e9
