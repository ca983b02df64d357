"""Plain-text tables comparing strategies against a baseline measured in the same run."""

from __future__ import annotations

from collections.abc import Sequence

from tba.bench.harness import ModeResult
from tba.defaults import MIB


def comparison_rows(results: Sequence[ModeResult], baseline: str = "keep", peak: str = "median",
                    turns: dict[str, ModeResult] | None = None) -> list[dict[str, float | str]]:
    """One dict per result with median step time, activation peak and their ratios to ``baseline``'s.

    ``peak`` is ``"median"`` (median of the measured steps' peaks), ``"max"`` (the worst measured
    step) or ``"footprint"`` (the run's peak over every step, warm-up included, above what the process
    held before its first step: :attr:`ModeResult.footprint_bytes`).

    ``turns``: the same modes' steps taken in turn in one process (``tba/bench/interleaved.py``,
    Note [Speeds are compared step by step]); each row present there gains ``turns_step_s``,
    ``turns_step_ratio`` and ``turns_losses_equal``.
    """
    base = next(r for r in results if r.mode == baseline)

    def peak_of(result: ModeResult) -> int:
        if peak == "footprint":
            return result.footprint_bytes
        return result.max_peak_bytes if peak == "max" else result.median_peak_bytes

    turns = turns or {}
    base_turns = turns.get(baseline)
    rows = []
    for r in results:
        stats = r.offload_stats or {}
        rows.append({
            "mode": r.mode,
            "allocator": r.allocator or "",
            "step_s": r.median_step_s,
            "step_ratio": r.median_step_s / base.median_step_s,
            "activation_peak_mib": peak_of(r) / MIB,
            "peak_ratio": peak_of(r) / peak_of(base) if peak_of(base) else float("nan"),
            "losses_equal": r.losses == base.losses,
            "written_mib": stats.get("bytes_written", 0) / MIB,
            "read_mib": stats.get("bytes_read", 0) / MIB,
            "write_gbps": stats.get("write_gbps", 0.0),
            "read_gbps": stats.get("read_gbps", 0.0),
        })
        by_turns = turns.get(r.mode)
        if by_turns is not None and base_turns is not None:
            rows[-1].update(turns_step_s=by_turns.median_step_s,
                            turns_step_ratio=by_turns.median_step_s / base_turns.median_step_s,
                            turns_losses_equal=by_turns.losses == base_turns.losses)
    return rows


def losses_match(row: dict[str, float | str]) -> bool:
    """Whether a row's losses equal the baseline's step for step, in its own process and by turns."""
    return bool(row["losses_equal"] and row.get("turns_losses_equal", True))


def format_table(rows: Sequence[dict[str, float | str]]) -> str:
    """Rows from :func:`comparison_rows` as an aligned table; with steps by turns, two more columns
    (their median step time and its ratio to the baseline's, in one process)."""
    turns = any("turns_step_s" in row for row in rows)
    header = (f"{'mode':<12} {'malloc':<9} {'step s':>8} {'x keep':>7} {'act peak MiB':>13} {'x keep':>7} "
              f"{'same loss':>9} {'written MiB':>12} {'read MiB':>9} {'write GB/s':>10} {'read GB/s':>9}"
              + (f" {'turns s':>8} {'x keep':>7}" if turns else ""))
    lines = [header, "-" * len(header)]
    for row in rows:
        same = losses_match(row)
        line = (
            f"{row['mode']:<12} {row.get('allocator', ''):<9} {row['step_s']:>8.3f} {row['step_ratio']:>7.2f} "
            f"{row['activation_peak_mib']:>13.1f} "
            f"{row['peak_ratio']:>7.2f} {'yes' if same else 'NO':>9} {row['written_mib']:>12.1f} "
            f"{row['read_mib']:>9.1f} {row['write_gbps']:>10.2f} {row['read_gbps']:>9.2f}"
        )
        if turns:
            line += (f" {row['turns_step_s']:>8.3f} {row['turns_step_ratio']:>7.2f}" if "turns_step_s" in row
                     else f" {'-':>8} {'-':>7}")
        lines.append(line)
    return "\n".join(lines)
