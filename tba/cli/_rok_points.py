"""ROK points: one measured configuration each, its ratios to keep-all, the table and the files.

A point holds one configuration's median step time and activation peak, their ratios to keep-all,
whether its losses equal keep-all's, its budget and plan (adaptive points) and whether the budget
was met (``budget_met``: measured peak at most ``budget x`` :data:`tba.defaults.BUDGET_MET_FACTOR`,
or ``refused`` when the planner said the model cannot meet it). :func:`summarise` marks the
Pareto front and whether some adaptive point dominates full recompute; :func:`write` writes
``rok.csv``, ``rok.json`` and ``rok.png``; :func:`format_points` is the printed table.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import logging
import math
import os
from collections.abc import Sequence
from typing import Any

from tba.bench.harness import ModeResult
from tba.cli._rok_plot import pareto_front, plot_png
from tba.defaults import BUDGET_MET_FACTOR, MIB

logger = logging.getLogger("tba")

CSV_FIELDS = ("strategy", "label", "budget_mib", "budget_met", "step_s", "activation_peak_mib", "step_ratio",
              "peak_ratio", "losses_equal", "pareto", "plan", "window_mib", "predicted_step_s", "predicted_memory_mib")

@dataclasses.dataclass
class RokPoint:
    """One configuration's measurement. Seconds and bytes; ratios are against keep-all."""

    strategy: str
    label: str
    step_s: float
    activation_peak_bytes: int
    step_ratio: float
    peak_ratio: float
    losses_equal: bool | None
    """Whether the losses matched keep-all's step for step; None for a refused budget, which ran no step."""
    budget_bytes: int | None = None
    plan: dict[str, Any] | None = None
    pareto: bool = False
    refused: str = ""
    """Why the adaptive run refused its budget (the planner's TbaConfigError), else empty."""

    @property
    def budget_met(self) -> str:
        """``yes`` / ``NO`` (measured peak against budget x BUDGET_MET_FACTOR), ``refused``, or empty."""
        if self.budget_bytes is None:
            return ""
        if self.refused:
            return "refused"
        return "yes" if self.activation_peak_bytes <= self.budget_bytes * BUDGET_MET_FACTOR else "NO"

    def row(self) -> dict[str, Any]:
        plan = self.plan or {}
        return {
            "strategy": self.strategy, "label": self.label,
            "budget_mib": "" if self.budget_bytes is None else round(self.budget_bytes / MIB, 1),
            "budget_met": self.budget_met,
            "step_s": round(self.step_s, 4), "activation_peak_mib": round(self.activation_peak_bytes / MIB, 1),
            "step_ratio": round(self.step_ratio, 3), "peak_ratio": round(self.peak_ratio, 3),
            "losses_equal": "" if self.losses_equal is None else self.losses_equal,
            "pareto": self.pareto, "plan": plan.get("code", ""),
            "window_mib": round(plan["window_bytes"] / MIB, 1) if plan else "",
            # A pinned plan (offloaded_recompute's) predicts nothing: its zeros are no prediction.
            "predicted_step_s": round(plan["predicted_step_s"], 4) if plan.get("predicted_step_s") else "",
            "predicted_memory_mib": round(plan["predicted_memory_bytes"] / MIB, 1) if plan.get("predicted_step_s") else "",
        }


@dataclasses.dataclass
class RokResult:
    """All points, whether adaptive dominates full recompute, the files written and the malloc measured under."""

    points: list[RokPoint]
    adaptive_dominates_recompute: bool
    dominating: list[str]
    files: list[str]
    allocator: str = ""


def summarise(results: list[tuple[str, str, int | None, ModeResult]], malloc: str) -> RokResult:
    """Points, Pareto front and domination over the configurations measured so far (keep first)."""
    keep = results[0][3]
    points = [point_of(strategy, label, budget, result, keep) for strategy, label, budget, result in results]
    for point in pareto_front([p for p in points if not p.refused]):
        point.pareto = True
    recompute = points[1] if len(points) > 1 else None
    dominating = [p.label for p in points if recompute is not None and p.strategy == "adaptive"
                  and p.step_s < recompute.step_s and p.activation_peak_bytes <= recompute.activation_peak_bytes]
    return RokResult(points, bool(dominating), dominating, [], malloc)


