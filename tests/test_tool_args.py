"""The tools refuse bad values before any work (exit 2, one line, nothing left); tools/bench_shapes.py also runs exact."""

from __future__ import annotations

import pathlib

import pytest
from utils import load_script

TOOLS = pathlib.Path(__file__).resolve().parents[1] / "tools"


def refused(tool: str, argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_:
        load_script(TOOLS / f"{tool}.py").main(argv)
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and lines, lines
    return lines[-1]


@pytest.mark.parametrize("argv, match", [
    (["--steps", "0"], "argument --steps: 0 is too small"),
    (["--steps", "-3"], "argument --steps: -3 is too small"),
    (["--steps", "1", "--backend", "bogus"], "--backend 'bogus' is not usable here; choose all or one of"),
    (["--steps", "1", "--directory", "/nonexistent"], "--directory /nonexistent does not exist"),
    (["--progress-every", "0"], "argument --progress-every: 0 is too small"),
    (["--signal-rate", "nan"], "argument --signal-rate: nan is not a fraction"),  # nan meant no signals, silently
    (["--drop-rate", "2"], "argument --drop-rate: 2 is not a fraction"),
    (["--write-fault-rate", "-0.1"], "argument --write-fault-rate: -0.1 is not a fraction"),
    (["--read-fault-rate", "inf"], "argument --read-fault-rate: inf is not a fraction"),
    (["--read-fault-rate", "often"], "argument --read-fault-rate: 'often' is not a number"),
])
def test_soak_refuses_bad_values(argv, match, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))  # a tba-soak-* folder made by mistake would show here
    assert match in refused("soak", argv, capsys)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv, match", [
    (["--cases", "-1"], "argument --cases: -1 is too small"),
    (["--cases", "0"], "argument --cases: 0 is too small"),
    (["--cases", "1", "--time-budget-s", "-5"], "--time-budget-s must be > 0, got -5.0"),
    (["--cases", "1", "--time-budget-s", "0"], "--time-budget-s must be > 0"),
])
def test_fuzz_refuses_bad_values(argv, match, capsys):
    assert match in refused("fuzz", argv, capsys)


@pytest.mark.parametrize("argv, match", [
    (["--modes", "bogus"], "argument --modes: unknown mode 'bogus'; choose from"),
    (["--steps", "0"], "argument --steps: 0 is too small"),
    (["--warmup", "-1"], "argument --warmup: -1 is too small"),
    (["--json", "/proc/x.json"], "--json /proc/x.json: creating a file in /proc failed"),
    (["--directory", "{tmp}/not/there"], "does not exist; create it"),
])
def test_bench_e2e_refuses_bad_values(argv, match, tmp_path, capsys):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert match in refused("bench_e2e", ["--preset", "tiny", *argv], capsys)
    assert list(tmp_path.iterdir()) == []


def test_bench_shapes_refuses_bad_values(capsys):
    assert "--steps must be at least 1" in refused("bench_shapes", ["--steps", "0"], capsys)


def test_bench_shapes_runs_exact_on_the_tiny_preset(tmp_path, capsys):
    code = load_script(TOOLS / "bench_shapes.py").main(["--preset", "tiny", "--steps", "8", "--directory", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0 and "identical to training without tba: yes" in out, out
    assert out.count("\nstep ") == 8
