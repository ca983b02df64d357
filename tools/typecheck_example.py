"""A user's program written as README.md and docs/api.md show tba's API, for a type checker to read.

tba ships ``tba/py.typed``, so a user's mypy or pyright reads tba's own annotations. This file uses the
documented API the way a training script would, and type-checks clean. From the repository root, with the
Python whose torch tba uses (so that torch's annotations are found too)::

    mypy --check-untyped-defs --follow-imports=silent --python-executable .venv/bin/python tools/typecheck_example.py

``--follow-imports=silent`` reads tba's source as a user's checker reads the installed package: its annotations
are used, errors inside tba are not reported (tba itself is not clean under ``--check-untyped-defs``). Where tba
is installed from a wheel, run it from any other directory without that flag.

It also runs (``python tools/typecheck_example.py``: a few CPU steps of a tiny model in a temporary
directory), so what it type-checks is what works."""

from __future__ import annotations

import os
import tempfile

import torch
from torch import nn

import tba
import tba.checkpoint
from tba.checkpoint import LazyCheckpoint, LazyCheckpointer

WIDTH = 128
"""Features per token of the tiny model."""
LAYER_COUNT = 4
"""Repeated blocks of the tiny model."""
BATCH = 256
"""Rows per step: an activation is 128 KiB, above the default min_offload_bytes."""


def make_model() -> nn.Sequential:
    """A stack of identical blocks, then a head."""
    blocks = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU()) for _ in range(LAYER_COUNT)]
    return nn.Sequential(*blocks, nn.Linear(WIDTH, 1))


@tba.keep_in_memory
def squared_mean(out: torch.Tensor) -> torch.Tensor:
    """The loss; what it saves stays in memory (the decorator, written without parentheses)."""
    return out.square().mean()


def step(model: nn.Sequential, optimizer: torch.optim.Optimizer, offloader: tba.Offloader) -> float:
    """One training step with the forward inside ``offloader``; the head's tensors stay in memory."""
    batch = torch.randn(BATCH, WIDTH)
    with offloader:
        hidden = model[:-1](batch)
        with tba.keep_in_memory():
            out = model[-1](hidden)
        loss = squared_mean(out)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def main(directory: str) -> None:
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    layers: list[nn.Module] = list(model)[:-1]  # the model's block list

    # One-shot contexts: the bare adaptive one, a memory budget as a size string, every block offloaded.
    contexts = [tba.offload_activations(directory, layers=layers), tba.offload_activations(memory_budget="2GiB"),
                tba.offload_activations(directory, policy="offload")]
    for context in contexts:
        with context:
            loss = model(torch.randn(BATCH, WIDTH)).mean()
        loss.backward()
        stats: tba.OffloadStats = context.stats
        print(f"{stats.bytes_written} B written, {stats.tensors_kept} tensors kept {stats.kept_by_reason}")

    # The options as one validated object: sizes are given as strings and held as bytes.
    config = tba.OffloadConfig(directory=directory, memory_budget="2GiB", min_offload_bytes="64KiB",
                               prefetch_budget_bytes=8 << 20, queue_depth=8)
    budget: int | None = config.memory_budget
    minimum: int = config.min_offload_bytes
    print(f"budget {budget} B, storages under {minimum} B stay in memory")

    # A reusable offloader: entered every step, closed at the end.
    offloader = tba.Offloader(layers=layers, config=config)
    for _ in range(3):
        step(model, optimizer, offloader)
    per_step = offloader.reset_stats()
    print(f"written {per_step.bytes_written} B at {per_step.write_gbps:.2f} GB/s, read {per_step.bytes_read} B, "
          f"waited {per_step.unpack_wait_s:.3f} s; backend {offloader.resolved_backend}, plan {offloader.plan}")
    print(per_step.as_dict()["bytes_read"])
    offloader.close()

    # A pinned plan, saved and loaded; a policy object chosen after profiling.
    plan = tba.Plan(decisions=(tba.Placement.OFFLOADED_RECOMPUTE,) * len(layers), window_bytes="8MiB")
    plan_path = os.path.join(directory, "plan.json")
    plan.save(plan_path)
    pinned: tba.Plan = tba.Plan.load(plan_path)
    print(f"plan {pinned.code}, window {pinned.window_bytes} B")
    policies: list[tba.Policy | tba.Plan] = [pinned, tba.OffloadedRecomputeAll(), tba.Adaptive(memory_budget_bytes="2GiB")]
    for policy in policies:
        pinned_offloader = tba.Offloader(directory, layers=layers, policy=policy)
        step(model, optimizer, pinned_offloader)
        pinned_offloader.close()

    # A lazy checkpoint, restored exactly.
    checkpointer = LazyCheckpointer(reserve_bytes=2 << 20)
    checkpointer.guard(optimizer)
    path = os.path.join(directory, "ckpt")
    handle: LazyCheckpoint = checkpointer.save(tba.checkpoint.state_dict(model, optimizer), path,
                                               on_done=lambda done: print("durable:", done.path))
    handle.wait()
    checkpointer.close()
    tba.checkpoint.load(path, model, optimizer)
    tba.shutdown()


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as scratch:
        main(scratch)
