"""One report for the first person with a GPU: what tba's CUDA path does there, in one command.

``python -m tba gpu-report --out DIR`` writes ``DIR/gpu-report.md`` and ``DIR/gpu-report.json``:

* doctor: CUDA driver, GPUDirect Storage (kvikio), the locked-memory limit that bounds pinned memory;
* the CUDA tests (``tests/device/test_cuda.py``) under ``TORCH_CUDA_SANITIZER=1``, first, since they
  are the cheapest check that decides whether the rest can be trusted (their whole output goes to
  ``DIR/cuda-tests.log``);
* GPT bf16 steps under keep-all, tba staged, tba kvikio, adaptive, recompute and
  ``save_on_cpu(pin_memory=True)``: step time, activation peak, reserved and pinned bytes, ratios to keep-all;
* the host cost per saved storage on the GPU (``bench-hooks --device cuda --thread-cpu --sample-profile``);
* the ROK curve (``python -m tba rok``), Megatron without ``--cpu``, and an nsys trace if nsys exists.

Without CUDA it says so in one line and exits 2. ``--simulate`` runs the same report on the
simulated CUDA device (``tba/device/sim``) with a tiny model, so that this code path is tested in
CI; parts that need a real GPU in another process (the sanitizer tests, Megatron, nsys) are then
reported as skipped, with the reason.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import pathlib
import platform
import resource
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from tba.bench.harness import run_steps
from tba.bench.models import PRESETS, GPTConfig, make_batch, make_gpt
from tba.cli import _checks as cli_checks
from tba.cli._rok_points import same_losses
from tba.device import gds_unavailable_reason, kvikio_unavailable_reason

logger = logging.getLogger("tba")

GPT_1_3B = GPTConfig(vocab_size=50304, seq_len=2048, width=2048, layers=24, heads=16, batch_size=4)
"""The GPT of the report on a GPU: 1.3B parameters, bf16."""
ROWS = ("keep", "tba staged", "tba kvikio", "adaptive", "recompute", "save_on_cpu")
"""Rows of the GPT table, in order."""
SUBPROCESS_TIMEOUT_S = 300
"""Longest the sanitizer tests, Megatron or nsys may run."""
REPO = pathlib.Path(__file__).resolve().parents[2]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=cli_checks.nonempty_path,
                        required=True, help="directory for gpu-report.md and gpu-report.json")
    parser.add_argument("--simulate", action="store_true",
                        help="run on the simulated CUDA device (CPU machines; small sizes)")
    parser.add_argument("--steps", type=cli_checks.int_at_least(1), default=None,
                        help="measured steps per row (default: 3, 1 simulated)")
    parser.add_argument("--directory", type=cli_checks.nonempty_path,
                        default=None, help="spill directory (default: $TBA_DIR or the temp dir); " + cli_checks.MISSING_REFUSED)
    parser.add_argument("--skip-rok", action="store_true", help="leave out the ROK curve")


def _doctor(simulated: bool) -> dict[str, Any]:
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    info: dict[str, Any] = {
        "torch": torch.__version__, "python": platform.python_version(), "simulated": simulated,
        "cuda_runtime": torch.version.cuda, "locked_memory_limit_bytes": soft if soft != resource.RLIM_INFINITY else "unlimited",
        "kvikio": kvikio_unavailable_reason() or "available",
        "gds": gds_unavailable_reason() or "available",
    }
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name()
        info["driver"] = _run_text(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
        info["device_memory_bytes"] = torch.cuda.get_device_properties(0).total_memory
    del hard
    return info


def _run_text(command: list[str], env: dict[str, str] | None = None, cwd: str | None = None,
              log: str | None = None) -> str:
    """The last lines a command printed, or why it could not run; ``log``, if given, gets all of it."""
    if shutil.which(command[0]) is None and not os.path.exists(command[0]):
        return f"{command[0]} not found"
    try:
        done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=cwd, timeout=SUBPROCESS_TIMEOUT_S)
    except subprocess.TimeoutExpired as err:
        if log is not None:
            with open(log, "w") as f:
                f.write(_text(err.stdout) + _text(err.stderr))
        return f"timed out after {SUBPROCESS_TIMEOUT_S} s"
    if log is not None:
        with open(log, "w") as f:
            f.write(done.stdout + done.stderr)
    text = (done.stdout + done.stderr).strip().splitlines()
    return f"exit {done.returncode}: " + " | ".join(text[-3:])


def _cuda_tests(out: str) -> str:
    tests = REPO / "tests" / "device" / "test_cuda.py"
    if not tests.exists():
        return "tests/device/test_cuda.py not found (tba installed without its tests)"
    env = {**os.environ, "TORCH_CUDA_SANITIZER": "1"}
    return _run_text([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", str(tests)], env=env,
                     cwd=str(REPO), log=os.path.join(out, "cuda-tests.log"))


def _text(output: str | bytes | None) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


def _gpt_rows(config: GPTConfig, device: str, steps: int, directory: str | None, fake: Any,
              on_row: Callable[[list[dict[str, Any]]], None] | None = None) -> list[dict[str, Any]]:
    """One row per entry of :data:`ROWS`; a row that raised is reported as skipped, with its error.
    ``on_row(rows)`` runs after each row (the report is rewritten, so a run cut short keeps them)."""
    rows: list[dict[str, Any]] = []
    for row in ROWS:
        mode, backend = {"keep": ("keep", "auto"), "tba staged": ("tba", "threads"), "tba kvikio": ("tba", "kvikio"),
                         "adaptive": ("adaptive", "auto"), "recompute": ("recompute", "auto"),
                         "save_on_cpu": ("save_on_cpu", "auto")}[row]
        if backend == "kvikio" and fake is None and kvikio_unavailable_reason() is not None:
            rows.append({"row": row, "skipped": kvikio_unavailable_reason()})
            continue
        logger.info("gpu-report: %s", row)
        started = time.perf_counter()
        try:
            model = make_gpt(config).to(torch.bfloat16)
            result = run_steps(mode, model, make_batch(config), steps=steps, warmup=1, directory=directory,
                               backend=backend, device=device)  # adaptive: the default goal, as a user types it
        except Exception as err:  # noqa: BLE001 - the report records the failure and goes on to the next row
            logger.exception("gpu-report: %s failed", row)
            rows.append({"row": row, "skipped": f"failed: {type(err).__name__}: {err}"})
            continue
        finally:
            model = None
            if device == "cuda":
                torch.cuda.empty_cache()
        rows.append({"row": row, "step_s": result.median_step_s, "activation_peak_bytes": result.max_peak_bytes,
                     "reserved_bytes": result.reserved_bytes, "pinned_bytes": result.pinned_bytes,
                     "losses": result.losses, "plan": (result.plan or {}).get("code"),
                     "seconds": time.perf_counter() - started})
        if on_row is not None:
            on_row(rows)
    keep = rows[0]
    for row in rows:
        if "step_s" in row and "step_s" in keep:
            row["step_ratio"] = row["step_s"] / keep["step_s"]
            row["peak_ratio"] = row["activation_peak_bytes"] / max(keep["activation_peak_bytes"], 1)
            row["losses_equal"] = same_losses(row["losses"], keep["losses"])
    return rows


def _rok(preset: str, device: str, directory: str | None, out: str) -> str:
    from tba.cli.rok import BaselineTooSmall, format_points, sweep

    try:
        result = sweep(preset=preset, steps=1, warmup=1, directory=directory, device=device, out_dir=out, plot=False,
                       progress=False, budget_fractions=(0.5,))
    except BaselineTooSmall as err:  # the simulated run's tiny GPT: peaks round to 0.0 MiB
        return f"skipped: {err}"
    return format_points(result.points)


def _host_cost(simulated: bool, out: str) -> str:
    """bench-hooks on the GPU with each thread's CPU per storage and sampled stacks (whole output: DIR/host-cost.log)."""
    if simulated:
        return "skipped: the simulated device's host costs are not a GPU's"
    log = os.path.join(out, "host-cost.log")
    status = _run_text([sys.executable, "-m", "tba", "bench-hooks", "--device", "cuda", "--sizes", "64K,1M",
                        "--counts", "400,2000", "--no-disk", "--max-bytes", "256M", "--thread-cpu", "--sample-profile",
                        "--json", os.path.join(out, "host-cost.json")], cwd=str(REPO), log=log)
    if not os.path.exists(log):
        return status
    with open(log) as f:
        printed = f.read().splitlines()
    start = next((i for i, line in enumerate(printed) if line.startswith("device: ")), max(0, len(printed) - 16))
    return "\n".join([status.split(":", 1)[0], *printed[start:start + 16]])


