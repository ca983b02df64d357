"""ROK curve: step time against activation memory for keep, recompute, offload and adaptive.

``python -m tba rok`` runs one model under keep-all, full recompute
(non-reentrant checkpoint on every layer), offload-all (tba), offloaded recompute (every layer
recomputed, its input written by tba), and tba's adaptive policy at
several memory budgets. Each configuration runs in a fresh process (:func:`tba.bench.isolated.run_isolated`),
forked from one server that imported torch once (``tba/bench/_forkserver.py``, as ``capacity`` does), and
reports its median step time over the timed steps and its activation peak over one more step:
peak RSS during that step minus RSS before it, the allocator's cached free memory handed back
first (``tba/_free_memory.py``; without it a caching malloc shows no growth once a step fits in
memory freed by an earlier one), on CPU; ``torch.cuda.max_memory_allocated`` minus what was
allocated before the step (weights, gradients, optimiser state) on CUDA. Budgets are fractions
of keep-all's measured peak unless given in MiB; the adaptive runs profile their first two steps
(not measured) and then follow the plan, which is recorded with each point. A budget is *met*
when the measured peak is at most ``budget x`` :data:`tba.defaults.BUDGET_MET_FACTOR`; a budget
the model cannot meet makes the adaptive run fail at planning, and its point says so (``met`` is
``refused``, with the least the model needs). A keep-all peak under :data:`MIN_KEEP_PEAK_BYTES`
is refused: ratios against it mean nothing. Every configuration runs under the same malloc
(``--allocator``, default ``auto``: the best caching allocator found, see ``tba/allocator.py``),
named in the header and in ``rok.json``.

It writes ``rok.csv``, ``rok.json`` and, with matplotlib installed (``pip install 'tba-offload[plot]'``),
``rok.png``: one marker per strategy, the Pareto front (no other point both faster and smaller)
drawn as a line. ``rok.json`` also says whether some adaptive point dominates full recompute (no
more memory and less time). Python entry point for your own model: :func:`sweep`.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from tba.allocator import CHOICES as ALLOCATORS
from tba.allocator import launch_env
from tba.bench.harness import ModeResult
from tba.bench.isolated import IsolatedRunError, fork_server, run_isolated
from tba.bench.models import PRESETS
from tba.cli import _checks as cli_checks
from tba.cli._progress import Progress
from tba.cli._rok_points import CSV_FIELDS, RokPoint, RokResult, format_points, summarise, write
from tba.defaults import BUDGET_MET_FACTOR, MIB
from tba.errors import TbaConfigError

logger = logging.getLogger("tba")

__all__ = ["CSV_FIELDS", "BaselineTooSmall", "RokPoint", "RokResult", "format_points", "sweep"]

DEFAULT_BUDGET_FRACTIONS = (0.75, 0.5, 0.3, 0.2, 0.1)
BASELINES = (("keep", "keep", None), ("recompute", "recompute", None), ("offload", "tba", {"policy": "offload"}),
             ("offloaded_recompute", "offloaded_recompute", None))
MIN_KEEP_PEAK_BYTES = 4 * MIB
"""Keep-all's measured activation peak below this is refused (resident-set noise is about this size)."""
MEMORY_STEPS = 1
"""Steps measured for the activation peak, after the timed ones (``tba.bench.harness.run_steps``)."""


class BaselineTooSmall(ValueError):
    """Keep-all's activation peak is too small to measure the others against."""


def _decimal(number: float) -> str:
    """``number`` to two decimals without trailing zeros (``12.5``, ``0.1``, ``64``): a budget's label rounded to whole
    percent or MiB made 0.001 and 0.002 of keep-all both 'adaptive 0%'."""
    return f"{number:.2f}".rstrip("0").rstrip(".")


