"""The prepared GPU checks (tools/gpu_check.sh, tools/checkpoint_early_stop.py) parse and, without a GPU,
refuse in one line instead of failing later on the device machine's clock."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest
import torch

TOOLS = pathlib.Path(__file__).resolve().parents[1] / "tools"


def test_the_gpu_check_script_parses():
    assert subprocess.run(["bash", "-n", str(TOOLS / "gpu_check.sh")]).returncode == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_the_checkpoint_repro_refuses_without_cuda():
    done = subprocess.run([sys.executable, str(TOOLS / "checkpoint_early_stop.py"), "history"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout.strip() == "checkpoint_early_stop: needs a CUDA GPU"
    usage = subprocess.run([sys.executable, str(TOOLS / "checkpoint_early_stop.py"), "--help"],
                           capture_output=True, text=True, timeout=120)
    assert usage.returncode == 0 and "--early-stop-off" in usage.stdout
