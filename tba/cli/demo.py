"""Train a small built-in GPT on CPU with and without tba, and compare.

Runs a few steps keep-all, then the same steps with tba, each in a fresh plain process (no malloc
tuning), and prints the median step time, the activation peak (peak RSS during a step minus RSS
before it, the worst step, the first included), the bytes written and read with their bandwidth,
and whether the losses are identical. tba runs exactly as a new user writes it: a bare
``with tba.offload_activations(directory=d):`` around each step's forward, nothing else passed.
"""

from __future__ import annotations

import argparse
import logging
import tempfile

from tba.bench.isolated import run_isolated
from tba.bench.models import PRESETS
from tba.cli import _checks as cli_checks
from tba.cli._report import comparison_rows, format_table

logger = logging.getLogger("tba")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small", help="model size (default: small)")
    parser.add_argument("--steps", type=int, default=4, help="measured steps per mode (default: 4)")
    parser.add_argument("--warmup", type=int, default=0, help="unmeasured steps first (default: 0)")
    parser.add_argument("--directory", default=None, help="spill directory (default: $TBA_DIR or the temp dir)")
    parser.add_argument("--backend", type=cli_checks.backend_name, default="auto", help="I/O backend (default: auto)")


def run(args: argparse.Namespace) -> int:
    config = PRESETS[args.preset]
    logger.info("model: GPT preset %r (%d layers, width %d, sequence %d, batch %d)", args.preset,
                config.layers, config.width, config.seq_len, config.batch_size)
    directory = args.directory or tempfile.gettempdir()
    results = []
    for mode in ("keep", "tba"):
        logger.info("running %s: %d warm-up + %d measured steps in a fresh process ...", mode, args.warmup, args.steps)
        results.append(run_isolated(mode, args.preset, steps=args.steps, warmup=args.warmup, directory=directory,
                                    backend=args.backend, usage="bare", malloc_env=False))
    rows = comparison_rows(results, peak="max")
    print(format_table(rows))
    same = rows[1]["losses_equal"]
    print(f"\nlosses per step (keep): {results[0].losses}")
    print(f"losses per step (tba):  {results[1].losses}")
    print(f"losses identical: {'yes' if same else 'NO'}; tba activation peak is "
          f"{rows[1]['peak_ratio']:.0%} of keep-all at {rows[1]['step_ratio']:.2f}x its step time")
    return 0 if same else 1
