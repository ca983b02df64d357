"""ROK curve: step time against activation memory for keep, recompute, offload and adaptive.

``python -m tba rok`` runs one model under keep-all, full recompute
(non-reentrant checkpoint on every layer), offload-all (tba), offloaded recompute (every layer
recomputed, its input written by tba), and tba's adaptive policy at
several memory budgets. Each configuration runs in a fresh process (:func:`tba.bench.isolated.run_isolated`)
and reports its median step time and activation peak: peak RSS during a step minus RSS before it
on CPU, ``torch.cuda.max_memory_allocated`` minus what was allocated before the step (weights,
gradients, optimiser state) on CUDA. Budgets are fractions of keep-all's measured peak unless
given in MiB; the adaptive runs profile their first two steps (not measured) and then follow the
plan, which is recorded with each point. Every configuration runs under the same malloc
(``--allocator``, default ``auto``: the best caching allocator found, see ``tba/allocator.py``),
named in the header and in ``rok.json``.

It writes ``rok.csv``, ``rok.json`` and, with matplotlib installed (``pip install 'tba-offload[plot]'``),
``rok.png``: one marker per strategy, the Pareto front (no other point both faster and smaller)
drawn as a line. ``rok.json`` also says whether some adaptive point dominates full recompute (no
more memory and less time). Python entry point for your own model: :func:`sweep`.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from tba.allocator import CHOICES as ALLOCATORS
from tba.allocator import launch_env
from tba.bench.harness import ModeResult
from tba.bench.isolated import IsolatedRunError, run_isolated
from tba.bench.models import PRESETS
from tba.cli import _checks as cli_checks
from tba.cli._progress import Progress
from tba.cli._rok_plot import pareto_front, plot_png
from tba.defaults import MIB
from tba.errors import TbaConfigError

logger = logging.getLogger("tba")

DEFAULT_BUDGET_FRACTIONS = (0.75, 0.5, 0.3, 0.2, 0.1)
BASELINES = (("keep", "keep"), ("recompute", "recompute"), ("offload", "tba"), ("offloaded_recompute", "offloaded_recompute"))
CSV_FIELDS = ("strategy", "label", "budget_mib", "step_s", "activation_peak_mib", "step_ratio", "peak_ratio",
              "losses_equal", "pareto", "plan", "window_mib", "predicted_step_s", "predicted_memory_mib")


@dataclasses.dataclass
class RokPoint:
    """One configuration's measurement. Seconds and bytes; ratios are against keep-all."""

    strategy: str
    label: str
    step_s: float
    activation_peak_bytes: int
    step_ratio: float
    peak_ratio: float
    losses_equal: bool
    budget_bytes: int | None = None
    plan: dict[str, Any] | None = None
    pareto: bool = False

    def row(self) -> dict[str, Any]:
        plan = self.plan or {}
        return {
            "strategy": self.strategy, "label": self.label,
            "budget_mib": "" if self.budget_bytes is None else round(self.budget_bytes / MIB, 1),
            "step_s": round(self.step_s, 4), "activation_peak_mib": round(self.activation_peak_bytes / MIB, 1),
            "step_ratio": round(self.step_ratio, 3), "peak_ratio": round(self.peak_ratio, 3),
            "losses_equal": self.losses_equal, "pareto": self.pareto, "plan": plan.get("code", ""),
            "window_mib": round(plan["window_bytes"] / MIB, 1) if plan else "",
            "predicted_step_s": round(plan["predicted_step_s"], 4) if plan else "",
            "predicted_memory_mib": round(plan["predicted_memory_bytes"] / MIB, 1) if plan else "",
        }


@dataclasses.dataclass
class RokResult:
    """All points, whether adaptive dominates full recompute, the files written and the malloc measured under."""

    points: list[RokPoint]
    adaptive_dominates_recompute: bool
    dominating: list[str]
    files: list[str]
    allocator: str = ""


