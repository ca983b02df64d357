"""The figures of bench-hooks' means and of its loops run alone (tba/bench/collector.py): their arithmetic, and
what the processes of their own are given (no timing asserted: the clocks are replaced)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

import tba
from tba.bench import collector, hooks


def test_loop_alone_reports_per_storage_and_step(monkeypatch):
    times = iter([(10.0, 10.0), (0.25, 0.75), (0.5, 0.5), (0.75, 0.25)])
    monkeypatch.setattr(hooks, "one_step", lambda *args: next(times))
    result = collector.loop_alone(4, 1024, None, steps=3, warmups=1)
    # The warm-up (20 s) is left out; every measured step takes one fake second over 4 storages.
    assert result.steps == 3 and not result.with_tba
    assert result.step_us == pytest.approx(1e6 / 4)


def test_loop_alone_holds_outputs_under_tba(tmp_path):
    result = collector.loop_alone(2, 1024, str(tmp_path), steps=1, warmups=0, hold_outputs=True)
    assert result.with_tba and result.step_us > 0 and list(tmp_path.iterdir()) == []


def test_measure_means_every_measured_step(monkeypatch):
    times = iter([(1.0, 2.0), (3.0, 4.0), (5.0, 6.0), (7.0, 8.0), (9.0, 10.0), (11.0, 12.0)])
    monkeypatch.setattr(hooks, "one_step", lambda *args: next(times))
    result = hooks.measure(hooks.HookCase(1024, 2, "/unused", "ram"), warmups=1, repeats=2)
    # Warm-up (base 1/2, tba 3/4) left out; measured: base 5/6 then 9/10, tba 7/8 then 11/12.
    assert result.mean_s == {"base": (7.0, 8.0), "tba": (9.0, 10.0)}
    assert result.mean_extra_us == pytest.approx((1e6, 1e6))
    assert (result.base_forward_s, result.tba_backward_s) == (5.0, 8.0)


class _Done:
    def __init__(self, returncode, stdout, stderr=""):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


def test_measure_alone_passes_the_table_settings_and_this_tba(monkeypatch, tmp_path):
    calls = []
    row = {"with_tba": True, "count": 2, "size_bytes": 1024, "steps": 1, "step_us": 1.0, "collector_us": 0.0,
           "full_collections": 0}

    def run(command, **kwargs):
        calls.append((command, kwargs["env"]))
        return _Done(0, "noise\n" + json.dumps({**row, "with_tba": "--directory" in command}) + "\n")

    monkeypatch.setattr(collector.subprocess, "run", run)
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    results = collector.measure_alone(2, 1024, str(tmp_path), 1, hold_outputs=True, intra_op_threads=3, gc_freeze=True)
    assert [r.with_tba for r in results] == [True, False]
    root = os.path.dirname(os.path.dirname(os.path.abspath(tba.__file__)))
    for command, env in calls:
        assert command[command.index("--intra-op-threads") + 1] == "3"
        assert "--hold-outputs" in command and "--gc-freeze" in command
        assert env["PYTHONPATH"].split(os.pathsep) == [root, "/elsewhere"]


@pytest.mark.parametrize("done", [_Done(1, "", "Traceback ...\nMemoryError"), _Done(0, "", "")])
def test_measure_alone_says_which_loop_failed(monkeypatch, tmp_path, done):
    monkeypatch.setattr(collector.subprocess, "run", lambda command, **kwargs: done)
    with pytest.raises(collector.AloneRunError, match=f"with tba failed \\(exit status {done.returncode};"):
        collector.measure_alone(2, 1024, str(tmp_path), 1)


def test_the_child_runs_with_the_settings(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(tba.__file__))))
    done = subprocess.run([collector.sys.executable, "-m", "tba.bench.collector", "--count", "2", "--size-bytes",
                           "1024", "--steps", "1", "--warmups", "0", "--hold-outputs", "--gc-freeze",
                           "--intra-op-threads", "1", "--directory", str(tmp_path)],
                          capture_output=True, text=True, env=env, check=True)
    assert json.loads(done.stdout)["with_tba"] is True and list(tmp_path.iterdir()) == []
