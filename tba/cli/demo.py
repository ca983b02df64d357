"""Train a small built-in GPT on CPU with and without tba, and compare, under a caching malloc and under glibc's.

Runs a few steps keep-all, then the same steps with tba, each in a fresh plain process (no malloc
tuning), and prints the median step time of the measured steps, the activation peak (the most
resident memory above what the process held before its first step, over every step, the first and
the warm-up steps included, so that memory a caching malloc keeps from an earlier step counts), the
bytes written and read with their bandwidth, and whether the losses are identical. tba runs
exactly as a new user writes it: a bare ``with tba.offload_activations(directory=d):`` around each
step's forward, nothing else passed, so adaptive: the three warm-up steps are its layer-finding
step and its two profiled steps (keep-all runs them too), the measured steps follow its plan.

Then both modes run once more in one process, one step of each in turn, and the step-time ratio
printed last comes from there (Note [Speeds are compared step by step] in
``tba/bench/interleaved.py``: on a VM one process can run the same steps up to 25% slower than
another); ``--no-turns`` skips it. The peaks come only from the separate processes.

Both modes run under ``--allocator`` (default ``auto``: the best caching allocator found, as
``python -m tba run`` picks it) and then again under the C library's malloc (``system``, glibc), so
that both are shown: under glibc, freed activations' memory is not reused and tba hands pages back
to the kernel, which fault in again every step (docs/cpu-memory.md).
"""

from __future__ import annotations

import argparse
import logging

from tba.allocator import CHOICES, INSTALL_HINTS, launch_env
from tba.bench.interleaved import run_interleaved_isolated
from tba.bench.isolated import run_isolated
from tba.bench.models import PRESETS
from tba.cli import _checks as cli_checks
from tba.cli._report import comparison_rows, format_table, losses_match
from tba.errors import TbaConfigError

logger = logging.getLogger("tba")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small", help="model size (default: small)")
    parser.add_argument("--steps", type=cli_checks.int_at_least(1), default=4, help="measured steps per mode (default: 4)")
    parser.add_argument("--warmup", type=cli_checks.int_at_least(0), default=3,
                        help="unmeasured steps first (default: 3, the adaptive context's layer-finding and profiled steps)")
    parser.add_argument("--directory", type=cli_checks.nonempty_path, default=None,
                        help="spill directory (default: $TBA_DIR or the temp dir); " + cli_checks.MISSING_REFUSED)
    parser.add_argument("--backend", type=cli_checks.backend_name, default="auto", help="I/O backend (default: auto)")
    parser.add_argument("--no-turns", dest="turns", action="store_false",
                        help="skip the run in which both modes take a step in turn in one process")
    parser.add_argument("--allocator", choices=CHOICES, default="auto",
                        help="malloc preloaded into both modes: auto = best caching allocator found (default); "
                             "the C library's (system) rows follow unless it is system already")


def run(args: argparse.Namespace) -> int:
    config = PRESETS[args.preset]
    try:
        _, malloc = launch_env(args.allocator)
        directory = cli_checks.spill_directory(args.directory)
    except (TbaConfigError, ValueError) as err:
        cli_checks.usage_error("demo", str(err))
    logger.info("model: GPT preset %r (%d layers, width %d, sequence %d, batch %d)", args.preset,
                config.layers, config.width, config.seq_len, config.batch_size)
    if malloc.startswith("system") and args.allocator == "auto":
        logger.info("no caching allocator found (%s; or %s): the demo runs under glibc only",
                    INSTALL_HINTS["jemalloc"], INSTALL_HINTS["mimalloc"])
    allocators = [args.allocator] + ([] if malloc.startswith("system") else ["system"])
    rows, results = [], []
    for choice in allocators:
        _, described = launch_env(choice)
        logger.info("malloc: %s", described)
        group = []
        for mode in ("keep", "tba"):
            logger.info("running %s: %d warm-up + %d measured steps in a fresh process ...", mode, args.warmup, args.steps)
            group.append(run_isolated(mode, args.preset, steps=args.steps, warmup=args.warmup, directory=directory,
                                      backend=args.backend, usage="bare", malloc_env=False, allocator=choice))
        turns = None
        if args.turns:
            logger.info("running keep and tba in one process, one step of each in turn ...")
            turns = run_interleaved_isolated(["keep", "tba"], args.preset, rounds=args.steps, warmup=args.warmup,
                                             directory=directory, backend=args.backend, usage="bare",
                                             malloc_env=False, allocator=choice)
        rows += comparison_rows(group, peak="footprint", turns=turns)
        results.append(group)
    print(format_table(rows))
    same = (all(losses_match(row) for row in rows)
            and all(g[0].losses == results[0][0].losses for g in results))
    print(f"\nlosses per step (keep): {results[0][0].losses}")
    print(f"losses per step (tba):  {results[0][1].losses}")
    print(f"losses identical: {'yes' if same else 'NO'}")
    for group, tba_row in zip(results, rows[1::2]):
        if "turns_step_ratio" in tba_row:
            speed = (f"{tba_row['turns_step_ratio']:.2f}x its step time (steps taken in turn in one process; "
                     f"{tba_row['step_ratio']:.2f}x between the separate processes)")
        else:
            speed = f"{tba_row['step_ratio']:.2f}x its step time"
        plan = f" (plan {group[1].plan['code']})" if group[1].plan else ""
        print(f"under {group[1].allocator}: tba{plan} activation peak is {tba_row['peak_ratio']:.0%} of keep-all at {speed}")
    if any(group[1].plan for group in results):
        print("(plan: what tba chose for each layer after profiling, K keep, O offload, R recompute, S offloaded "
              "recompute; docs/policies.md)")
    print(f"(written / read MiB: what tba moved over all {args.warmup + args.steps} steps, the warm-up and profiled "
          "ones too; GB/s: the mean rate of its writes and reads)")
    if len(results) > 1:
        print("(glibc's malloc does not reuse freed activations' memory; run training under "
              "`python -m tba run script.py`, see docs/cpu-memory.md)")
    return 0 if same else 1