def sweep(make_model: Callable[[], Any] | str | None = None, make_batch: Callable[[], Any] | str | None = None, *,
          preset: str | None = None, budget_fractions: Sequence[float] = DEFAULT_BUDGET_FRACTIONS,
          budgets_bytes: Sequence[int] | None = None, steps: int = 5, warmup: int = 1, directory: str | None = None,
          backend: str = "auto", device: str = "cpu", threads: int | None = None, out_dir: str | None = ".",
          plot: bool = True, progress: bool = True, allocator: str = "auto") -> RokResult:
    """Measure the ROK curve of one model; every configuration in a fresh process.

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
                  allocator=allocator, **model_args)
    budget_count = len(budgets_bytes) if budgets_bytes is not None else len(budget_fractions)
    bar = Progress(len(BASELINES) + budget_count, enabled=progress)
    results: list[tuple[str, str, int | None, ModeResult]] = []

    def measure(strategy: str, label: str, budget: int | None, mode: str, **options: Any) -> RokResult:
        results.append((strategy, label, budget, run_isolated(mode, preset, **options, **common)))
        summary = _summarise(results, malloc)
        if out_dir is not None:  # each point is on disk as soon as it is measured
            summary.files = _write(summary, out_dir, False, title=title, device=device)
        return summary

    for strategy, mode in BASELINES:
        bar.update(strategy)
        out = measure(strategy, strategy, None, mode)
    keep = results[0][3]
    if budgets_bytes is None:
        budgets = [(f"adaptive {f:.0%}", int(f * keep.median_peak_bytes)) for f in budget_fractions]
    else:
        budgets = [(f"adaptive {b / MIB:.0f} MiB", int(b)) for b in budgets_bytes]
    for label, budget in budgets:
        bar.update(f"{label} (budget {budget / MIB:.1f} MiB)")
        out = measure("adaptive", label, budget, "adaptive", offload_options={"memory_budget_bytes": budget})
    bar.done()
    if out_dir is not None:
        out.files = _write(out, out_dir, plot, title=title, device=device)
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
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ValueError(f"--out {out_dir} is a file; pass a directory (it is created if missing)")
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as err:
        raise ValueError(f"cannot create --out {out_dir}: {err.strerror}; pass a writable directory") from None
    if not os.access(out_dir, os.W_OK | os.X_OK):
        raise ValueError(f"--out {out_dir} is not writable; pass a writable directory")


def _summarise(results: list[tuple[str, str, int | None, ModeResult]], malloc: str) -> RokResult:
    """Points, Pareto front and domination over the configurations measured so far (keep first)."""
    keep = results[0][3]
    points = [_point(strategy, label, budget, result, keep) for strategy, label, budget, result in results]
    for point in pareto_front(points):
        point.pareto = True
    recompute = points[1] if len(points) > 1 else None
    dominating = [p.label for p in points if recompute is not None and p.strategy == "adaptive"
                  and p.step_s < recompute.step_s and p.activation_peak_bytes <= recompute.activation_peak_bytes]
    return RokResult(points, bool(dominating), dominating, [], malloc)


def factory_title(make_model: Any) -> str:
    return make_model if isinstance(make_model, str) else getattr(make_model, "__qualname__", "model")


def _point(strategy: str, label: str, budget: int | None, result: ModeResult, keep: ModeResult) -> RokPoint:
    return RokPoint(
        strategy=strategy, label=label, step_s=result.median_step_s,
        activation_peak_bytes=result.median_peak_bytes,
        step_ratio=result.median_step_s / keep.median_step_s,
        peak_ratio=result.median_peak_bytes / keep.median_peak_bytes if keep.median_peak_bytes else float("nan"),
        losses_equal=_same_losses(result.losses, keep.losses), budget_bytes=budget, plan=result.plan,
    )


def _same_losses(losses: list[float], reference: list[float]) -> bool:
    """Step ``i`` has the same seed and weights in every run, so losses compare over the common steps."""
    common = min(len(losses), len(reference))
    return common > 0 and losses[:common] == reference[:common]


def _write(result: RokResult, out_dir: str, plot: bool, *, title: str, device: str) -> list[str]:
    files = [os.path.join(out_dir, "rok.csv"), os.path.join(out_dir, "rok.json")]
    with open(files[0], "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        writer.writeheader()
        writer.writerows(p.row() for p in result.points)
    with open(files[1], "w") as f:
        json.dump({"model": title, "device": device, "allocator": result.allocator,
                   "points": [dataclasses.asdict(p) for p in result.points],
                   "adaptive_dominates_recompute": result.adaptive_dominates_recompute,
                   "dominating": result.dominating}, f, indent=2)
    if plot:
        png = os.path.join(out_dir, "rok.png")
        if plot_png(result.points, png, title=f"ROK curve: {title} on {device}"):
            files.append(png)
        else:
            logger.warning("tba: matplotlib is not installed, so no rok.png; pip install 'tba-offload[plot]' to get it")
    return files


def format_points(points: Sequence[RokPoint]) -> str:
    """The points as an aligned table."""
    header = (f"{'label':<18} {'step s':>7} {'x keep':>6} {'act peak MiB':>12} {'x keep':>6} {'same loss':>9} "
              f"{'pareto':>6} {'plan':>10} {'window MiB':>10}")
    lines = [header, "-" * len(header)]
    for point in points:
        row = point.row()
        lines.append(f"{point.label:<18} {point.step_s:>7.3f} {point.step_ratio:>6.2f} {row['activation_peak_mib']:>12.1f} "
                     f"{point.peak_ratio:>6.2f} {'yes' if point.losses_equal else 'NO':>9} "
                     f"{'*' if point.pareto else '':>6} {row['plan']:>10} {str(row['window_mib']):>10}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None,
                        help="built-in GPT size (default: small, unless --model is given)")
    parser.add_argument("--model", type=cli_checks.factory, metavar="MODULE:FUNC",
                        help="your model factory, e.g. mypkg.train:make_model")
    parser.add_argument("--batch", type=cli_checks.factory, metavar="MODULE:FUNC", help="your batch factory (with --model)")
    parser.add_argument("--steps", type=int, default=5, help="measured steps per configuration (default: 5)")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured steps first (default: 1)")
    parser.add_argument("--budgets", type=cli_checks.positive_list("--budgets"),
                        default=",".join(map(str, DEFAULT_BUDGET_FRACTIONS)),
                        help="adaptive budgets as fractions of keep-all's peak (default: %(default)s)")
    parser.add_argument("--budgets-mib", type=cli_checks.positive_list("--budgets-mib"), default=None,
                        help="adaptive budgets in MiB instead, comma-separated")
    parser.add_argument("--directory", default=None, help="spill directory (default: $TBA_DIR or the temp dir)")
    parser.add_argument("--backend", type=cli_checks.backend_name, default="auto", help="tba I/O backend (default: auto)")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads per measured process (default: torch's; 1 is steadier on a busy machine)")
    parser.add_argument("--allocator", choices=ALLOCATORS, default="auto",
                        help="malloc preloaded into every configuration: auto = best caching allocator found (default), "
                             "system = the C library's (glibc)")
    parser.add_argument("--out", default=".", help="directory for rok.csv, rok.json, rok.png (default: .)")
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
        check_setup(args.out, args.device)
    except ValueError as err:
        cli_checks.usage_error("rok", str(err))
    try:
        result = sweep(args.model, args.batch, preset=preset,
                       budget_fractions=[float(b) for b in args.budgets.split(",")], budgets_bytes=budgets_bytes,
                       steps=args.steps, warmup=args.warmup, directory=args.directory, backend=args.backend,
                       device=args.device, threads=args.threads, out_dir=args.out,
                       plot=not args.no_plot, progress=not args.quiet, allocator=args.allocator)
    except IsolatedRunError as err:
        logger.debug("%s", err.stderr)
        cli_checks.usage_error("rok", f"the {err.mode} run failed: {err.reason} (partial results, if any, are in "
                                      f"{args.out}; -v shows the whole error)")
    print(f"malloc: {result.allocator}, the same for every configuration")
    print(format_points(result.points))
    print(f"\nadaptive dominates full recompute (no more memory, less time): "
          f"{'yes: ' + ', '.join(result.dominating) if result.dominating else 'no'}")
    print("wrote " + ", ".join(result.files))
    return 0 if all(p.losses_equal for p in result.points) else 1