def point_of(strategy: str, label: str, budget: int | None, result: ModeResult | str, keep: ModeResult) -> RokPoint:
    if isinstance(result, str):  # the planner refused the budget
        return RokPoint(strategy, label, float("nan"), 0, float("nan"), float("nan"), None, budget, refused=result)
    return RokPoint(
        strategy=strategy, label=label, step_s=result.median_step_s,
        activation_peak_bytes=result.median_peak_bytes,
        step_ratio=result.median_step_s / keep.median_step_s,
        peak_ratio=result.median_peak_bytes / keep.median_peak_bytes if keep.median_peak_bytes else float("nan"),
        losses_equal=same_losses(result.losses, keep.losses), budget_bytes=budget, plan=result.plan,
    )


def same_losses(losses: list[float], reference: list[float]) -> bool:
    """Step ``i`` has the same seed and weights in every run, so losses compare over the common steps."""
    common = min(len(losses), len(reference))
    return common > 0 and losses[:common] == reference[:common]


def write(result: RokResult, out_dir: str, plot: bool, *, title: str, device: str) -> list[str]:
    files = [os.path.join(out_dir, "rok.csv"), os.path.join(out_dir, "rok.json")]
    with open(files[0], "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        writer.writeheader()
        writer.writerows(p.row() for p in result.points)
    with open(files[1], "w") as f:
        json.dump({"model": title, "device": device, "allocator": result.allocator,
                   "points": [_finite({**dataclasses.asdict(p), "budget_met": p.budget_met}) for p in result.points],
                   "adaptive_dominates_recompute": result.adaptive_dominates_recompute,
                   "dominating": result.dominating}, f, indent=2)
    if plot:
        png = os.path.join(out_dir, "rok.png")
        if plot_png([p for p in result.points if not p.refused], png, title=f"ROK curve: {title} on {device}"):
            files.append(png)
        else:
            logger.warning("tba: matplotlib is not installed, so no rok.png; pip install 'tba-offload[plot]' to get it")
    return files


def _finite(point: dict[str, Any]) -> dict[str, Any]:
    """``point`` with its NaNs (a refused budget's time and ratios) as None: json.dump writes NaN, which is no
    JSON (jq, JavaScript and most other readers refuse the whole file)."""
    return {key: None if isinstance(value, float) and not math.isfinite(value) else value for key, value in point.items()}


def format_points(points: Sequence[RokPoint]) -> str:
    """The points as an aligned table (the label and plan columns as wide as their longest entry)."""
    label_width = max([18, *(len(point.label) for point in points)])
    plan_width = max([10, *(len(point.row()["plan"]) for point in points)])
    header = (f"{'label':<{label_width}} {'budget MiB':>10} {'met':>7} {'step s':>7} {'x keep':>6} {'act peak MiB':>12} "
              f"{'x keep':>6} {'same loss':>9} {'pareto':>6} {'plan':>{plan_width}} {'window MiB':>10}")
    lines = [header, "-" * len(header)]
    for point in points:
        row = point.row()
        start = f"{point.label:<{label_width}} {str(row['budget_mib']):>10} {point.budget_met:>7}"
        if point.refused:
            lines.append(f"{start} {point.refused}")
            continue
        lines.append(f"{start} {point.step_s:>7.3f} {point.step_ratio:>6.2f} {row['activation_peak_mib']:>12.1f} "
                     f"{point.peak_ratio:>6.2f} {'yes' if point.losses_equal else 'NO':>9} "
                     f"{'*' if point.pareto else '':>6} {row['plan']:>{plan_width}} {str(row['window_mib']):>10}")
    return "\n".join(lines)
