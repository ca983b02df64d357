"""Note [A recomputed layer that changes its own parameters] (tba/runtime/_layer_state.py): a layer whose forward
changes its weights in place is recomputed exactly when the change is idempotent, else backward raises."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tba
from tba import TbaError

RECOMPUTED = ("recompute", "offloaded_recompute")


class MaxNorm(nn.Module):
    """Divides its weight by its row norms (times 1.01) before using it: not idempotent."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.linear.weight.div_(self.linear.weight.norm(dim=1, keepdim=True).clamp(min=1.0) * 1.01)
        return h + torch.tanh(self.linear(h))


class Clamped(nn.Module):
    """Clamps its weight in place before using it: a second clamp changes nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.linear.weight.clamp_(-0.5, 0.5)
        return h + torch.tanh(self.linear(h))


def _grads(block: type[nn.Module], directory: str | None, decision: str) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.ModuleList(block() for _ in range(2))
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3)
    h = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    options = {"layers": list(model), "policy": tba.Plan((decision,) * 2, 1 << 20), "min_offload_bytes": 0}
    with tba.offload_activations(directory, **options) if directory else torch.enable_grad():
        for layer in model:
            h = layer(h)
        loss = h.sum()
    loss.backward()
    return [p.grad for p in model.parameters()]


@pytest.mark.parametrize("decision", RECOMPUTED)
def test_a_forward_changing_its_weight_the_same_way_again_is_exact(spill_dir, decision):
    assert all(torch.equal(a, b) for a, b in zip(_grads(Clamped, spill_dir, decision), _grads(Clamped, None, decision)))


@pytest.mark.parametrize("decision", RECOMPUTED)
def test_a_forward_changing_its_weight_another_way_again_raises(spill_dir, decision):
    with pytest.raises(TbaError, match="changes its parameter 'linear.weight' in place"):
        _grads(MaxNorm, spill_dir, decision)
