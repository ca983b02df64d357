"""Frozen weights (``requires_grad=False``, a LoRA base) are state, not activations: never written (issue 21, item 8)."""

from __future__ import annotations

import torch
from torch import nn

import tba


class LoraLinear(nn.Module):
    def __init__(self, width: int, rank: int = 4) -> None:
        super().__init__()
        self.base = nn.Linear(width, width)
        self.base.requires_grad_(False)
        self.down = nn.Linear(width, rank, bias=False)
        self.up = nn.Linear(rank, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.base(x) + self.up(self.down(x)))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[LoraLinear(512) for _ in range(4)])


def test_frozen_weights_are_kept_and_gradients_are_exact(spill_dir):
    x = torch.randn(64, 512)
    reference = _model()
    reference(x).pow(2).mean().backward()
    model = _model()
    with tba.offload_activations(spill_dir) as off:
        loss = model(x).pow(2).mean()
    off.flush()
    stats = off.stats
    weight_bytes = 512 * 512 * 4
    assert stats.bytes_written < weight_bytes, f"{stats.bytes_written} bytes written: the frozen weights went to disk"
    assert stats.kept_by_reason.get(tba.KeepReason.PARAMETER.value, 0) >= 4
    loss.backward()
    for (name, got), (_, want) in zip(model.named_parameters(), reference.named_parameters()):
        assert (got.grad is None) == (want.grad is None), name
        if want.grad is not None:
            assert torch.equal(got.grad, want.grad), name


def test_a_frozen_weight_view_is_recognised(spill_dir):
    weight = nn.Parameter(torch.randn(512, 512), requires_grad=False)
    off = tba.Offloader(spill_dir, layers=[])
    assert off.keep_reason(weight.t()) is tba.KeepReason.PARAMETER
    assert off.keep_reason(weight[:, :256]) is tba.KeepReason.PARAMETER
    assert off.keep_reason(torch.randn(512, 512)) is None