def _megatron(simulated: bool) -> str:
    if simulated:
        return "skipped: Megatron runs in its own process, which the simulated device does not reach"
    script = REPO / "examples" / "megatron" / "pretrain_gpt.py"
    if not script.exists():
        return "examples/megatron/pretrain_gpt.py not found (tba installed without its examples)"
    return _run_text([sys.executable, str(script), "--steps", "3", "--tba-offload-activations"], cwd=str(REPO))


def _nsys(simulated: bool, out: str) -> str:
    if shutil.which("nsys") is None:
        return "nsys not found"
    if simulated:
        return "skipped: no CUDA work to trace on the simulated device"
    code = ("from tba.bench.harness import run_mode; from tba.bench.models import PRESETS; "
            "run_mode('tba', PRESETS['demo'], steps=2, device='cuda')")
    return _run_text(["nsys", "profile", "--force-overwrite", "true", "-o", os.path.join(out, "tba-trace"),
                      sys.executable, "-c", code])


NOT_YET = "(not run: the report stopped before this part)"


def _markdown(report: dict[str, Any]) -> str:
    seconds = report.get("seconds")
    took = f"{seconds:.0f} s" if seconds is not None else "unfinished"
    lines = ["# tba GPU report", "", f"Command: `{report['command']}`, {took}.", "", "## Doctor", ""]
    lines += [f"- {key}: {value}" for key, value in report.get("doctor", {}).items()]
    lines += ["", "## CUDA tests under TORCH_CUDA_SANITIZER=1 (whole output: cuda-tests.log)", "",
              report.get("cuda_tests", NOT_YET), "",
              f"## GPT bf16 ({report.get('model', '')})", "",
              "| row | step s | x keep | activation peak MiB | x keep | reserved MiB | pinned MiB | losses = keep | plan |",
              "|---|---|---|---|---|---|---|---|---|"]
    for row in report.get("rows", []):
        if "skipped" in row:
            lines.append(f"| {row['row']} | skipped: {row['skipped']} | | | | | | | |")
        else:
            lines.append(f"| {row['row']} | {row['step_s']:.4f} | {row.get('step_ratio', float('nan')):.2f} | "
                         f"{row['activation_peak_bytes'] / 2**20:.1f} | {row.get('peak_ratio', float('nan')):.2f} | "
                         f"{row['reserved_bytes'] / 2**20:.1f} | {row['pinned_bytes'] / 2**20:.1f} | "
                         f"{row.get('losses_equal', '')} | {row.get('plan') or ''} |")
    lines += ["", "## Host cost per storage (bench-hooks --device cuda --thread-cpu; host-cost.log)", "", "```",
              report.get("host_cost", NOT_YET), "```"]
    lines += ["", "## ROK curve", "", "```", report.get("rok", NOT_YET), "```", "", "## Megatron (no --cpu)", "",
              report.get("megatron", NOT_YET), "", "## nsys", "", report.get("nsys", NOT_YET), ""]
    return "\n".join(lines)


