"""One rank of the FSDP2 test: per-block ``fully_shard`` on CPU (gloo), one step without and one with tba.

With ``--compile`` each block is first wrapped in ``torch.compile`` (inductor), then sharded, as
torchtitan does.

Run by tests/compose/test_fsdp2.py through ``torch.distributed.run`` with two processes. Writes
``<out>/rank<N>.json``: whether the loss and every gradient shard were ``torch.equal``, and how many
storages of parameters (sharded or unsharded) tba sent to disk, checked at each pack against the
parameters the model holds at that moment (FSDP2 swaps a block's sharded parameters for
unsharded ones while the block runs).
"""

import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from utils import finish_rank, run_step, steps_equal

import tba
from tba.bench.models import PRESETS, make_batch, make_gpt
from tba.runtime._views import SavedView


class ParameterWatch(tba.Offloader):
    """An offloader that counts the tensors it sends to disk whose storage is a parameter's."""

    def __init__(self, model: torch.nn.Module, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.model = model
        self.parameters_saved = 0
        self.parameters_written = 0

    def pack(self, tensor: torch.Tensor):
        packed = super().pack(tensor)
        storages = set()
        for param in self.model.parameters():
            local = param.to_local() if hasattr(param, "to_local") else param
            storages.add(local.untyped_storage()._cdata)
        is_parameter = tensor.untyped_storage()._cdata in storages
        self.parameters_saved += is_parameter
        self.parameters_written += is_parameter and isinstance(packed, SavedView)
        return packed


def local_grads(grads: dict) -> dict:
    return {name: g.to_local() if hasattr(g, "to_local") else g for name, g in grads.items()}


def main(directory: str, out: str, compile_blocks: bool) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    config = PRESETS["tiny"]
    model = make_gpt(config)
    if compile_blocks:
        for index, block in enumerate(model.blocks):
            model.blocks[index] = torch.compile(block)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    tokens, targets = make_batch(config, seed=100 + rank)
    forward = lambda m: m(tokens, targets)  # noqa: E731
    ref_loss, ref = run_step(model, forward, seed=7)
    reference = (ref_loss, local_grads(ref))
    offloader = ParameterWatch(model, directory, backend="threads", min_offload_bytes=0, layers=model)
    loss, got = run_step(model, forward, offloader, seed=7)
    got = local_grads(got)
    offloader.close()
    finish_rank(out, {
        "rank": rank,
        "exact": steps_equal(reference, (loss, got)),
        "grads": len(got),
        "layers": len(offloader.layers),
        "bytes_written": offloader.stats.bytes_written,
        "bytes_read": offloader.stats.bytes_read,
        "parameters_saved": offloader.parameters_saved,
        "parameters_written": offloader.parameters_written,
        "loss": float(loss),
    })


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], compile_blocks=sys.argv[3:] == ["--compile"])
