"""Capacity: the largest micro-batch each strategy trains within an activation-memory budget.

``python -m tba capacity --preset deep --budget 512M`` takes one built-in GPT at a fixed sequence
length and, for keep-all, full recompute (non-reentrant checkpoint on every layer), offload-all
(tba), offloaded recompute (tba: every layer recomputed in backward, its input written to the
spill file) and adaptive (tba's planner given the budget), finds the largest batch whose
activation peak stays within the budget. Each measurement is a fresh process (a warm-up step, then
the measured steps), forked from a server that imported torch once (``tba/bench/_forkserver.py``).
The peak is the run's footprint: the most memory above what the process held before its first
step (weights, gradients, batch), over every step, so a caching malloc's retained memory counts;
on CUDA, allocated device memory above the same point.

The search (``tba/cli/_capacity_search.py``) measures the peak at two small batches (keep-all: 1
and 2; the others: keep-all's largest batch and twice it), fits ``peak = a + b * batch``, predicts
the largest batch and confirms it by measuring there and one sample above, adjusting when the
confirmation disagrees. It reports tokens/s at each strategy's largest batch and, for every
strategy, at keep-all's largest batch (the same work, so the speeds compare). Those last speeds
come from one more process in which every strategy takes a step in turn (Note [Speeds are compared
step by step] in ``tba/bench/interleaved.py``), with losses that must match keep-all's step for step. A strategy whose run
fails at its first batch (an unknown placement on this version of tba, a budget an adaptive plan
cannot meet) is reported as unavailable with the reason instead of ending the run. The JSON file is
rewritten after every measurement, so a killed run leaves its partial results; ``--png`` draws the
bars (matplotlib, ``pip install 'tba-offload[plot]'``).
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from tba._units import parse_size
from tba.allocator import CHOICES as ALLOCATORS
from tba.allocator import launch_env
from tba.bench.models import PRESETS
from tba.cli import _checks as cli_checks
from tba.cli._capacity_report import StrategyResult, budget_text, format_table
from tba.cli._capacity_run import STRATEGIES, Settings, measure_capacity
from tba.cli._capacity_search import MAX_BATCH
from tba.cli.rok import check_setup
from tba.errors import TbaConfigError

logger = logging.getLogger("tba")

REQUIRED = ("keep", "recompute", "offload")
"""Strategies that exist in every version of tba: the exit status is 1 when one of them failed."""


def best_line(results: Sequence[StrategyResult], ratios: Mapping[str, Any]) -> str | None:
    """The closing summary: the best tba strategy's largest batch, and its ratio to each of full recompute
    and keep-all that was measured (a subset of ``--strategies`` leaves the others out)."""
    best = next((r for r in results if r.name == ratios["best_tba_strategy"]), None)
    if best is None:
        return None
    against = [f"{ratio:.2f}x {label}'s" for other, label in (("recompute", "full recompute"), ("keep", "keep-all"))
               if (ratio := ratios[f"best_tba_max_batch_over_{other}"]) is not None]
    return (f"best tba strategy: {best.label}, largest batch {best.max_batch}"
            + (f" ({', '.join(against)})" if against else ""))


def _strategy_list(text: str) -> tuple[str, ...]:
    names = [name for name, _, _ in STRATEGIES]
    chosen = tuple(part.strip() for part in text.split(","))
    unknown = [name for name in chosen if name not in names]
    if unknown or not chosen:
        raise argparse.ArgumentTypeError(f"unknown strategy {', '.join(unknown)!r}; choose from {', '.join(names)}")
    return tuple(name for name in names if name in chosen)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", choices=sorted(PRESETS), default="deep", help="built-in GPT (default: deep)")
    parser.add_argument("--budget", type=parse_size, required=True,
                        help="activation memory budget, e.g. 512M or 2GiB (binary), 500MB (decimal)")
    parser.add_argument("--seq", type=cli_checks.int_at_least(1), default=None, help="sequence length (default: the preset's)")
    parser.add_argument("--device", type=cli_checks.device_name, default="auto",
                        help="cpu, cuda, or auto (default: cuda when torch sees a GPU, else cpu)")
    parser.add_argument("--allocator", choices=ALLOCATORS, default="auto",
                        help="malloc preloaded into every run: auto = best caching allocator found (default), "
                             "system = the C library's (glibc)")
    parser.add_argument("--json", type=cli_checks.nonempty_path, default="capacity.json",
                        help="JSON results, rewritten after every measurement (default: capacity.json)")
    parser.add_argument("--png", type=cli_checks.nonempty_path, default=None, help="bar chart of the results (needs matplotlib)")
    parser.add_argument("--steps", type=cli_checks.int_at_least(1), default=1, help="measured steps per run (default: 1)")
    parser.add_argument("--warmup", type=cli_checks.int_at_least(0), default=0,
                        help="unmeasured steps first, peak counted (default: 0; each run is primed with a 1-sample step)")
    parser.add_argument("--max-batch", type=cli_checks.int_at_least(1), default=MAX_BATCH,
                        help=f"largest batch tried (default: {MAX_BATCH})")
    parser.add_argument("--directory", type=cli_checks.nonempty_path,
                        default=None, help="spill directory (default: $TBA_DIR or the temp dir); " + cli_checks.MISSING_REFUSED)
    parser.add_argument("--backend", type=cli_checks.backend_name, default="auto", help="tba I/O backend (default: auto)")
    parser.add_argument("--threads", type=cli_checks.int_at_least(1), default=None,
                        help="torch threads per run (default: torch's; 1 is steadier on a busy machine)")
    parser.add_argument("--strategies", type=_strategy_list, default=",".join(name for name, _, _ in STRATEGIES),
                        help="comma-separated subset to measure (default: %(default)s)")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")


def run(args: argparse.Namespace) -> int:
    try:
        if args.budget <= 0:
            raise ValueError(f"--budget must be positive, got {args.budget} bytes; pass a size such as 512M")
        launch_env(args.allocator)
        check_setup(None, args.device)
        args.directory = cli_checks.spill_directory(args.directory)
        json_path = cli_checks.output_file("--json", args.json)
        png_path = cli_checks.output_file("--png", args.png) if args.png else None
    except (ValueError, TbaConfigError) as err:
        cli_checks.usage_error("capacity", str(err))
    seq_len = args.seq or PRESETS[args.preset].seq_len
    settings = Settings(args.preset, args.budget, seq_len, device=args.device, allocator=args.allocator,
                        steps=args.steps, warmup=args.warmup, directory=args.directory, backend=args.backend,
                        threads=args.threads, max_batch=args.max_batch, strategies=args.strategies)
    results, doc = measure_capacity(settings, json_path=json_path, png_path=png_path, progress=not args.quiet)
    config = PRESETS[args.preset]
    print(f"capacity within {budget_text(args.budget)} of activations: preset {args.preset} ({config.layers} layers, "
          f"width {config.width}, sequence {seq_len}), {args.device}, malloc {doc['allocator']}")
    print(format_table(results, seq_len, doc["keep_max_batch"]))
    line = best_line(results, doc)
    if line:
        print(f"\n{line}")
    speed = doc["offload_over_recompute_tokens_per_s_at_keep_max"]
    if speed is not None:
        print(f"offload-all tokens/s at keep-all's largest batch: {speed:.2f}x full recompute's")
    print("wrote " + ", ".join(p for p in (json_path, png_path) if p))
    failed = [r.label for r in results if r.name in REQUIRED and r.status != "ok"]
    if failed:
        print(f"failed: {', '.join(failed)} (-v shows each failed run's error)")
    unequal = [r.label for r in results if r.same_loss_at_keep_max is False]
    if unequal:
        print(f"losses differ from keep-all's at its largest batch: {', '.join(unequal)}")
    return 1 if failed or unequal else 0