def _write(report: dict[str, Any], out: str) -> None:
    """(Re)write gpu-report.json and gpu-report.md with what the report holds so far."""
    with open(os.path.join(out, "gpu-report.json"), "w") as f:
        json.dump(report, f, indent=2, default=str)
    with open(os.path.join(out, "gpu-report.md"), "w") as f:
        f.write(_markdown(report))


def run(args: argparse.Namespace) -> int:
    if not args.simulate and not torch.cuda.is_available():
        cli_checks.usage_error("gpu-report", "no CUDA GPU here (torch.cuda.is_available() is False); "
                               "--simulate runs the report on a simulated device")
    try:
        cli_checks.output_directory("--out", args.out)
        directory = cli_checks.spill_directory(args.directory)
    except ValueError as err:
        cli_checks.usage_error("gpu-report", str(err))
    started = time.perf_counter()
    steps = args.steps or (1 if args.simulate else 3)
    report: dict[str, Any] = {"command": "python -m tba " + shlex.join(getattr(args, "argv", ["gpu-report"]))}
    with contextlib.ExitStack() as stack:
        fake = None
        if args.simulate:
            from tba.device.sim import fake_kvikio, simulate

            sim = stack.enter_context(simulate(track_compute=False))
            fake = stack.enter_context(fake_kvikio(sim))
            config, device, preset = PRESETS["tiny"], "cpu", "tiny"
        else:
            config, device, preset = GPT_1_3B, "cuda", "small"
        report["doctor"] = _doctor(args.simulate)
        report["model"] = f"{'simulated, ' if args.simulate else ''}{config}"
        _write(report, args.out)
        report["cuda_tests"] = _cuda_tests(args.out) if not args.simulate else (
            "skipped: the sanitizer tests need a real GPU (tests/device runs the simulated suite in CI)")
        _write(report, args.out)

        def rows_so_far(rows: list[dict[str, Any]]) -> None:
            report["rows"] = rows
            _write(report, args.out)

        report["rows"] = _gpt_rows(config, device, steps, directory, fake, on_row=rows_so_far)
        _write(report, args.out)
        if args.simulate:
            report["simulator_problems"] = sim.problems()
    report["host_cost"] = _host_cost(args.simulate, args.out)
    _write(report, args.out)
    report["rok"] = "skipped (--skip-rok)" if args.skip_rok else _rok(preset, device, directory, args.out)
    _write(report, args.out)
    report["megatron"] = _megatron(args.simulate)
    report["nsys"] = _nsys(args.simulate, args.out)
    report["seconds"] = time.perf_counter() - started
    _write(report, args.out)
    print(f"gpu-report: wrote {os.path.join(args.out, 'gpu-report.md')} and gpu-report.json "
          f"in {report['seconds']:.0f} s")
    return 0
