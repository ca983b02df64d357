"""The text ``python -m tba bench-hooks`` prints: its table and the lines below it (``tba/cli/bench_hooks.py``)."""

from __future__ import annotations

import os

from tba.bench.collector import AloneResult
from tba.bench.hooks import HookResult
from tba.bench.hooks_many import FLOOR_PROBE_READS, ManyResult
from tba.bench.thread_cpu import CLOCK as THREAD_CLOCK
from tba.defaults import KIB, MIB


def size_text(nbytes: int) -> str:
    if nbytes % MIB == 0:
        return f"{nbytes // MIB} MiB"
    if nbytes % KIB == 0:
        return f"{nbytes // KIB} KiB"
    return f"{nbytes} B"


def row_name(result: HookResult) -> str:
    """A row as the lines under the table name it: count x size, then the directory's kind or ``keep``."""
    where = "keep" if result.case.path == "keep" else result.case.label
    return f"{result.case.count} x {size_text(result.case.size_bytes)} {where}"


def format_table(results: list[HookResult]) -> str:
    """The rows as an aligned table (the directory column as wide as its longest entry)."""
    wheres = ["keep_in_memory()" if r.case.path == "keep" else f"{os.path.dirname(r.case.directory)} ({r.case.label})"
              for r in results]
    width = max([26, *map(len, wheres)])
    header = (f"{'storages x size':<18} {'directory':<{width}} {'base fwd ms':>11} {'tba fwd ms':>10} {'extra fwd us':>12} "
              f"{'base bwd ms':>11} {'tba bwd ms':>10} {'extra bwd us':>12}")
    lines = [header, "-" * len(header)]
    for r, where in zip(results, wheres):
        shape = f"{r.case.count} x {size_text(r.case.size_bytes)}"
        lines.append(f"{shape:<18} {where:<{width}} "
                     f"{r.base_forward_s * 1e3:>11.1f} {r.tba_forward_s * 1e3:>10.1f} {r.extra_forward_us:>12.1f} "
                     f"{r.base_backward_s * 1e3:>11.1f} {r.tba_backward_s * 1e3:>10.1f} {r.extra_backward_us:>12.1f}")
    return "\n".join(lines)


def format_means(results: list[HookResult], repeats: int) -> str:
    """Per row, the extra microseconds per storage between the mean steps, and the cycle collector's share."""
    lines = [f"mean of the {repeats} measured steps, every one counted (a user's average step): extra us per storage "
             "forward / backward; the cycle collector's us per storage and step and its full collections, with tba "
             "(without):"]
    for r in results:
        if not r.mean_s:
            continue
        forward_us, backward_us = r.mean_extra_us
        lines.append(f"  {row_name(r)}: {forward_us:.1f} / {backward_us:.1f}; "
                     f"collector {r.collector_us('tba'):.1f} ({r.collector_us('base'):.1f}), "
                     f"full {r.full_collections.get('tba', 0)} ({r.full_collections.get('base', 0)})")
    return "\n".join(lines)


def format_thread_cpu(results: list[HookResult]) -> str:
    """Per row, each thread's CPU microseconds per storage with tba (without tba in brackets), and the totals."""
    lines = [f"CPU us per storage by thread in the best step, with tba (without); clock: {THREAD_CLOCK}:"]
    for r in results:
        names = list(r.thread_cpu_us) + [name for name in r.base_thread_cpu_us if name not in r.thread_cpu_us]
        parts = [f"{name} {r.thread_cpu_us.get(name, 0.0):.1f} ({r.base_thread_cpu_us.get(name, 0.0):.1f})"
                 for name in names if max(r.thread_cpu_us.get(name, 0.0), r.base_thread_cpu_us.get(name, 0.0)) >= 0.5]
        total, base = sum(r.thread_cpu_us.values()), sum(r.base_thread_cpu_us.values())
        lines.append(f"  {row_name(r)}: total {total:.1f} ({base:.1f}); " + ", ".join(parts))
    return "\n".join(lines)


def format_python_work(results: list[HookResult]) -> str:
    """Per row and phase, the Python lines / calls / C calls each thread ran per storage, with tba less without."""
    lines = ["Python work per storage, one step with tba less one without (tba/bench/python_work.py): lines / calls / "
             "C calls by thread:"]
    for r in results:
        for phase, threads in r.python_work.items():
            total = sum(kinds["lines"] for kinds in threads.values())
            parts = [f"{thread} {kinds['lines']:.1f} / {kinds['calls']:.1f} / {kinds['c_calls']:.1f}"
                     for thread, kinds in threads.items() if max(abs(n) for n in kinds.values()) >= 0.5]
            lines.append(f"  {row_name(r)} {phase}: {total:.1f} lines; " + ", ".join(parts))
    return "\n".join(lines)


def format_alone(results: list[AloneResult]) -> str:
    """The loops run alone (``--alone-steps``): step and collector microseconds per storage, full collections."""
    with_tba, without = results
    return (f"{with_tba.count} x {size_text(with_tba.size_bytes)}, {with_tba.steps} steps alone in a process of its own, "
            f"with tba (without): step {with_tba.step_us:.1f} ({without.step_us:.1f}) us per storage; cycle collector "
            f"{with_tba.collector_us:.1f} ({without.collector_us:.1f}) us per storage and step, "
            f"{with_tba.full_collections} ({without.full_collections}) full collections")


def format_many(result: ManyResult) -> str:
    text = (f"{result.count} x {size_text(result.size_bytes)} in {os.path.dirname(result.directory)} (disk): backward "
            f"{result.tba_backward_s:.2f} s with tba, {result.base_backward_s:.2f} s without "
            f"({result.backward_ratio:.2f}x); forward {result.tba_forward_s:.2f} s / {result.base_forward_s:.2f} s")
    if result.floor_s is not None and not result.bytes_read:
        text += "\n  tba read nothing back (backward took every storage from memory): the disk sets no floor"
    elif result.floor_s is not None:
        text += (f"\n  the disk alone: {result.bytes_read / 1e9:.2f} GB read back at {result.disk_read_gbps:.2f} GB/s "
                 f"(the same directory, 1 MiB {'O_DIRECT' if result.disk_direct else 'buffered'} reads, the best of "
                 f"{FLOOR_PROBE_READS}, this run) take {result.floor_s:.2f} s, "
                 f"{result.floor_ratio:.2f}x the backward without tba: no backward reading them goes below that")
    elif result.disk_error:
        text += f"\n  the disk's read rate was not measured ({result.disk_error}): no floor for the ratio"
    if result.thread_cpu_us:
        text += "\n  CPU us per storage by thread, with tba: " + ", ".join(
            f"{name} {us:.1f}" for name, us in result.thread_cpu_us.items() if us >= 0.5)
    return text
