"""A gradient of a gradient through a layer that runs an in-place op on a slice of a tensor it saves afterwards
(Note [Double backward through an in-place op on a view] in tba/bench/_fuzz_steps.py): kept or offloaded it is
exact; recomputed, the second backward fails loudly in torch's checkpoint, as under ``torch.utils.checkpoint``
alone, and never gives other gradients: a TbaError naming the layer and the fix, torch's error its cause (Note [Torch's
checkpoint errors name the recomputed layer] in tba/runtime/_checkpoint_errors.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import CheckpointError

import tba
from tba import TbaError


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear(x)
        base = h * 1.5
        base[:, :4].sigmoid_()
        return base * torch.tanh(h) + x


def _penalised(directory: str | None, decision: str, last: str | None = None) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block())
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    plan = tba.Plan((decision, last or decision), window_bytes=1 << 20)
    with tba.offload_activations(directory, layers=list(model), policy=plan) if directory else torch.enable_grad():
        loss = model(x).pow(2).mean()
    grads = torch.autograd.grad(loss, list(model.parameters()), create_graph=True)
    (loss + sum(g.pow(2).sum() for g in grads)).backward()
    return [p.grad for p in model.parameters()]


@pytest.mark.parametrize("decision", ["keep", "offload"])
def test_kept_or_offloaded_it_is_exact(spill_dir, decision):
    want, got = _penalised(None, decision), _penalised(spill_dir, decision)
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))


@pytest.mark.parametrize("last", [None, "keep"])
@pytest.mark.parametrize("decision", ["recompute", "offloaded_recompute"])
def test_recomputed_it_fails_loudly(spill_dir, decision, last):
    with pytest.raises(TbaError, match=r"layer \d \(Block\).*a tba.Plan that does not recompute it") as caught:
        _penalised(spill_dir, decision, last)
    assert isinstance(caught.value.__cause__, CheckpointError)
    assert "already unpacked once" in str(caught.value.__cause__)
    if last == "keep":
        assert "layer 0 (Block)" in str(caught.value)
