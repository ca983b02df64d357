"""The prepared GPU checks (tools/gpu_check.sh, tools/checkpoint_early_stop.py) parse and, without a GPU,
refuse in one line instead of failing later on the device machine's clock."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest
import torch
from python_runs import run_python

TOOLS = pathlib.Path(__file__).resolve().parents[1] / "tools"


def test_the_gpu_check_script_parses():
    assert subprocess.run(["bash", "-n", str(TOOLS / "gpu_check.sh")]).returncode == 0


@pytest.mark.parametrize("argv, code", [(["--help"], 0), (["-h"], 0), (["--steps", "2"], 2)])
def test_the_gpu_check_script_answers_help_and_refuses_arguments_before_any_work(argv, code, tmp_path):
    """``--help`` ran every check (building the extensions, writing under $OUT and /var/tmp/tba), as did an argument
    it does not take: it prints its header, or refuses in one line, and leaves nothing."""
    out = tmp_path / "out"
    done = subprocess.run(["bash", str(TOOLS / "gpu_check.sh"), *argv], capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "OUT": str(out)}, cwd=tmp_path)
    assert done.returncode == code, done.stdout + done.stderr
    assert not out.exists()
    if code == 0:
        assert "device checks" in done.stdout and "BUDGET_S" in done.stdout and "set -u" not in done.stdout
    else:
        assert done.stderr.strip().splitlines() == ["gpu_check.sh: takes no arguments (got '--steps'); --help says what it runs"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_the_checkpoint_repro_refuses_without_cuda():
    done = run_python([str(TOOLS / "checkpoint_early_stop.py"), "history"], timeout=120)
    assert done.returncode == 2 and done.stdout.strip() == "checkpoint_early_stop: needs a CUDA GPU"
    usage = run_python([str(TOOLS / "checkpoint_early_stop.py"), "--help"], timeout=120)
    assert usage.returncode == 0 and "--early-stop-off" in usage.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_the_block_groups_ab_refuses_without_cuda_and_its_switch_restores():
    done = run_python([str(TOOLS / "ab_block_groups.py")], timeout=120)
    assert done.returncode == 2 and "needs a CUDA device" in done.stderr
    usage = run_python([str(TOOLS / "ab_block_groups.py"), "--help"], timeout=120)
    assert usage.returncode == 0 and "--rounds" in usage.stdout
    sys.path.insert(0, str(TOOLS))
    try:
        import ab_block_groups
    finally:
        sys.path.remove(str(TOOLS))
    from tba.device._block_groups import BlockGroup, WriteJob

    def job(offset):
        return WriteJob(torch.zeros(10, dtype=torch.uint8), 3, offset, None, print, None)

    group = BlockGroup(torch.empty(8192, dtype=torch.uint8), job(0))
    follower = job(4096)
    assert group.takes(follower)
    with ab_block_groups.storages_alone():
        assert not group.takes(follower)
    assert group.takes(follower)