def sweep(make_model: Callable[[], Any] | str | None = None, make_batch: Callable[[], Any] | str | None = None, *,
          preset: str | None = None, budget_fractions: Sequence[float] = DEFAULT_BUDGET_FRACTIONS,
          budgets_bytes: Sequence[int] | None = None, steps: int = 5, warmup: int = 1, directory: str | None = None,
          backend: str = "auto", device: str = "cpu", threads: int | None = None, out_dir: str | None = ".",
          plot: bool = True, progress: bool = True, allocator: str = "auto") -> RokResult:
    """Measure the ROK curve of one model; every configuration in a fresh process (forked from one server).

    Args:
        make_model: Module-level function returning the model (``model(*batch)`` returns the
            loss), or its ``"module:function"`` / ``"file.py:function"`` name. Or give ``preset``.
        make_batch: Module-level function returning the batch (a tuple of arguments).
        preset: A built-in GPT preset (``tiny``, ``demo``, ``small``, ``bench``) instead.
        budget_fractions: Adaptive budgets as fractions of keep-all's measured activation peak.
        budgets_bytes: Adaptive budgets in bytes (replaces ``budget_fractions``).
        steps / warmup: Measured and unmeasured steps per configuration. Defaults 5 and 1.
        directory / backend: Spill directory and I/O backend for tba.
        device: ``"cpu"`` (default) or ``"cuda"``.
        threads: torch intra-op threads in each measured process (None: torch's default). One
            thread gives steadier timings on a machine shared with other work.
        out_dir: Where ``rok.csv``, ``rok.json`` and ``rok.png`` go; None writes nothing.
        plot: Write ``rok.png`` when matplotlib is installed.
        progress: Show a progress line on stderr.
        allocator: The malloc preloaded into every configuration's process alike (an ``--allocator``
            value of :mod:`tba.allocator`; ``"system"`` is the C library's).
    """
    if (preset is None) == (make_model is None) or (make_model is None) != (make_batch is None):
        raise ValueError("give either preset= or both make_model and make_batch")
    if preset is not None and preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(sorted(PRESETS))}")
    check_setup(out_dir, device)
    title = preset or factory_title(make_model)
    model_args: dict[str, Any] = {} if preset else {"model_factory": make_model, "batch_factory": make_batch}
    _, malloc = launch_env(allocator)
    common = dict(steps=steps, warmup=warmup, directory=directory, backend=backend, device=device, threads=threads,
                  allocator=allocator, memory_steps=MEMORY_STEPS, **model_args)
    budget_count = len(budgets_bytes) if budgets_bytes is not None else len(budget_fractions)
    bar = Progress(len(BASELINES) + budget_count, enabled=progress)
    results: list[tuple[str, str, int | None, ModeResult]] = []
    server = fork_server(allocator=allocator)

    def measure(strategy: str, label: str, budget: int | None, mode: str, **options: Any) -> RokResult:
        try:
            results.append((strategy, label, budget, run_isolated(mode, preset, server=server, **options, **common)))
        except IsolatedRunError as err:
            if "TbaConfigError" not in err.reason or "cannot be met" not in err.reason:
                raise
            results.append((strategy, label, budget, err.reason.partition("TbaConfigError: ")[2]))
        if strategy == "keep" and results[0][3].median_peak_bytes < MIN_KEEP_PEAK_BYTES:
            raise BaselineTooSmall(
                f"keep-all's activation peak measured {results[0][3].median_peak_bytes / MIB:.1f} MiB, too small to "
                f"compare against (under {MIN_KEEP_PEAK_BYTES / MIB:.0f} MiB); use a larger --preset or model")
        summary = summarise(results, malloc)
        if out_dir is not None:  # each point is on disk as soon as it is measured
            summary.files = write(summary, out_dir, False, title=title, device=device)
        return summary

    with server:
        for strategy, mode, options in BASELINES:
            bar.update(strategy)
            out = measure(strategy, strategy, None, mode, offload_options=options)
        keep = results[0][3]
        if budgets_bytes is None:
            budgets = [(f"adaptive {_decimal(f * 100)}%", int(f * keep.median_peak_bytes)) for f in budget_fractions]
        else:
            budgets = [(f"adaptive {_decimal(b / MIB)} MiB", int(b)) for b in budgets_bytes]
        for label, budget in budgets:
            bar.update(f"{label} (budget {budget / MIB:.1f} MiB)")
            out = measure("adaptive", label, budget, "adaptive", offload_options={"memory_budget_bytes": budget})
    bar.done()
    if out_dir is not None:
        out.files = write(out, out_dir, plot, title=title, device=device)
    return out


def check_setup(out_dir: str | None, device: str) -> None:
    """Reject, before any measurement, an output path that is not a writable directory and a device
    this torch cannot use. Creates ``out_dir``. Raises ValueError naming the fix."""
    try:
        kind = torch.device(device).type
    except RuntimeError:
        raise ValueError(f"unknown device {device!r}; pass --device cpu or --device cuda") from None
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r} is not supported; pass --device cpu or --device cuda")
    if kind == "cuda" and not torch.cuda.is_available():
        build = "this torch build has no CUDA" if torch.version.cuda is None else "no CUDA device is visible"
        raise ValueError(f"--device {device}: {build} (torch {torch.__version__}); pass --device cpu")
    if out_dir is None:
        return
    cli_checks.output_directory("--out", out_dir)


