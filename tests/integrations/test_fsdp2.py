"""tba with FSDP2 (``torch.distributed.fsdp.fully_shard``): two CPU ranks on gloo, one shard per block.

The worker (``fsdp2_worker.py``) runs one step without and one with tba on each rank and compares
the loss and every local gradient shard with ``torch.equal``. It also checks, at every pack, that
no storage of a parameter (the sharded ones or the unsharded ones FSDP2 gathers for a block's
forward) goes to disk, and that such storages were saved at all (so the check had something to
catch). The second case compiles each block (inductor) before sharding it, as torchtitan does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch.distributed as dist
from python_runs import LONG_RUN_TIMEOUT_S

pytest.importorskip("torch.distributed.fsdp")
from torch.distributed import fsdp  # noqa: E402

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available() and hasattr(fsdp, "fully_shard")),
                                reason="needs torch.distributed with gloo and FSDP2 (torch >= 2.6)")

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS_DIR = os.path.dirname(HERE)


@pytest.mark.slow
@pytest.mark.parametrize("flags", [[], ["--compile"]], ids=["eager", "per-block-compile"])
def test_two_rank_fsdp2_is_exact_and_writes_no_parameters(spill_dir, tmp_path, flags):
    out = tmp_path / "out"
    out.mkdir()
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               os.path.join(HERE, "fsdp2_worker.py"), spill_dir, str(out), *flags]
    python_path = os.pathsep.join(filter(None, [TESTS_DIR, os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=python_path)
    result = subprocess.run(command, capture_output=True, text=True, timeout=LONG_RUN_TIMEOUT_S, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert all(r["exact"] for r in ranks), ranks
    assert all(r["layers"] == 2 and r["grads"] > 0 for r in ranks), ranks
    assert all(r["bytes_written"] > 0 and r["bytes_read"] > 0 for r in ranks), ranks
    assert all(r["parameters_saved"] > 0 for r in ranks), "autograd saved no parameter: the check proves nothing"
    assert all(r["parameters_written"] == 0 for r in ranks), ranks
    assert ranks[0]["loss"] != ranks[1]["loss"], "the ranks saw the same batch; the test proves little"
