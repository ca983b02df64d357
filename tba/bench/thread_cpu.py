"""CPU time of each thread of this process, by name (Linux ``/proc``): where a loop's host time goes.

Each thread's time on a CPU comes from ``/proc/self/task/TID/schedstat`` (the scheduler's own count, in
nanoseconds), or from ``utime + stime`` in ``stat`` (clock ticks, usually 10 ms) where schedstat is
missing (:data:`CLOCK` says which). A thread is named as Python knows it (``threading.Thread.name``) when
Python started it, else by the kernel's ``comm``: io_uring's workers are ``iou-wrk-TID``, torch's autograd
device threads ``pt_autograd_N``, and unnamed native threads (torch's OpenMP workers, a library's pool)
``python``. A thread Python did not start but that ran Python code is a ``threading._DummyThread``
named ``Dummy-N``; its ``comm`` is kept instead. A trailing ``-digits`` or ``_digits`` is dropped, so a
pool's threads add up under one name. A thread is known by its id and start time, so an id the kernel
reused is a new thread. A thread that ended between two readings took its time with it: what the whole
process spent beyond the threads still there is reported as :data:`EXITED`. Elsewhere than Linux,
readings are empty.
"""

from __future__ import annotations

import os
import re
import threading
import time

_TASKS = "/proc/self/task"
_POOL_SUFFIX = re.compile(r"[-_]\d+$")
_TICK_NS = 1_000_000_000 // (os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100)
_PROCESS = (-1, -1)
"""The key under which a snapshot keeps the whole process's CPU time."""
CLOCK = "schedstat" if os.path.exists("/proc/self/schedstat") else "ticks"
"""Where thread times come from: ``schedstat`` (nanoseconds) or ``ticks`` (``stat``'s clock ticks)."""
EXITED = "(threads that ended)"
"""The name under which :func:`by_name` reports the process's CPU time not found in any live thread."""
EXITED_MIN_FRACTION = 0.02
"""Below this fraction of the process's time, that remainder is rounding between the two clocks: not reported."""


def _stat_fields(tid: str) -> list[str] | None:
    try:
        with open(f"{_TASKS}/{tid}/stat", errors="replace") as f:  # its second field is the name, as in comm
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _on_cpu_ns(tid: str, fields: list[str]) -> int | None:
    try:
        with open(f"{_TASKS}/{tid}/schedstat") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    try:
        return (int(fields[11]) + int(fields[12])) * _TICK_NS
    except (ValueError, IndexError):
        return None


def _comm(tid: str) -> str:
    try:
        with open(f"{_TASKS}/{tid}/comm", errors="replace") as f:  # a name set by prctl need not be UTF-8
            return f.read().strip()
    except OSError:
        return "?"


def snapshot() -> dict[tuple[int, int], tuple[str, int]]:
    """(thread id, start time) -> (name, nanoseconds on a CPU so far), for every thread of this process now,
    and the whole process's CPU nanoseconds under a key of its own."""
    try:
        tids = os.listdir(_TASKS)
    except OSError:
        return {}
    python_names = {thread.native_id: thread.name for thread in threading.enumerate()
                    if not isinstance(thread, threading._DummyThread)}
    found = {_PROCESS: ("", time.process_time_ns())}
    for tid in tids:
        fields = _stat_fields(tid)
        if fields is None or len(fields) < 20:
            continue
        ns = _on_cpu_ns(tid, fields)
        if ns is not None:
            name = python_names.get(int(tid)) or _comm(tid)
            found[(int(tid), int(fields[19]))] = (_POOL_SUFFIX.sub("", name), ns)
    return found


def by_name(before: dict[tuple[int, int], tuple[str, int]],
            after: dict[tuple[int, int], tuple[str, int]]) -> dict[str, int]:
    """Nanoseconds each thread name spent on a CPU between two :func:`snapshot` readings (see :data:`EXITED`)."""
    spent: dict[str, int] = {}
    for key, (name, ns) in after.items():
        if key == _PROCESS:
            continue
        delta = ns - before.get(key, (name, 0))[1]
        if delta > 0:
            spent[name] = spent.get(name, 0) + delta
    if CLOCK == "schedstat" and _PROCESS in before and _PROCESS in after:
        process = after[_PROCESS][1] - before[_PROCESS][1]
        missing = process - sum(spent.values())
        if process > 0 and missing > EXITED_MIN_FRACTION * process:
            spent[EXITED] = missing
    return spent