def factory_title(make_model: Any) -> str:
    return make_model if isinstance(make_model, str) else getattr(make_model, "__qualname__", "model")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None,
                        help="built-in GPT size (default: small, unless --model is given)")
    parser.add_argument("--model", type=cli_checks.factory, metavar="MODULE:FUNC",
                        help="your model factory, e.g. mypkg.train:make_model")
    parser.add_argument("--batch", type=cli_checks.factory, metavar="MODULE:FUNC", help="your batch factory (with --model)")
    parser.add_argument("--steps", type=cli_checks.int_at_least(1), default=5,
                        help="measured steps per configuration (default: 5)")
    parser.add_argument("--warmup", type=cli_checks.int_at_least(0), default=1, help="unmeasured steps first (default: 1)")
    budgets = parser.add_mutually_exclusive_group()  # --budgets-mib replaces --budgets: both is a mistake, not ignored
    budgets.add_argument("--budgets", type=cli_checks.positive_list("--budgets"),
                        default=",".join(map(str, DEFAULT_BUDGET_FRACTIONS)),
                        help="adaptive budgets as fractions of keep-all's peak (default: %(default)s)")
    budgets.add_argument("--budgets-mib", type=cli_checks.positive_list("--budgets-mib"), default=None,
                        help="adaptive budgets in MiB instead, comma-separated")
    parser.add_argument("--directory", type=cli_checks.nonempty_path,
                        default=None, help="spill directory (default: $TBA_DIR or the temp dir); " + cli_checks.MISSING_REFUSED)
    parser.add_argument("--backend", type=cli_checks.backend_name, default="auto", help="tba I/O backend (default: auto)")
    parser.add_argument("--device", type=cli_checks.device_name, default="auto",
                        help="cpu, cuda, or auto (default: cuda when torch sees a GPU, else cpu)")
    parser.add_argument("--threads", type=cli_checks.int_at_least(1), default=None,
                        help="torch threads per measured process (default: torch's; 1 is steadier on a busy machine)")
    parser.add_argument("--allocator", choices=ALLOCATORS, default="auto",
                        help="malloc preloaded into every configuration: auto = best caching allocator found (default), "
                             "system = the C library's (glibc)")
    parser.add_argument("--out", type=cli_checks.nonempty_path,
                        default=".", help="directory for rok.csv, rok.json, rok.png (default: .)")
    parser.add_argument("--no-plot", action="store_true", help="do not write rok.png")
    parser.add_argument("--quiet", action="store_true", help="no progress line")


def run(args: argparse.Namespace) -> int:
    if args.model is not None and args.batch is None:
        cli_checks.usage_error("rok", "--model needs --batch: pass --batch MODULE:FUNC, a function that returns the "
                                      "model's arguments (or drop --model to use a built-in --preset)")
    if args.batch is not None and args.model is None:
        cli_checks.usage_error("rok", "--batch needs --model: pass --model MODULE:FUNC, a function that returns the model")
    preset = args.preset or (None if args.model else "small")
    try:
        launch_env(args.allocator)
    except TbaConfigError as err:
        cli_checks.usage_error("rok", str(err))
    budgets_bytes = [int(float(b) * MIB) for b in args.budgets_mib.split(",")] if args.budgets_mib else None
    try:
        args.directory = cli_checks.spill_directory(args.directory)
        check_setup(args.out, args.device)
    except ValueError as err:
        cli_checks.usage_error("rok", str(err))
    try:
        result = sweep(args.model, args.batch, preset=preset,
                       budget_fractions=[float(b) for b in args.budgets.split(",")], budgets_bytes=budgets_bytes,
                       steps=args.steps, warmup=args.warmup, directory=args.directory, backend=args.backend,
                       device=args.device, threads=args.threads, out_dir=args.out,
                       plot=not args.no_plot, progress=not args.quiet, allocator=args.allocator)
    except BaselineTooSmall as err:
        cli_checks.usage_error("rok", str(err))
    except IsolatedRunError as err:
        logger.debug("%s", err.stderr)
        cli_checks.usage_error("rok", f"the {err.mode} run failed: {err.reason} (partial results, if any, are in "
                                      f"{args.out}; -v shows the whole error)")
    print(f"malloc: {result.allocator}, the same for every configuration")
    print(format_points(result.points))
    print(f"\nadaptive dominates full recompute (no more memory, less time): "
          f"{'yes: ' + ', '.join(result.dominating) if result.dominating else 'no'}")
    budgets = [p for p in result.points if p.budget_bytes is not None]
    print(f"budgets met (peak <= {BUDGET_MET_FACTOR:g} x budget): {sum(p.budget_met == 'yes' for p in budgets)} of "
          f"{len(budgets)}; refused at planning (cannot be met): {sum(bool(p.refused) for p in budgets)}")
    print("wrote " + ", ".join(result.files))
    return 0 if all(p.losses_equal is not False for p in result.points) else 1  # a refused budget compared none
