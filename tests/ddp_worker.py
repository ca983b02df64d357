"""One rank of the DDP test: gradients with tba equal gradients without, in a shared directory.

Run by tests/runtime/test_reliability.py through ``torch.distributed.run`` with two processes (gloo).
Writes ``<out>/rank<N>.json`` with whether this rank's gradients were equal and a checksum.
"""

import sys

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from utils import finish_rank, run_step, steps_equal

import tba
from tba.bench.models import PRESETS, make_batch, make_gpt


def main(directory: str, out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    config = PRESETS["tiny"]
    model = make_gpt(config)
    ddp = DistributedDataParallel(model)
    tokens, targets = make_batch(config, seed=100 + rank)
    forward = lambda m: m(tokens, targets)  # noqa: E731
    reference = run_step(ddp, forward, seed=7)
    offloader = tba.offload_activations(directory, backend="threads", min_offload_bytes=0, layers=model)
    loss, got = run_step(ddp, forward, offloader, seed=7)
    finish_rank(out, {
        "rank": rank,
        "exact": steps_equal(reference, (loss, got)),
        "bytes_written": offloader.stats.bytes_written,
        "grad_checksum": float(sum(g.double().sum() for g in got.values())),
        "loss": float(loss),
    })


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
