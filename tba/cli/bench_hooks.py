"""Host microseconds tba adds per saved storage in forward and in backward, against the same loop without tba.

Each of ``n`` leaf tensors goes through ``torch.tanh`` inside a bare ``with
tba.offload_activations(directory=d):`` and one backward runs over all of them; each output is
reduced by ``sum()`` at once, so only autograd holds the saved outputs and tba reads each back
(``--hold-outputs`` keeps the outputs themselves until backward instead, and tba then serves them
from the program's memory: the write and the bookkeeping without the read); the same loop
without tba runs interleaved in the same process. Every figure is the best of ``--repeats`` after
``--warmups``; below the table, the mean of those steps and the cycle collector's share of them.
Rows: each size (``--sizes``) and count (``--counts``, capped so that a row holds at
most ``--max-bytes``) on a disk directory and a RAM-backed one, plus the keep path (the same loop
inside ``tba.keep_in_memory()``, so every tensor goes through the pack hook and stays in memory).
``--many`` adds the large-count check: ``--many-count`` storages of 64 KiB on the disk directory,
backward time with tba against without, and the floor of that ratio: how long the same directory, measured in the
same run, takes to read the bytes tba read back (Note [The disk's floor under the many-storage ratio] in
``tba/bench/hooks_many.py``). Progress goes to stderr, the table to stdout, ``--json
PATH`` writes every figure. ``--allocator`` (default ``auto``: the best caching malloc found, as
``python -m tba run`` picks it; ``system``: the C library's) re-executes the command once with that
malloc preloaded, so that both loops, with and without tba, run under it; the header names the
malloc that served the run. See docs/host-cost.md.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import logging
import os
import sys
import tempfile

import torch

from tba._units import parse_size
from tba.allocator import CHOICES as ALLOCATORS
from tba.allocator import detect, run_script_under
from tba.bench.collector import AloneRunError, measure_alone
from tba.bench.hooks import HookCase, measure, setup_notices_dropped
from tba.bench.hooks_many import measure_many
from tba.bench.thread_cpu import CLOCK as THREAD_CLOCK
from tba.cli import _checks as cli_checks
from tba.cli._hooks_report import (
    format_alone,
    format_many,
    format_means,
    format_python_work,
    format_table,
    format_thread_cpu,
    size_text,
)
from tba.cli._progress import Progress
from tba.defaults import GIB, KIB
from tba.errors import TbaConfigError
from tba.io import memory_backed

logger = logging.getLogger("tba")

DEFAULT_SIZES = "64K,1M,16M"
DEFAULT_COUNTS = "400,2000"
DEFAULT_MAX_BYTES = GIB
DEFAULT_DISK_DIR = "/var/tmp"
DEFAULT_RAM_DIR = "/dev/shm"
DEFAULT_MANY_COUNT = 100_000
MANY_SIZE_BYTES = 64 * KIB


def _whole(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a whole number; pass counts such as 400,2000") from None


def _csv(parse):
    """A comma-separated list of positive values, each read by ``parse``."""
    def convert(text: str) -> list:
        try:
            values = [parse(item) for item in text.split(",")]
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
        if not values or any(value < 1 for value in values):
            raise argparse.ArgumentTypeError(f"{text!r}: pass values > 0, comma separated")
        return values
    return convert


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the benchmark's options to ``parser``."""
    parser.add_argument("--sizes", type=_csv(parse_size), default=DEFAULT_SIZES,
                        help=f"storage sizes, comma separated (default {DEFAULT_SIZES})")
    parser.add_argument("--counts", type=_csv(_whole), default=DEFAULT_COUNTS,
                        help=f"storages per step, comma separated (default {DEFAULT_COUNTS})")
    parser.add_argument("--max-bytes", type=cli_checks.positive_size, default=DEFAULT_MAX_BYTES,
                        help="cap on count x size per row; a row's count is lowered to fit (default 1G)")
    parser.add_argument("--disk-dir", type=cli_checks.nonempty_path, default=None,
                        help=f"the disk directory (default a fresh one under $TBA_DIR when set, else under "
                             f"{DEFAULT_DISK_DIR})")
    parser.add_argument("--ram-dir", type=cli_checks.nonempty_path, default=None,
                        help=f"the RAM-backed directory (default a fresh one under {DEFAULT_RAM_DIR}); "
                             "'none' skips those rows")
    parser.add_argument("--no-disk", action="store_true", help="skip the disk rows")
    parser.add_argument("--no-keep", action="store_true", help="skip the keep-path rows")
    parser.add_argument("--hold-outputs", action="store_true",
                        help="the loop keeps its outputs until backward (tba then does not read them back); "
                             "default: it keeps only their sums")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="where the leaves live (default cpu); cuda times the host cost of the device path")
    parser.add_argument("--thread-cpu", action="store_true",
                        help="also print each thread's CPU microseconds per storage (Linux /proc) in the best "
                             "step with and without tba (--many: the mean over its steps with tba)")
    parser.add_argument("--sample-profile", action="store_true",
                        help="after each row, one more step with tba under a sampling profiler of every thread's stack; "
                             "prints where each thread stood (where threads wait and hand the GIL over, not CPU time)")
    parser.add_argument("--python-work", action="store_true",
                        help="after each row, one more step with and one without tba, counting the Python lines, calls "
                             "and C calls each thread runs per storage (tba/bench/python_work.py): counts, not times, "
                             "so a change to the per-storage path shows through this machine's timing noise")
    parser.add_argument("--warmups", type=cli_checks.int_at_least(0), default=2,
                        help="unmeasured steps per row (default 2)")
    parser.add_argument("--repeats", type=cli_checks.int_at_least(1), default=3,
                        help="measured steps per row; the best counts (default 3)")
    parser.add_argument("--many", action="store_true",
                        help="also time backward over --many-count storages of 64 KiB on the disk directory, and the "
                             "time the disk alone needs to read them (up to 1 GiB written and read twice)")
    parser.add_argument("--many-count", type=cli_checks.int_at_least(1), default=DEFAULT_MANY_COUNT,
                        help=f"storages in the --many case (default {DEFAULT_MANY_COUNT})")
    parser.add_argument("--quick", action="store_true",
                        help="--counts 3,6 --sizes 64K --warmups 1 --repeats 1 --many-count 50, each where that option is "
                             "not given (a smoke test; its figures mean nothing)")
    parser.add_argument("--gc-freeze", action="store_true",
                        help="gc.freeze() before measuring, as a training script can once its model is built: the "
                             "cycle collector's full collections then skip every object alive before (a tuned mode; "
                             "compare with a run without it, docs/host-cost.md)")
    parser.add_argument("--alone-steps", type=cli_checks.int_at_least(0), default=0, metavar="N",
                        help="also run the 64 KiB loop at the largest count for N steps alone, with tba and without, "
                             "each in a process of its own (under the table's --hold-outputs, --gc-freeze and "
                             "--intra-op-threads; CPU only), and print the cycle collector's time and full collections "
                             "in each (the table's interleaved loops share them; default 0: not run)")
    parser.add_argument("--intra-op-threads", type=cli_checks.int_at_least(1), default=None, metavar="N",
                        help="torch.set_num_threads(N) before measuring, both loops alike (default: torch's own, one "
                             "per core). On few cores torch's threads and the kernel's copies for tba's I/O take "
                             "turns on the same cores; 1 leaves a core to the I/O, as compute on a GPU does")
    parser.add_argument("--allocator", choices=ALLOCATORS, default="auto",
                        help="malloc to measure under, both loops alike (re-executes the command once): auto = best "
                             "caching one found (default), system = the C library's")
    parser.add_argument("--json", type=cli_checks.nonempty_path,
                        metavar="PATH", default=None, help="write every figure to PATH as JSON")


