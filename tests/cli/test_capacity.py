"""python -m tba capacity: a tiny end-to-end run (JSON keys, exit status) and its usage errors."""

from __future__ import annotations

import json

import pytest
import torch
from python_runs import run_python

import tba
from tba.cli import _capacity_run, main
from tba.cli._capacity_report import StrategyResult, format_table, plot_png, summary
from tba.cli._capacity_search import Point, Search

MIB = 1 << 20
PER_STRATEGY = ("max_batch", "tokens_per_s_at_max", "tokens_per_s_at_keep_max", "status", "points", "fit")


@pytest.mark.slow
def test_tiny_run_writes_the_json_and_exits_0(tmp_path, spill_dir):
    out = tmp_path / "c.json"
    done = run_python(["-m", "tba", "capacity", "--preset", "tiny", "--budget", "1K", "--json", str(out), "--strategies",
                       "keep,offloaded_recompute", "--directory", spill_dir, "--backend", "threads"], timeout=120)
    assert done.returncode == 0, done.stderr
    doc = json.loads(out.read_text())
    assert doc["budget_bytes"] == 1024 and doc["allocator"] and doc["complete"]
    assert list(doc["strategies"]) == ["keep", "offloaded_recompute"]
    for name, entry in doc["strategies"].items():
        assert all(key in entry for key in PER_STRATEGY), name
    assert doc["strategies"]["keep"]["max_batch"] == 0 and doc["keep_max_batch"] == 0  # 1 KiB fits nothing
    assert [p["batch"] for p in doc["strategies"]["keep"]["points"]] == [1]  # over at the first probe: stop
    unavailable = doc["strategies"]["offloaded_recompute"]
    assert unavailable["status"] in ("ok", "failed") and (unavailable["status"] == "ok" or unavailable["error"])
    assert "keep-all" in done.stdout and "offloaded recompute" in done.stdout
    assert "[" in done.stderr and "keep-all: batch 1" in done.stderr  # progress lines


