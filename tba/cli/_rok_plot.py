"""Pareto front and the ROK picture (matplotlib, optional).

A point is on the Pareto front when no other point is at least as good on both axes (step time
and activation peak) and better on one. The picture puts activation peak (MiB) on x and median
step time (s) on y, one marker per strategy, adaptive points labelled with their plan, and the
front drawn as a dashed line from the smallest to the fastest point.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tba.defaults import MIB

MARKERS = {"keep": ("o", "tab:blue"), "recompute": ("s", "tab:red"), "offload": ("^", "tab:green"),
           "offloaded_recompute": ("v", "tab:orange"), "adaptive": ("D", "tab:purple")}


def pareto_front(points: Sequence[Any]) -> list[Any]:
    """Points not dominated by any other (``step_s`` and ``activation_peak_bytes``), by memory."""
    front = []
    for p in points:
        dominated = any(
            q is not p and q.step_s <= p.step_s and q.activation_peak_bytes <= p.activation_peak_bytes
            and (q.step_s < p.step_s or q.activation_peak_bytes < p.activation_peak_bytes)
            for q in points
        )
        if not dominated:
            front.append(p)
    return sorted(front, key=lambda p: (p.activation_peak_bytes, p.step_s))


def plot_png(points: Sequence[Any], path: str, *, title: str) -> bool:
    """Write the picture to ``path``; False when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    figure, axes = plt.subplots(figsize=(7, 4.5))
    for strategy, (marker, color) in MARKERS.items():
        chosen = [p for p in points if p.strategy == strategy]
        if chosen:
            axes.scatter([p.activation_peak_bytes / MIB for p in chosen], [p.step_s for p in chosen],
                         marker=marker, color=color, s=60, label=strategy, zorder=3)
    for p in points:
        if p.strategy == "adaptive" and p.plan:
            axes.annotate(p.plan.get("code", ""), (p.activation_peak_bytes / MIB, p.step_s), fontsize=7,
                          xytext=(4, 4), textcoords="offset points")
    front = pareto_front(points)
    axes.plot([p.activation_peak_bytes / MIB for p in front], [p.step_s for p in front], "--", color="gray",
              drawstyle="steps-post", label="Pareto front", zorder=2)
    axes.set_xlabel("activation peak (MiB)")
    axes.set_ylabel("median step time (s)")
    axes.set_title(title)
    axes.grid(True, alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True
