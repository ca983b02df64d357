"""What ``python -m tba capacity`` shows and saves: the table, the JSON document and the bar chart.

Tokens per second are ``batch * seq_len / step_s`` of the measured step at that batch. The JSON
document has ``budget_bytes``, ``allocator`` and, under ``strategies``, one entry per strategy with
``max_batch``, ``tokens_per_s_at_max`` and ``tokens_per_s_at_keep_max`` (None where the strategy
failed or was not measured yet) next to its points and fit. The chart (matplotlib, imported only
when a PNG is asked for) has two panels: the largest batch of each strategy, and its tokens/s at
that batch and at keep-all's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from tba._units import readable_size
from tba.cli._capacity_search import Point, Search
from tba.defaults import MIB

TBA_STRATEGIES = ("offload", "offloaded_recompute", "adaptive")
"""Strategies that use tba (the others are plain PyTorch)."""


@dataclasses.dataclass
class StrategyResult:
    """One strategy's search and the figures derived from it; ``status`` is pending, ok or failed."""

    name: str
    label: str
    mode: str
    search: Search | None = None
    keep_max_point: Point | None = None
    """This strategy's run at keep-all's largest batch, in a process of its own."""
    speed_point: Point | None = None
    """Its steps at keep-all's largest batch taken in turn with every other strategy's, in one process
    (Note [Speeds are compared step by step] in ``tba/bench/interleaved.py``); None when not measured."""
    same_loss_at_keep_max: bool | None = None
    status: str = "pending"

    @property
    def max_batch(self) -> int | None:
        return None if self.search is None else self.search.max_batch

    @property
    def speed_at_keep_max(self) -> Point | None:
        """The point the speeds at keep-all's largest batch come from: the run by turns, else this strategy's own."""
        return self.speed_point if self.speed_point is not None else self.keep_max_point

    def tokens_per_s(self, point: Point | None, seq_len: int) -> float | None:
        if point is None or point.error is not None or not point.step_s:
            return None
        return point.batch * seq_len / point.step_s

    def as_dict(self, seq_len: int) -> dict[str, Any]:
        search = self.search
        at_max = search.point(search.max_batch) if search is not None else None
        speed_at_max = at_max
        again = self.speed_at_keep_max
        if at_max is not None and again is not None and again.error is None and again.batch == at_max.batch:
            speed_at_max = again  # keep-all's largest batch, measured again (by turns, or with more steps)
        fit = search.fit if search is not None else None
        return {
            "label": self.label, "mode": self.mode, "status": self.status,
            "error": search.error if search is not None else None,
            "max_batch": self.max_batch,
            "tokens_at_max": None if not self.max_batch else self.max_batch * seq_len,
            "tokens_per_s_at_max": self.tokens_per_s(speed_at_max, seq_len),
            "tokens_per_s_at_keep_max": self.tokens_per_s(self.speed_at_keep_max, seq_len),
            "tokens_per_s_at_keep_max_own_process": self.tokens_per_s(self.keep_max_point, seq_len),
            "speeds_in_one_process": self.speed_point is not None,
            "peak_bytes_at_max": at_max.peak_bytes if at_max is not None else None,
            "fit": None if fit is None else {"a_bytes": fit[0], "b_bytes_per_sample": fit[1]},
            "predicted_max_batch": search.predicted if search is not None else None,
            "confirmed": search.confirmed if search is not None else False,
            "next_over_batch": search.next_over if search is not None else None,
            "settled": search.settled if search is not None else False,
            "capped": search.capped if search is not None else False,
            "same_loss_at_keep_max": self.same_loss_at_keep_max,
            "points": [] if search is None else [
                {"batch": p.batch, "peak_bytes": p.peak_bytes, "step_s": p.step_s,
                 "tokens_per_s": self.tokens_per_s(p, seq_len), "fits": p.fits(search.budget_bytes), "error": p.error}
                for p in search.points],
        }


def budget_text(nbytes: int) -> str:
    """A budget as the user wrote it where it is whole MiB (``512 MiB``), else readably (``476.8 MiB``, ``1 B``):
    ``--budget 1B`` or ``300K`` was 'adaptive 0 MiB'."""
    return f"{nbytes // MIB} MiB" if nbytes % MIB == 0 else readable_size(nbytes)


