"""What the checks around a recomputed layer catch: weights its own forward changes in place (Note [A recomputed
layer that changes its own parameters] in tba/runtime/_first_call.py), a layer frozen between forward and backward,
and two active contexts recomputing the same layers."""

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


@pytest.mark.parametrize("decision", RECOMPUTED)
def test_a_layer_frozen_between_forward_and_backward_raises(spill_dir, decision):
    """Its recomputation would save fewer tensors than its first forward: torch's CheckpointError, which named no
    cause, before this check."""
    torch.manual_seed(0)
    model = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16)) for _ in range(2))
    h = torch.randn(8, 16)
    with tba.offload_activations(spill_dir, layers=list(model), policy=tba.Plan((decision, "keep"), 1 << 20)):
        for layer in model:
            h = h + layer(h)
    model[0].requires_grad_(False)
    with pytest.raises(TbaError, match=r"parameter '0.weight' of a recomputed layer \(Sequential\) was frozen"):
        h.sum().backward()


def test_nested_contexts_recomputing_the_same_layers_say_so(spill_dir):
    model = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
    plan = tba.Plan(("recompute", "recompute"), 1 << 20)
    with tba.offload_activations(spill_dir, layers=list(model), policy=plan):
        with pytest.raises(tba.TbaConfigError, match="recomputed by another tba context that is active"):
            with tba.offload_activations(spill_dir, layers=list(model), policy=plan):
                pass
    assert all("forward" not in vars(layer) for layer in model)
