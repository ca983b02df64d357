"""``python -m tba gpu-report``: on CPU, one line and exit 2; with --simulate, the whole report on the simulated device."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

from tba.cli import main


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_a_gpu_it_says_so_in_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["gpu-report", "--out", str(tmp_path)])
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert exit_info.value.code == 2 and not captured.out, captured.out
    assert len(err) == 1 and err[0].startswith("python -m tba gpu-report: error: no CUDA GPU") and "--simulate" in err[0]
    assert not (tmp_path / "gpu-report.md").exists()


def test_simulated_report_is_written(tmp_path, spill_dir):
    assert main(["gpu-report", "--simulate", "--out", str(tmp_path), "--skip-rok", "--directory", spill_dir]) == 0
    report = json.loads((tmp_path / "gpu-report.json").read_text())
    assert [row["row"] for row in report["rows"]] == ["keep", "tba staged", "tba kvikio", "adaptive", "recompute",
                                                       "save_on_cpu"]
    assert all("step_s" in row for row in report["rows"]), report["rows"]
    # The adaptive row runs more steps than keep-all (its profiled ones); losses compare over the common steps.
    assert all(row["losses_equal"] for row in report["rows"]), [(r["row"], r["losses"]) for r in report["rows"]]
    assert report["simulator_problems"] == []
    assert report["doctor"]["simulated"] is True
    markdown = (tmp_path / "gpu-report.md").read_text()
    assert "| tba kvikio |" in markdown and "## Megatron" in markdown
    assert "## Host cost per storage" in markdown and report["host_cost"].startswith("skipped")


def test_host_cost_part_runs_bench_hooks_on_cuda_and_keeps_its_output(tmp_path):
    """Without a GPU the part's bench-hooks run is refused: the report carries that exit and its reason."""
    from tba.cli.gpu_report import _host_cost

    if torch.cuda.is_available():
        pytest.skip("checks the refusal without a GPU")
    text = _host_cost(False, str(tmp_path))
    assert text.splitlines()[0] == "exit 2" and "--device cuda needs a CUDA build" in text
    assert "--device cuda needs a CUDA build" in (tmp_path / "host-cost.log").read_text()


def test_a_rok_baseline_too_small_to_measure_is_reported_as_skipped(tmp_path, spill_dir):
    from tba.cli.gpu_report import _rok

    assert _rok("tiny", "cpu", spill_dir, str(tmp_path)).startswith("skipped: keep-all's activation peak measured")


def test_the_megatron_part_runs_the_example_script(monkeypatch):
    """The first H200 report said 'integrations/megatron/pretrain_gpt.py not found': the script lives in examples/."""
    from tba.cli import gpu_report

    ran = []
    monkeypatch.setattr(gpu_report, "_run_text", lambda command, **kwargs: ran.append(command) or "exit 0")
    assert gpu_report._megatron(simulated=False) == "exit 0"
    script = ran[0][1]
    assert pathlib.Path(script).is_file(), script
    assert "--cpu" not in ran[0] and "--tba-offload-activations" in ran[0]


def test_the_report_names_the_command_that_ran_it(tmp_path, spill_dir, monkeypatch):
    """The report's command was 'python -m tba gpu-report' + sys.argv[2:]: `python -m tba -v gpu-report ...` read
    'gpu-report gpu-report ...', a call of main() from a program named that program's arguments, and an --out with a
    space could not be pasted back into a shell."""
    out = tmp_path / "the report"
    monkeypatch.setattr("sys.argv", ["some-program", "--its-own", "arguments"])
    assert main(["-v", "gpu-report", "--simulate", "--out", str(out), "--skip-rok", "--directory", spill_dir]) == 0
    command = f"python -m tba -v gpu-report --simulate --out '{out}' --skip-rok --directory {spill_dir}"
    assert json.loads((out / "gpu-report.json").read_text())["command"] == command
    assert f"Command: `{command}`" in (out / "gpu-report.md").read_text()
