"""tools/bench_planner.py: one line per layer count and goal with the seconds and the plan; bad values refused."""

from __future__ import annotations

import pathlib

import pytest
from utils import load_script

TOOLS = pathlib.Path(__file__).resolve().parents[1] / "tools"


@pytest.fixture
def bench():
    return load_script(TOOLS / "bench_planner.py")


def test_prints_seconds_and_plan_per_goal(bench, capsys):
    bench.main(["--layers", "3,24", "--repeat", "2"])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4
    assert lines[0].split()[:4] == ["3", "layers", "default", "(overhead_bound=0.05)"]
    assert "s  refused: memory_budget=" in lines[1] and lines[1].endswith("cannot be met")  # 3 layers cannot fit 30%
    assert lines[3].split()[:3] == ["24", "layers", "memory_budget=0.3x"]
    for line in (lines[0], lines[2], lines[3]):
        seconds, unit, code = line.split()[-6:-3]
        assert float(seconds) >= 0 and unit == "s" and set(code) <= set("KORS")


def test_profile_prints_the_hot_functions(bench, capsys):
    bench.main(["--layers", "2", "--profile"])
    assert "function calls" in capsys.readouterr().out


@pytest.mark.parametrize("argv, match", [
    (["--layers", "0,4"], "layer counts >= 1"),
    (["--layers", "x"], "layer counts >= 1"),
    (["--repeat", "0"], "whole number >= 1"),
])
def test_bad_values_are_refused(bench, argv, match, capsys):
    with pytest.raises(SystemExit):
        bench.main(argv)
    assert match in capsys.readouterr().err
