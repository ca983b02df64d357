"""CPU time of each thread of this process, by name (Linux ``/proc``): where a loop's host time goes.

Each thread's time on a CPU comes from ``/proc/self/task/TID/schedstat`` (the scheduler's own count, in
nanoseconds), or from ``utime + stime`` in ``stat`` (clock ticks, usually 10 ms) where schedstat is
missing. A thread is named as Python knows it (``threading.Thread.name``), else by the kernel's
``comm`` (io_uring's workers are ``iou-wrk-TID``, torch's autograd device threads ``pt_autograd_N``);
a trailing ``-digits`` or ``_digits`` is dropped, so a pool's threads add up under one name. A thread
that started and ended between two readings is not counted. Elsewhere than Linux, readings are empty.
"""

from __future__ import annotations

import os
import re
import threading

_TASKS = "/proc/self/task"
_POOL_SUFFIX = re.compile(r"[-_]\d+$")
_TICK_NS = 1_000_000_000 // (os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100)


def _on_cpu_ns(tid: str) -> int | None:
    try:
        with open(f"{_TASKS}/{tid}/schedstat") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open(f"{_TASKS}/{tid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) * _TICK_NS
    except (OSError, ValueError, IndexError):
        return None


def _comm(tid: str) -> str:
    try:
        with open(f"{_TASKS}/{tid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


def snapshot() -> dict[int, tuple[str, int]]:
    """Thread id -> (name, nanoseconds on a CPU so far), for every thread of this process now."""
    try:
        tids = os.listdir(_TASKS)
    except OSError:
        return {}
    python_names = {thread.native_id: thread.name for thread in threading.enumerate()}
    found = {}
    for tid in tids:
        ns = _on_cpu_ns(tid)
        if ns is not None:
            name = python_names.get(int(tid)) or _comm(tid)
            found[int(tid)] = (_POOL_SUFFIX.sub("", name), ns)
    return found


def by_name(before: dict[int, tuple[str, int]], after: dict[int, tuple[str, int]]) -> dict[str, int]:
    """Nanoseconds each thread name spent on a CPU between two :func:`snapshot` readings."""
    spent: dict[str, int] = {}
    for tid, (name, ns) in after.items():
        delta = ns - before.get(tid, (name, 0))[1]
        if delta > 0:
            spent[name] = spent.get(name, 0) + delta
    return spent
