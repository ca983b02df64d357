"""A recomputed layer runs under the default dtype its first call ran under (Note [A recomputation runs under
the first call's default dtype] in tba/runtime/_recompute.py): a program that changes ``torch.set_default_dtype``
between forward and backward got other gradients, silently, from a layer creating a tensor of the default dtype."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tba


class Ramp(nn.Module):
    """Scales by a ramp made in the default dtype: linspace in float64 cast to float32 differs from float32's."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x) * torch.linspace(0, 1, 64).to(x.dtype)) + x


def _train(directory, decision: str | None):
    torch.manual_seed(0)
    model = nn.Sequential(Ramp(), Ramp())
    offloader = None if decision is None else tba.Offloader(
        directory, layers=list(model), policy=tba.Plan((decision,) * 2, window_bytes=1 << 20), min_offload_bytes=0)
    losses, grads = [], []
    try:
        for _ in range(2):
            x = torch.randn(8, 64, requires_grad=True)
            model.zero_grad()
            if offloader is None:
                loss = model(x).pow(2).mean()
            else:
                with offloader:
                    loss = model(x).pow(2).mean()
            torch.set_default_dtype(torch.float64)  # the program's, between forward and backward
            try:
                loss.backward()
            finally:
                torch.set_default_dtype(torch.float32)
            losses.append(loss.detach())
            grads += [p.grad.clone() for p in model.parameters()] + [x.grad]
    finally:
        if offloader is not None:
            offloader.close()
    return losses, grads


@pytest.mark.parametrize("decision", ["recompute", "offloaded_recompute"])
def test_a_recomputation_runs_under_the_first_calls_default_dtype(spill_dir, decision):
    assert not torch.equal(torch.linspace(0, 1, 64, dtype=torch.float64).float(), torch.linspace(0, 1, 64))
    want, got = _train(None, None), _train(spill_dir, decision)
    assert all(torch.equal(a, b) for a, b in zip(got[0], want[0]))
    assert all(torch.equal(a, b) for a, b in zip(got[1], want[1])), "gradients differ: recomputed in another dtype"
    assert torch.get_default_dtype() == torch.float32
