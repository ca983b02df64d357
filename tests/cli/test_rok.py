"""ROK tool: Pareto front, progress line, files written, a user's model in a fresh process."""

from __future__ import annotations

import csv
import io
import json
import os
import sys
from types import SimpleNamespace

import pytest
import torch
from python_runs import run_python

from tba.bench.harness import ModeResult
from tba.bench.isolated import IsolatedRunError, run_isolated
from tba.cli import build_parser, rok
from tba.cli._progress import Progress
from tba.cli._rok_plot import pareto_front, plot_png
from tba.cli._rok_points import summarise, write
from tba.cli.rok import sweep

FACTORIES = os.path.join(os.path.dirname(__file__), "rok_factories.py")


def point(label, step_s, peak, strategy="adaptive"):
    return SimpleNamespace(label=label, step_s=step_s, activation_peak_bytes=peak, strategy=strategy, plan=None)


def test_pareto_front_exact():
    points = [point("a", 1.0, 100), point("b", 2.0, 50), point("c", 2.0, 60), point("d", 0.5, 200),
              point("e", 3.0, 50), point("f", 1.0, 100)]
    # c is beaten by b; e by b; a and f tie with each other and are both kept.
    assert [p.label for p in pareto_front(points)] == ["b", "a", "f", "d"]


def test_progress_lines_when_not_a_terminal():
    stream = io.StringIO()
    bar = Progress(2, stream=stream)
    bar.update("keep")
    bar.update("recompute")
    bar.done()
    lines = stream.getvalue().splitlines()
    assert [line.split("]")[1].split()[0] for line in lines] == ["0/2", "1/2", "2/2"]
    assert lines[0].endswith("keep") and lines[2].startswith("[" + "#" * 24 + "]")


