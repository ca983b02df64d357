"""One rank of the DDP test: gradients with tba equal gradients without, in a shared directory.

Run by tests/test_reliability.py through ``torch.distributed.run`` with two processes (gloo).
Writes ``<out>/rank<N>.json`` with whether this rank's gradients were equal and a checksum.
"""

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import tba
from tba.models import PRESETS, make_batch, make_gpt


def step(model, tokens, targets, offloader=None):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(7)
    if offloader is None:
        loss = model(tokens, targets)
    else:
        with offloader:
            loss = model(tokens, targets)
        offloader.flush()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def main(directory: str, out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    config = PRESETS["tiny"]
    model = make_gpt(config)
    ddp = DistributedDataParallel(model)
    tokens, targets = make_batch(config, seed=100 + rank)
    ref_loss, ref = step(ddp, tokens, targets)
    offloader = tba.offload_activations(directory, backend="threads", min_offload_bytes=0, layers=model)
    loss, got = step(ddp, tokens, targets, offloader)
    exact = torch.equal(ref_loss, loss) and all(torch.equal(a, b) for a, b in zip(ref, got))
    result = {
        "rank": rank,
        "exact": exact,
        "bytes_written": offloader.stats.bytes_written,
        "grad_checksum": float(sum(g.double().sum() for g in got)),
        "loss": float(loss),
    }
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