def _cases(args: argparse.Namespace, disk: str | None, ram: str | None) -> list[HookCase]:
    cases: list[HookCase] = []
    seen: set[tuple] = set()
    for label, directory in (("ram", ram), ("disk", disk)):
        if directory is None:
            continue
        for size in args.sizes:
            for count in args.counts:
                count = max(1, min(count, args.max_bytes // size))
                if (size, count, label) not in seen:
                    seen.add((size, count, label))
                    cases.append(HookCase(size, count, directory, label, hold_outputs=args.hold_outputs,
                                          device=args.device))
    if not args.no_keep:
        keep_dir = ram or disk
        for count in args.counts:
            cases.append(HookCase(args.sizes[0], count, keep_dir, "keep", path="keep", hold_outputs=args.hold_outputs,
                                  device=args.device))
    return cases


QUICK = {"counts": [3, 6], "sizes": [64 * KIB], "warmups": 1, "repeats": 1, "many_count": 50}
"""--quick's values, each for an option left at its default."""


def _make_quick(args: argparse.Namespace) -> None:
    """--quick's small values where the option was not given: ``--quick --sizes 1M`` ran 64 KiB storages, saying nothing."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    defaults = parser.parse_args([])
    for name, value in QUICK.items():
        if getattr(args, name) == getattr(defaults, name):
            setattr(args, name, value)


def run(args: argparse.Namespace) -> int:
    if args.quick:
        _make_quick(args)
    if args.warmups < 0 or args.repeats < 1:
        cli_checks.usage_error("bench-hooks", "--warmups must be >= 0 and --repeats >= 1")
    if args.no_disk and args.no_keep and args.ram_dir == "none" and not (args.many or args.alone_steps):
        cli_checks.usage_error("bench-hooks", "--no-disk, --no-keep and --ram-dir none leave no row to measure; drop one "
                                              "of them, or add --many or --alone-steps N")
    if args.device == "cuda" and args.many:
        cli_checks.usage_error("bench-hooks", "--many runs on the CPU only; drop --many or --device cuda")
    if args.device == "cuda" and args.alone_steps:
        cli_checks.usage_error("bench-hooks", "--alone-steps runs on the CPU only; drop --alone-steps or --device cuda")
    if args.device == "cuda" and not torch.cuda.is_available():
        cli_checks.usage_error("bench-hooks", "--device cuda needs a CUDA build of torch and a GPU; use --device cpu")
    try:
        for option, given in (("--disk-dir", args.disk_dir), ("--ram-dir", args.ram_dir)):
            if given is not None and given != "none":
                cli_checks.existing_directory(option, given)
        disk_parent = args.disk_dir or cli_checks.env_directory("--disk-dir")  # else DEFAULT_DISK_DIR
        if args.json:
            cli_checks.output_file("--json", args.json)
        if getattr(args, "command_line", False):
            # As `python -m tba bench-hooks` only, once its arguments are known good: called from a program
            # or a test (cli.main, run), it measures under the malloc already serving the process, which the
            # header names, and never replaces the calling process.
            run_script_under(args.allocator)
    except (ValueError, TbaConfigError) as err:
        cli_checks.usage_error("bench-hooks", str(err))
    malloc = detect()
    with contextlib.ExitStack() as stack:
        stack.enter_context(setup_notices_dropped())  # Note [A benchmark is not warned about its own set-up]
        def fresh(given: str | None, default: str) -> str:
            parent = given or (default if os.path.isdir(default) else tempfile.gettempdir())
            return stack.enter_context(tempfile.TemporaryDirectory(prefix="tba-bench-hooks-", dir=parent))

        disk_dir = None if args.no_disk and not args.many else fresh(disk_parent, DEFAULT_DISK_DIR)
        if disk_dir is not None and memory_backed(disk_dir):
            print(f"bench-hooks: the disk rows' directory {os.path.dirname(disk_dir)} is on {memory_backed(disk_dir)}, "
                  "which keeps its files in RAM: those rows measure no disk; pass --disk-dir a directory on a disk",
                  file=sys.stderr)
        ram_dir = None if args.ram_dir == "none" else fresh(args.ram_dir, DEFAULT_RAM_DIR)
        cases = _cases(args, None if args.no_disk else disk_dir, ram_dir)
        progress = Progress(len(cases) + (3 if args.many else 0) + (1 if args.alone_steps else 0))
        if args.gc_freeze:
            gc.collect()
            gc.freeze()
        if args.intra_op_threads is not None:
            torch.set_num_threads(args.intra_op_threads)
        results = []
        for case in cases:
            progress.update(f"{case.count} x {size_text(case.size_bytes)} {case.label}")
            results.append(measure(case, args.warmups, args.repeats, thread_cpu=args.thread_cpu,
                                   sample=args.sample_profile, python_work=args.python_work))
        alone = None
        if args.alone_steps:
            # The largest count a 64 KiB row of the table may hold (--max-bytes caps it there too).
            alone_count = max(1, min(max(args.counts), args.max_bytes // MANY_SIZE_BYTES))
            progress.update(f"{alone_count} x 64 KiB alone, with and without tba")
            alone_dir = ram_dir or disk_dir or fresh(disk_parent, DEFAULT_DISK_DIR)
            try:
                alone = measure_alone(alone_count, MANY_SIZE_BYTES, alone_dir, args.alone_steps,
                                      hold_outputs=args.hold_outputs, intra_op_threads=args.intra_op_threads,
                                      gc_freeze=args.gc_freeze)
            except AloneRunError as err:
                print(f"bench-hooks: error: {err}", file=sys.stderr)
                return 1
        many = None
        if args.many:
            many = measure_many(args.many_count, MANY_SIZE_BYTES, disk_dir, progress=progress.update,
                                thread_cpu=args.thread_cpu)
        progress.done()
    loop = ("held until backward (tba does not read them back)" if args.hold_outputs
            else "reduced by sum() at once (only autograd holds them; tba reads each back)")
    print(f"malloc: {malloc}; device: {args.device}; torch intra-op threads: {torch.get_num_threads()}"
          f"{'' if args.intra_op_threads else ' (its default)'}; loop: outputs {loop}"
          + ("; gc.freeze() before measuring" if args.gc_freeze else ""))
    print(format_table(results))
    print(format_means(results, args.repeats))
    if args.thread_cpu:
        print(format_thread_cpu(results))
    if args.python_work:
        print(format_python_work(results))
    if alone is not None:
        print(format_alone(alone))
    if many is not None:
        print(format_many(many))
    for result in results if args.sample_profile else ():
        print(f"sampled stacks, one more step with tba, {result.case.count} x {size_text(result.case.size_bytes)} "
              f"{result.case.label} (Note [Samples land where threads give up the GIL] in tba/bench/sampler.py):")
        print(result.sample_profile)
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"rows": [r.as_dict() for r in results], "many": many.as_dict() if many else None,
                       "alone": [dataclasses.asdict(r) for r in alone] if alone else None,
                       "thread_cpu_clock": THREAD_CLOCK if args.thread_cpu else None,
                       "malloc": str(malloc), "warmups": args.warmups, "repeats": args.repeats,
                       "gc_freeze": args.gc_freeze, "intra_op_threads": torch.get_num_threads()}, out, indent=2)
    return 0

