"""The comparison table of bench_e2e and the demo: ratios to keep-all, and the columns of steps by turns."""

from __future__ import annotations

import os
import re

import pytest
from python_runs import LONG_RUN_TIMEOUT_S, run_python

from tba.bench.harness import ModeResult
from tba.cli._report import comparison_rows, format_table

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _result(mode: str, step_s: float, losses: list[float]) -> ModeResult:
    return ModeResult(mode, step_s=[step_s], activation_peak_bytes=[1 << 20], losses=losses)


def test_rows_gain_the_steps_by_turns_where_measured():
    results = [_result("keep", 1.0, [1.0]), _result("tba", 1.3, [1.0]), _result("keep_io", 1.1, [1.0])]
    turns = {"keep": _result("keep", 2.0, [1.0]), "tba": _result("tba", 2.1, [1.5])}
    rows = comparison_rows(results, turns=turns)
    assert rows[1]["step_ratio"] == pytest.approx(1.3) and rows[1]["turns_step_ratio"] == pytest.approx(1.05)
    assert rows[1]["turns_losses_equal"] is False and "turns_step_s" not in rows[2]
    table = format_table(rows).splitlines()
    assert "turns s" in table[0]
    assert " NO " in table[3] and " NO " not in table[2]  # tba: losses differ by turns
    assert table[4].rstrip().endswith("-")  # keep_io was not run by turns
    assert "turns s" not in format_table(comparison_rows(results))


@pytest.mark.slow
def test_bench_e2e_prints_the_turns_and_the_io_baseline(spill_dir):
    done = run_python([os.path.join(ROOT, "tools", "bench_e2e.py"), "--preset", "tiny", "--steps", "1", "--modes",
                       "keep,tba", "--directory", spill_dir, "--backend", "threads"], timeout=LONG_RUN_TIMEOUT_S)
    assert done.returncode == 0, done.stderr
    assert "turns s" in done.stdout and "keep_io" in done.stdout and "x keep_io's" in done.stdout
    # --no-turns and --no-io-baseline: test_bench_e2e_names_the_bare_contexts_plan (one run less here)


@pytest.mark.slow
def test_bench_e2e_names_the_bare_contexts_plan(spill_dir):
    done = run_python([os.path.join(ROOT, "tools", "bench_e2e.py"), "--preset", "tiny", "--steps", "1", "--warmup", "3",
                       "--usage", "bare", "--modes", "keep,tba", "--directory", spill_dir, "--backend", "threads",
                       "--no-turns", "--no-io-baseline"], timeout=LONG_RUN_TIMEOUT_S)
    assert done.returncode == 0, done.stderr
    assert re.search(r"tba's plan: [KORS]+ \(per layer after profiling", done.stdout), done.stdout
    # Two modes (turns run only with two or more) and tba (keep_io runs only beside it): both flags are what remove them.
    assert "turns s" not in done.stdout and "keep_io" not in done.stdout
