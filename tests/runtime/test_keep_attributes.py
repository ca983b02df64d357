"""A saved tensor carrying Python attributes reaches backward and recomputation with them (Note [A tensor with
attributes stays in memory] in tba/runtime/_keep.py; found by helper-93)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

import tba


class _Scaled(torch.autograd.Function):
    """Saves ``extra`` (not its output, no grad) and reads an attribute of it in backward."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(extra)
        return h * extra

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (extra,) = ctx.saved_tensors
        return grad * extra * getattr(extra, "scale", 1.0), None


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
        k = getattr(extra, "scale", 1.0)  # what a recomputation from a rebuilt extra read as 1.0
        return x + torch.tanh(_Scaled.apply(self.linear(x), extra) * k)


def _train(decision: str | None, directory: str) -> tuple[list[torch.Tensor], dict[str, int]]:
    torch.manual_seed(0)
    blocks = nn.ModuleList(_Block() for _ in range(3))
    plan = None if decision is None else tba.Plan((decision,) * 3, window_bytes=1 << 20)
    offloader = None if plan is None else tba.Offloader(directory, layers=list(blocks), policy=plan, min_offload_bytes=0)
    x = torch.randn(256, 64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    extra = torch.randn(256, 64, generator=torch.Generator().manual_seed(2))
    extra.scale = 3.0
    with offloader if offloader is not None else contextlib.nullcontext():
        h = x
        for block in blocks:
            h = block(h, extra)
        loss = h.square().mean()
    loss.backward()
    kept = {}
    if offloader is not None:
        kept = dict(offloader.stats.kept_by_reason)
        offloader.close()
    return [x.grad, *(p.grad for p in blocks.parameters())], kept


@pytest.mark.parametrize("decision", ["keep", "offload", "recompute", "offloaded_recompute"])
def test_a_saved_tensor_with_attributes_is_used_with_them(tmp_path, decision):
    expected, _ = _train(None, str(tmp_path))
    got, kept = _train(decision, str(tmp_path))
    assert all(torch.equal(a, b) for a, b in zip(expected, got))  # silently different under offload and offloaded_recompute
    if decision in ("offload", "offloaded_recompute"):
        assert kept.get(str(tba.KeepReason.ATTRIBUTES), 0) > 0