def best_tba(results: Sequence[StrategyResult]) -> StrategyResult | None:
    """The tba strategy with the largest batch (the first on a tie), None when none succeeded."""
    done = [r for r in results if r.name in TBA_STRATEGIES and r.max_batch]
    return max(done, key=lambda r: r.max_batch) if done else None


def summary(results: Sequence[StrategyResult], seq_len: int) -> dict[str, Any]:
    """The issue's ratios: best tba batch against full recompute's and keep-all's, offload-all's
    tokens/s at keep-all's batch against full recompute's. None where a side is missing."""
    by_name = {r.name: r for r in results}
    best = best_tba(results)

    def ratio(top: float | None, bottom: float | None) -> float | None:
        return top / bottom if top and bottom else None

    offload, recompute = by_name.get("offload"), by_name.get("recompute")
    return {
        "best_tba_strategy": best.name if best else None,
        "best_tba_max_batch_over_recompute": ratio(best and best.max_batch, recompute and recompute.max_batch),
        "best_tba_max_batch_over_keep": ratio(best and best.max_batch, by_name["keep"].max_batch if "keep" in by_name
                                              else None),
        "offload_over_recompute_tokens_per_s_at_keep_max": ratio(
            offload and offload.tokens_per_s(offload.speed_at_keep_max, seq_len),
            recompute and recompute.tokens_per_s(recompute.speed_at_keep_max, seq_len)),
    }


def _number(value: float | int | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(results: Sequence[StrategyResult], seq_len: int, keep_max: int | None) -> str:
    """One row per strategy; a failed strategy's row gives its reason instead of figures."""
    at_keep = f"tok/s at b={keep_max}" if keep_max else "tok/s at keep max"
    header = (f"{'strategy':<22} {'max batch':>9} {'x keep':>6} {'peak MiB':>9} {'tok/s at max':>12} "
              f"{at_keep:>17} {'confirmed':>11}")
    lines = [header, "-" * len(header)]
    keep_batch = keep_max
    for result in results:
        row = result.as_dict(seq_len)
        if result.status == "failed":
            lines.append(f"{result.label:<22} unavailable: {row['error']}"[:160])
            continue
        peak = row["peak_bytes_at_max"]
        lines.append(
            f"{result.label:<22} {_number(result.max_batch, 'd'):>9} "
            f"{_number(result.max_batch / keep_batch if keep_batch and result.max_batch is not None else None, '.2f'):>6} "
            f"{_number(peak / MIB if peak is not None else None, '.1f'):>9} "
            f"{_number(row['tokens_per_s_at_max'], '.0f'):>12} {_number(row['tokens_per_s_at_keep_max'], '.0f'):>17} "
            f"{result.search.verdict if result.search is not None else 'no':>11}")
    if keep_max and any(r.speed_point is not None for r in results):
        lines.append(f"tok/s at b={keep_max}: every strategy in one process, one step of each in turn, the median of "
                     "its steps (speeds from separate processes would also compare the host's state in each)")
    return "\n".join(lines)


def plot_png(results: Sequence[StrategyResult], path: str, *, seq_len: int, title: str) -> bool:
    """Write the bar chart to ``path``; False when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    labels = [r.label for r in results]
    positions = list(range(len(results)))
    figure, (batches, speed) = plt.subplots(1, 2, figsize=(11, 4.5))
    maxima = [r.max_batch or 0 for r in results]
    batches.bar(positions, maxima, color="tab:blue")
    for x, result, value in zip(positions, results, maxima):
        batches.annotate("n/a" if result.status == "failed" else str(value), (x, value), ha="center",
                         xytext=(0, 3), textcoords="offset points", fontsize=8)
    batches.set_ylabel("largest micro-batch within the budget")
    rows = [r.as_dict(seq_len) for r in results]
    width = 0.4
    speed.bar([x - width / 2 for x in positions], [row["tokens_per_s_at_max"] or 0 for row in rows], width,
              label="at its largest batch", color="tab:green")
    speed.bar([x + width / 2 for x in positions], [row["tokens_per_s_at_keep_max"] or 0 for row in rows], width,
              label="at keep-all's largest batch", color="tab:gray")
    speed.set_ylabel("tokens/s")
    speed.legend(fontsize=8)
    for axes in (batches, speed):
        axes.set_xticks(positions)
        axes.set_xticklabels(labels, rotation=20, ha="right", fontsize=8)
        axes.grid(True, axis="y", alpha=0.3)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True