def test_plot_without_matplotlib_says_so(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert plot_png([point("a", 1.0, 1)], str(tmp_path / "rok.png"), title="t") is False
    assert not (tmp_path / "rok.png").exists()


@pytest.mark.slow
def test_sweep_writes_csv_json_png_and_each_budget_is_met_or_refused(tmp_path, spill_dir):
    result = sweep(f"{FACTORIES}:make_model", f"{FACTORIES}:make_big_batch", budget_fractions=[0.9, 0.001], steps=1,
                   warmup=0, directory=spill_dir, backend="threads", out_dir=str(tmp_path), progress=False)
    assert [p.label for p in result.points] == ["keep", "recompute", "offload", "offloaded_recompute", "adaptive 90%",
                                                 "adaptive 0.1%"]
    assert all(p.losses_equal is not False for p in result.points)  # None: the refused budget ran no step
    keep, adaptive, refused = result.points[0], result.points[4], result.points[5]
    assert keep.activation_peak_bytes >= rok.MIN_KEEP_PEAK_BYTES
    assert adaptive.budget_bytes == int(0.9 * keep.activation_peak_bytes)
    assert adaptive.budget_met in ("yes", "refused", "NO")
    if adaptive.budget_met == "yes":
        assert len(adaptive.plan["code"]) == 3
        assert adaptive.plan["goal"] == f"memory_budget_bytes={adaptive.budget_bytes}"
    assert refused.budget_met == "refused" and "cannot be met: this model needs at least" in refused.refused
    with open(tmp_path / "rok.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["strategy"] for r in rows] == ["keep", "recompute", "offload", "offloaded_recompute", "adaptive", "adaptive"]
    assert rows[3]["plan"] == "SSS"
    assert [r["budget_met"] for r in rows] == ["", "", "", "", adaptive.budget_met, "refused"]
    data = json.loads((tmp_path / "rok.json").read_text())
    assert [p["budget_met"] for p in data["points"][4:]] == [adaptive.budget_met, "refused"]
    assert data["adaptive_dominates_recompute"] == bool(data["dominating"])
    assert sum(p["pareto"] for p in data["points"]) >= 1
    assert (tmp_path / "rok.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = rok.format_points(result.points)
    assert "budget MiB" in table and "refused memory_budget=" in table
    # The contract: a budget is met (peak <= 1.05 x budget) or refused when planning, never exceeded.
    assert adaptive.budget_met in ("yes", "refused"), (adaptive.activation_peak_bytes, adaptive.budget_bytes,
                                                       adaptive.plan)


def test_a_keep_all_baseline_too_small_to_measure_is_refused(tmp_path):
    done = _rok("--preset", "tiny", "--steps", "1", "--warmup", "0", "--out", str(tmp_path), "--quiet")
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert "keep-all's activation peak measured" in lines[0] and "too small" in lines[0]


@pytest.mark.slow
def test_user_model_in_fresh_process(spill_dir):
    spec = {"model_factory": f"{FACTORIES}:make_model", "batch_factory": f"{FACTORIES}:make_batch"}
    keep = run_isolated("keep", None, steps=1, warmup=0, **spec)
    adaptive = run_isolated("adaptive", None, steps=1, warmup=0, directory=spill_dir, backend="threads",
                            offload_options={"overhead_bound": 1.0, "min_offload_bytes": 0}, **spec)
    assert adaptive.losses[:1] == keep.losses
    assert len(adaptive.losses) == 3  # two profiled steps, then one measured
    assert len(adaptive.plan["decisions"]) == 3


def test_bad_arguments():
    with pytest.raises(ValueError, match="either preset= or both"):
        sweep(preset="tiny", make_model="m:f")
    with pytest.raises(ValueError, match="unknown preset"):
        sweep(preset="huge")
    args = build_parser().parse_args(["rok", "--preset", "tiny", "--budgets", "0.5", "--no-plot", "--threads", "1"])
    assert args.preset == "tiny" and args.no_plot and args.threads == 1


def _rok(*args):
    return run_python(["-m", "tba", "rok", *args], timeout=120)


def test_out_pointing_at_a_file_fails_before_any_run(tmp_path):
    (tmp_path / "taken").write_text("")
    done = _rok("--preset", "tiny", "--out", str(tmp_path / "taken"))
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "is a file; pass a directory" in lines[0], done.stderr


@pytest.mark.parametrize("args, match", [
    (["--threads", "0"], "--threads: 0 is too small"),
    (["--budgets", "0.5", "--budgets-mib", "5"], "--budgets-mib: not allowed with argument --budgets"),
    (["--directory", "FILE"], "--directory FILE is not a directory"),
])
def test_bad_threads_or_directory_fail_before_any_run(tmp_path, args, match):
    (tmp_path / "taken").write_text("")
    args = [str(tmp_path / "taken") if a == "FILE" else a for a in args]
    done = _rok("--preset", "tiny", "--out", str(tmp_path / "out"), *args)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert match.replace("FILE", str(tmp_path / "taken")) in lines[0], lines
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]  # nothing left behind


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a build or machine without CUDA")
def test_cuda_without_cuda_fails_before_any_run(tmp_path):
    done = _rok("--preset", "tiny", "--device", "cuda", "--out", str(tmp_path))
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "pass --device cpu" in lines[0], done.stderr
    assert list(tmp_path.iterdir()) == []


def test_hf_style_output_is_measured(spill_dir):
    spec = {"model_factory": f"{FACTORIES}:make_hf_style_model", "batch_factory": f"{FACTORIES}:make_batch"}
    assert len(run_isolated("keep", None, steps=1, warmup=0, **spec).losses) == 1


def test_a_model_without_a_loss_fails_at_the_first_run_with_one_line(tmp_path):
    done = _rok("--model", f"{FACTORIES}:make_no_loss_model", "--batch", f"{FACTORIES}:make_batch", "--steps", "1",
                "--warmup", "0", "--out", str(tmp_path), "--quiet")
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert "the keep run failed" in lines[0] and "without a loss tensor" in lines[0]


def test_each_point_is_written_when_measured(tmp_path, monkeypatch):
    def fake_run(mode, preset, **kwargs):
        if mode == "recompute":
            raise IsolatedRunError(mode, "Traceback ...\nRuntimeError: boom\n")
        return ModeResult(mode, [1.0], [100 << 20], [0.5])

    monkeypatch.setattr(rok, "run_isolated", fake_run)
    with pytest.raises(IsolatedRunError, match="boom"):
        sweep(preset="tiny", out_dir=str(tmp_path), progress=False)
    with open(tmp_path / "rok.csv") as f:
        assert [r["strategy"] for r in csv.DictReader(f)] == ["keep"]
    assert [p["label"] for p in json.loads((tmp_path / "rok.json").read_text())["points"]] == ["keep"]


def test_rok_json_is_json_when_a_budget_is_refused(tmp_path):
    # A refused budget has no time: its NaNs were written as NaN, which no strict JSON reader accepts.
    keep = SimpleNamespace(median_step_s=1.0, median_peak_bytes=100 << 20, losses=[1.0], plan=None)
    refusal = "cannot be met: this model needs at least 5 MiB"
    result = summarise([("keep", "keep", None, keep), ("adaptive", "adaptive 1%", 1 << 20, refusal)], "glibc")
    files = write(result, str(tmp_path), False, title="t", device="cpu")

    def not_json(constant):
        raise AssertionError(f"{constant} in rok.json")

    data = json.loads((tmp_path / "rok.json").read_text(), parse_constant=not_json)
    assert files[1] == str(tmp_path / "rok.json")
    assert data["points"][1]["step_s"] is None and data["points"][1]["budget_met"] == "refused"
    assert data["points"][0]["step_ratio"] == 1.0


def test_the_table_stays_aligned_with_long_labels_and_plans():
    """'offloaded_recompute' (19 characters) overflowed the 18-character label column, and a plan of more than 10
    layers its plan column: those rows' figures stood one or more characters right of their headers."""
    plan = {"code": "S" * 24, "window_bytes": 8 << 20, "predicted_step_s": 1.0, "predicted_memory_bytes": 1 << 20}
    results = [(strategy, strategy, None, SimpleNamespace(median_step_s=1.0, median_peak_bytes=100 << 20, losses=[1.0],
                                                          plan=plan if strategy == "offloaded_recompute" else None))
               for strategy in ("keep", "recompute", "offloaded_recompute")]
    results.append(("adaptive", "adaptive 50%", 50 << 20, SimpleNamespace(median_step_s=1.0, median_peak_bytes=50 << 20,
                                                                          losses=[1.0], plan=plan)))
    lines = rok.format_points(summarise(results, "glibc").points).splitlines()
    assert {len(line) for line in lines} == {len(lines[0])}, "\n".join(lines)
    for line in lines[2:]:  # each row's peak ends where its header does
        assert line[:lines[0].index("act peak MiB") + 12].endswith(("100.0", "50.0")), "\n".join(lines)


def test_a_refused_budget_has_no_loss_comparison_and_a_pinned_plan_no_prediction(tmp_path):
    """A refused budget ran no step, yet rok.json and rok.csv said losses_equal True; a pinned plan
    (offloaded_recompute's) predicts nothing, yet the CSV said predicted_step_s 0.0 and predicted_memory_mib 0.0."""
    keep = SimpleNamespace(median_step_s=1.0, median_peak_bytes=100 << 20, losses=[1.0], plan=None)
    pinned = {"code": "SS", "window_bytes": 8 << 20, "goal": "", "predicted_step_s": 0.0, "predicted_memory_bytes": 0}
    offloaded = SimpleNamespace(median_step_s=2.0, median_peak_bytes=30 << 20, losses=[1.0], plan=pinned)
    results = [("keep", "keep", None, keep), ("offloaded_recompute", "offloaded_recompute", None, offloaded),
               ("adaptive", "adaptive 1%", 1 << 20, "cannot be met: this model needs at least 5 MiB")]
    write(summarise(results, "glibc"), str(tmp_path), False, title="t", device="cpu")
    points = json.loads((tmp_path / "rok.json").read_text())["points"]
    assert [p["losses_equal"] for p in points] == [True, True, None]
    with open(tmp_path / "rok.csv") as f:
        rows = list(csv.DictReader(f))
    assert [row["losses_equal"] for row in rows] == ["True", "True", ""]
    assert [(row["predicted_step_s"], row["predicted_memory_mib"]) for row in rows] == [("", "")] * 3


@pytest.mark.parametrize("budgets, labels", [
    ({"budget_fractions": [0.001, 0.002, 0.125, 0.5]}, ["0.1%", "0.2%", "12.5%", "50%"]),
    ({"budgets_bytes": [300 << 10, 3 << 19, 1234 << 20]}, ["0.29 MiB", "1.5 MiB", "1234 MiB"]),
])
def test_each_budget_is_labelled_as_given(monkeypatch, budgets, labels):
    """Labels rounded to whole percent or MiB: budgets 0.001 and 0.002 were both 'adaptive 0%', 12.5% 'adaptive 12%',
    --budgets-mib 0.29 'adaptive 0 MiB'."""
    monkeypatch.setattr(rok, "run_isolated", lambda mode, preset, **kwargs: ModeResult(mode, [1.0], [100 << 20], [0.5]))
    result = sweep(preset="tiny", out_dir=None, progress=False, **budgets)
    assert [p.label for p in result.points[4:]] == [f"adaptive {label}" for label in labels]
