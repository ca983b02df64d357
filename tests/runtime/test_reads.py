"""The read half of the storage store (tba/runtime/_reads.py): what backward reads ahead, pass after pass."""

from __future__ import annotations

import torch
from torch import nn

import tba
from tba import _control

WIDTH = 256
BLOCKS = 5


class _Probe(torch.autograd.Function):
    """Identity whose backward records, for the block below it, how many of its storages are in memory or being read."""

    @staticmethod
    def forward(ctx, x, record):
        ctx.record = record
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.record()
        return grad, None


def _probed_steps(tmp_path, step):
    """Run ``step(model_forward, offloader)``; returns, per backward pass, per probe, the storages of the block below
    that were resident or being read when backward reached the probe above it."""
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(BLOCKS)]
    offloader = tba.Offloader(tmp_path, layers=blocks, policy="offload", min_offload_bytes=1,
                              prefetch_budget_bytes=64 << 20)
    seen: list[list[int]] = []

    def record(below: int) -> None:
        _control.settle()
        store = offloader._store
        with store.lock:
            entries = [e for e in store._by_storage.values() if e.layer == below]
            seen[-1].append(sum(e.data is not None or e.read_done is not None for e in entries))

    def forward(x):
        for index, block in enumerate(blocks):
            if index > 1:
                x = _Probe.apply(x, lambda below=index - 2: record(below))
            x = block(x)
        return x.square().sum()

    def new_pass():
        seen.append([])

    try:
        step(forward, offloader, new_pass)
    finally:
        offloader.close()
    return seen


def test_a_retained_graph_is_read_ahead_in_its_second_backward_too(tmp_path):
    """The second backward through a retained graph read nothing ahead (every storage was marked used up by
    the first), and waited for each read in turn: 15 waits in 16 blocks, against none in the first."""
    x = torch.randn(64, WIDTH)

    def step(forward, offloader, new_pass):
        with offloader:
            loss = forward(x)
        offloader.flush()
        for retain in (True, False):
            new_pass()
            loss.backward(retain_graph=retain)

    first, second = _probed_steps(tmp_path, step)
    assert all(first), first
    assert all(second), second


def test_backward_reads_ahead_after_a_gradient_taken_inside_the_block(tmp_path):
    """``torch.autograd.grad`` inside the with block (a gradient norm to log, a penalty) left the window's cursor at the
    bottom and every storage it unpacked marked used up: the backward after the block read nothing ahead."""
    x = torch.randn(64, WIDTH, requires_grad=True)

    def step(forward, offloader, new_pass):
        with offloader:
            loss = forward(x)
            new_pass()
            torch.autograd.grad(loss, [x], retain_graph=True)
        offloader.flush()
        new_pass()
        loss.backward()

    inside, after = _probed_steps(tmp_path, step)
    assert all(inside), inside
    assert all(after), after