@pytest.mark.parametrize("args, match", [
    (["--budget", "12 apples"], "not a size: '12 apples'"),
    (["--budget", "0"], "--budget must be positive"),
    (["--budget", "1M", "--strategies", "keep,fast"], "unknown strategy 'fast'"),
    (["--budget", "1M", "--seq", "0"], "argument --seq: 0 is too small; pass a whole number >= 1"),
    (["--budget", "1M", "--seq", "x"], "argument --seq: 'x' is not a whole number; pass one >= 1"),
    (["--budget", "1M", "--max-batch", ""], "argument --max-batch: '' is not a whole number; pass one >= 1"),
    (["--budget", "1M", "--directory", "/proc/self/status"], "--directory /proc/self/status is not a directory"),
])
def test_usage_errors_are_one_line_and_exit_2(args, match, capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        main(["capacity", "--json", str(tmp_path / "c.json"), *args])
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(lines) == 1 and match in lines[0], lines
    assert not (tmp_path / "c.json").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a build or machine without CUDA")
def test_cuda_without_cuda_exits_2_before_any_run(capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        main(["capacity", "--budget", "1M", "--device", "cuda", "--json", str(tmp_path / "c.json")])
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(lines) == 1 and "pass --device cpu" in lines[0], lines
    assert list(tmp_path.iterdir()) == []


def test_json_into_a_missing_directory_exits_2(capsys, tmp_path):
    with pytest.raises(SystemExit):
        main(["capacity", "--budget", "1M", "--json", str(tmp_path / "nope" / "c.json")])
    assert "no directory" in capsys.readouterr().err


def _result(name, label, points, max_batch, keep_max=None, error=None):
    search = Search(100, points=points, max_batch=max_batch, confirmed=True, error=error)
    keep_point = next((p for p in points if p.batch == keep_max), None)
    return StrategyResult(name, label, name, search=search, keep_max_point=keep_point,
                          status="failed" if max_batch is None else "ok")


def test_table_summary_and_chart(tmp_path):
    results = [
        _result("keep", "keep-all", [Point(2, 90, 1.0)], 2, keep_max=2),
        _result("recompute", "full recompute", [Point(2, 20, 2.0), Point(8, 90, 8.0)], 8, keep_max=2),
        _result("offload", "offload-all", [Point(2, 10, 1.0), Point(20, 95, 12.0)], 20, keep_max=2),
        _result("offloaded_recompute", "offloaded recompute", [Point(2, error="ValueError: unknown decision")], None,
                error="ValueError: unknown decision"),
    ]
    table = format_table(results, seq_len=10, keep_max=2)
    assert "unavailable: ValueError: unknown decision" in table and "tok/s at b=2" in table
    ratios = summary(results, seq_len=10)
    assert ratios["best_tba_strategy"] == "offload"
    assert ratios["best_tba_max_batch_over_recompute"] == 2.5 and ratios["best_tba_max_batch_over_keep"] == 10
    assert ratios["offload_over_recompute_tokens_per_s_at_keep_max"] == 2.0
    assert results[2].as_dict(10)["tokens_per_s_at_max"] == pytest.approx(20 * 10 / 12.0)
    path = tmp_path / "c.png"
    assert plot_png(results, str(path), seq_len=10, title="t") and path.read_bytes()[:4] == b"\x89PNG"


def test_the_search_reads_the_least_memory_from_an_adaptive_refusal():
    from tba.cli._capacity_run import NEEDS
    from tba.policy import plan

    layer = tba.LayerProfile(forward_s=1.0, saved_bytes=100 * MIB, input_bytes=10 * MIB, backward_s=2.0)
    profile = tba.Profile(layers=(layer,) * 4, write_bytes_per_s=50 * MIB, read_bytes_per_s=100 * MIB,
                          max_storage_bytes=10 * MIB)
    with pytest.raises(tba.TbaConfigError) as refusal:
        plan(profile, memory_budget_bytes=MIB)
    needs = NEEDS.search(f"tba.errors.TbaConfigError: {refusal.value}")
    assert needs and float(needs.group(1)) * MIB > MIB


def _no_run_by_turns(*args, **kwargs):
    from tba.bench.isolated import IsolatedRunError

    raise IsolatedRunError("keep+recompute", "not in this test")


def test_runs_at_keep_alls_batch_take_the_searchs_steps(monkeypatch):
    """Every search run measures ``--steps``; keep-all is not measured again at its largest batch (the
    speeds there come from the run by turns, which fails here: each strategy's own run is shown)."""
    from types import SimpleNamespace

    from tba.cli import _capacity_run as capacity

    calls: list[tuple[str, int, int]] = []

    def fake_run(mode, preset, *, steps, config_overrides, **_):
        batch = config_overrides["batch_size"]
        calls.append((mode, batch, steps))
        peak = (40 if mode == "keep" else 2) * MIB * batch  # keep-all fits 12 samples in 512 MiB
        return SimpleNamespace(footprint_bytes=peak, median_step_s=0.01 * batch, losses=[1.0] * steps)

    monkeypatch.setattr(capacity, "run_isolated", fake_run)
    monkeypatch.setattr(capacity, "run_interleaved_isolated", _no_run_by_turns)
    settings = capacity.Settings(preset="tiny", budget_bytes=512 * MIB, seq_len=8, strategies=("keep", "recompute"))
    results = [StrategyResult(name, label, mode) for name, label, mode in capacity.STRATEGIES[:2]]
    capacity._search_all(settings, results, capacity._Lines(False), None, lambda: None)
    assert results[0].max_batch == 12
    assert {steps for _, _, steps in calls} == {1}
    assert [batch for mode, batch, _ in calls if mode == "keep"].count(12) == 1
    assert all(r.keep_max_point is r.search.point(12) for r in results)
    assert [r.same_loss_at_keep_max for r in results] == [True, True]
    keep_row = results[0].as_dict(8)
    assert keep_row["tokens_per_s_at_max"] == keep_row["tokens_per_s_at_keep_max"]  # one speed for one batch
    assert not keep_row["speeds_in_one_process"]


def test_speeds_at_keep_alls_batch_come_from_one_process_by_turns(monkeypatch):
    """Note [Speeds are compared step by step]: the speed columns and the issue's ratio use the run in
    which every strategy took a step in turn; each strategy's own run stays in the JSON; losses that
    differ from keep-all's in that run are reported; a failed run by turns leaves the own-process speeds."""
    from types import SimpleNamespace

    from tba.bench.isolated import IsolatedRunError
    from tba.cli import _capacity_run as capacity

    def fake_run(mode, preset, *, steps, config_overrides, **_):
        batch = config_overrides["batch_size"]
        peak = (40 if mode == "keep" else 2) * MIB * batch
        return SimpleNamespace(footprint_bytes=peak, median_step_s=0.01 * batch, losses=[1.0] * steps)

    asked = []

    def by_turns(modes, preset, *, config_overrides, rounds, offload_options, **_):
        asked.append((tuple(modes), config_overrides["batch_size"], rounds, offload_options["adaptive"]))
        step_s = {"keep": 0.5, "recompute": 1.0, "tba": 0.8}
        return {mode: SimpleNamespace(median_step_s=step_s[mode], losses=[2.0, 1.5 if mode != "tba" else 1.25])
                for mode in modes}

    monkeypatch.setattr(capacity, "run_isolated", fake_run)
    monkeypatch.setattr(capacity, "run_interleaved_isolated", by_turns)
    settings = capacity.Settings(preset="tiny", budget_bytes=512 * MIB, seq_len=8,
                                 strategies=("keep", "recompute", "offload"))
    results = [StrategyResult(name, label, mode) for name, label, mode in capacity.STRATEGIES[:3]]
    capacity._search_all(settings, results, capacity._Lines(False), None, lambda: None)
    assert asked == [(("keep", "recompute", "tba"), 12, capacity.SPEED_ROUNDS,
                      {"memory_budget_bytes": 512 * MIB, "profile_steps": capacity.ADAPTIVE_PROFILE_STEPS})]
    rows = {r.name: r.as_dict(8) for r in results}
    assert rows["offload"]["tokens_per_s_at_keep_max"] == pytest.approx(12 * 8 / 0.8)
    assert rows["offload"]["tokens_per_s_at_keep_max_own_process"] == pytest.approx(12 * 8 / 0.12)
    assert rows["keep"]["tokens_per_s_at_max"] == rows["keep"]["tokens_per_s_at_keep_max"] == pytest.approx(12 * 8 / 0.5)
    assert all(row["speeds_in_one_process"] for row in rows.values())
    assert summary(results, 8)["offload_over_recompute_tokens_per_s_at_keep_max"] == pytest.approx(1.0 / 0.8)
    assert [r.same_loss_at_keep_max for r in results] == [True, True, False]  # tba's second loss differs
    assert "one step of each in turn" in format_table(results, 8, 12)

    def failing(*args, **kwargs):
        raise IsolatedRunError("keep+recompute+tba", "killed")

    monkeypatch.setattr(capacity, "run_interleaved_isolated", failing)
    results = [StrategyResult(name, label, mode) for name, label, mode in capacity.STRATEGIES[:3]]
    capacity._search_all(settings, results, capacity._Lines(False), None, lambda: None)
    rows = {r.name: r.as_dict(8) for r in results}
    assert rows["offload"]["tokens_per_s_at_keep_max"] == rows["offload"]["tokens_per_s_at_keep_max_own_process"]
    assert not any(row["speeds_in_one_process"] for row in rows.values())
    assert "one step of each in turn" not in format_table(results, 8, 12)


def test_json_rewrites_do_not_collide_or_leave_partial_files(tmp_path, monkeypatch):
    path = str(tmp_path / "capacity.json")
    real_dump = json.dump
    calls = []

    def dump_with_another_run_writing(doc, f, **kwargs):
        # Another capacity run in this directory rewrites the same file while this one is writing it.
        calls.append(doc)
        if len(calls) == 1:
            with monkeypatch.context() as other_process:
                other_process.setattr(_capacity_run.os, "getpid", lambda: 1)
                _capacity_run._write_json(path, {"run": "other"})
        real_dump(doc, f, **kwargs)

    monkeypatch.setattr(_capacity_run.json, "dump", dump_with_another_run_writing)
    _capacity_run._write_json(path, {"run": "this"})
    assert json.loads(open(path).read()) == {"run": "this"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["capacity.json"]

    def interrupted(doc, f, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(_capacity_run.json, "dump", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _capacity_run._write_json(path, {"run": "killed"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["capacity.json"]
    assert json.loads(open(path).read()) == {"run": "this"}


@pytest.mark.parametrize("measured, expected", [
    (("keep", "recompute", "offload"), "best tba strategy: offload-all, largest batch 20 (2.50x full recompute's, "
                                       "10.00x keep-all's)"),
    (("keep", "offload"), "best tba strategy: offload-all, largest batch 20 (10.00x keep-all's)"),
    (("offload",), "best tba strategy: offload-all, largest batch 20"),
])
def test_the_closing_line_names_only_the_strategies_measured(measured, expected):
    from tba.cli.capacity import best_line

    every = {"keep": _result("keep", "keep-all", [Point(2, 90, 1.0)], 2, keep_max=2),
             "recompute": _result("recompute", "full recompute", [Point(8, 90, 8.0)], 8),
             "offload": _result("offload", "offload-all", [Point(20, 95, 12.0)], 20)}
    results = [every[name] for name in measured]
    assert best_line(results, summary(results, seq_len=10)) == expected


@pytest.mark.parametrize("budget, text", [(1, "1 B"), (300 << 10, "300.0 KiB"), (500_000_000, "476.8 MiB"),
                                          (512 * MIB, "512 MiB")])
def test_the_budget_is_named_as_given_whatever_its_size(monkeypatch, budget, text):
    """--budget 1B (or 300K) labelled the adaptive row 'adaptive 0 MiB' and the chart 'capacity within 0 MiB'."""
    import contextlib

    from tba.cli import _capacity_run as capacity

    monkeypatch.setattr(capacity, "fork_server", lambda **_: contextlib.nullcontext())
    monkeypatch.setattr(capacity, "_search_all", lambda *args: None)
    titles = []
    monkeypatch.setattr(capacity, "plot_png", lambda results, path, *, seq_len, title: titles.append(title) or True)
    settings = capacity.Settings(preset="tiny", budget_bytes=budget, seq_len=8, strategies=("keep", "adaptive"))
    results, _ = capacity.measure_capacity(settings, png_path="unused.png", progress=False)
    assert [r.label for r in results][-1] == f"adaptive {text}"
    assert titles[0].startswith(f"capacity within {text}: tiny"), titles
