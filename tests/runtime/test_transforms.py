"""torch.vmap, forward-mode AD and sparse module state under tba: as exact as without it (helper-32's review).

A batched tensor of ``torch.vmap`` and a dual tensor of forward-mode AD have no storage tba can read: they stay
in memory (``KeepReason.NO_STORAGE``). A layer planned for recomputation runs as it is inside a transform (Note
[Inside an enclosing compiled graph a recomputed layer runs as it is] in ``tba/runtime/_recompute.py``), and so does
one called inside a dual level of forward-mode AD.
"""

from __future__ import annotations

import torch
import torch.autograd.forward_ad as fwAD
from torch import nn
from utils import RecomputeWherePossible

import tba

PLANS = {
    "bare": {},
    "offload": {"policy": "offload"},
    "recompute": {"policy": tba.Plan(("recompute",) * 3, 1 << 20)},
    "offloaded_recompute": {"policy": tba.Plan(("offloaded_recompute",) * 3, 1 << 20)},
}


class Block(nn.Module):
    """``tanh(h @ w + b)`` written out: DeepSpeed's ZeRO-3 tests in the same process replace ``F.linear`` with an
    autograd Function that has no forward-mode derivative."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(16, 16) / 4)
        self.bias = nn.Parameter(torch.zeros(16))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(h @ self.weight + self.bias)


def blocks() -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList(Block() for _ in range(3))


def grads_of(model: nn.ModuleList, loss_of, spill_dir=None, steps: int = 4, **options) -> list[list[torch.Tensor]]:
    """Gradients of ``steps`` steps, each under a fresh context when ``spill_dir`` is given."""
    out = []
    for _ in range(steps):
        model.zero_grad()
        if spill_dir is None:
            loss = loss_of()
        else:
            layers = {} if not options else {"layers": list(model)}
            with tba.offload_activations(spill_dir, min_offload_bytes=0, **layers, **options):
                loss = loss_of()
        loss.backward()
        out.append([p.grad.clone() for p in model.parameters()])
    return out


def assert_same(want: list[list[torch.Tensor]], got: list[list[torch.Tensor]]) -> None:
    assert all(torch.equal(a, b) for step_a, step_b in zip(want, got) for a, b in zip(step_a, step_b))


def test_vmap_over_the_forward(spill_dir):
    model = blocks()
    x = torch.randn(4, 3, 16, generator=torch.Generator().manual_seed(1))

    def forward(xi: torch.Tensor) -> torch.Tensor:
        for block in model:
            xi = xi + block(xi)
        return xi

    def loss_of() -> torch.Tensor:
        return torch.vmap(forward)(x).sum()

    want = grads_of(model, loss_of)
    for options in PLANS.values():
        assert_same(want, grads_of(model, loss_of, spill_dir, **options))


def test_forward_mode_ad_inside_the_context(spill_dir):
    """Note [Under forward-mode AD a recomputed layer runs as it is] in tba/runtime/_recompute.py: a recomputed layer
    called inside a dual level failed in backward with torch's checkpoint error (its recomputation, outside the dual
    level, saved fewer tensors), under a pinned plan and under the adaptive default's plan alike; it now runs as it
    is, and the profiled steps mark it not recomputable."""
    model = blocks()
    x, tangent = torch.randn(8, 16), torch.randn(8, 16)

    def loss_of() -> torch.Tensor:
        with fwAD.dual_level():
            out = fwAD.make_dual(x, tangent)
            for block in model:
                out = block(out)
            primal, derivative = fwAD.unpack_dual(out)
            return primal.sum() + derivative.square().sum()

    want = grads_of(model, loss_of, steps=1)
    for options in ({"policy": "offload"}, {"policy": tba.Plan(("keep",) * 3, 1 << 20)}, PLANS["recompute"],
                    PLANS["offloaded_recompute"]):
        assert_same(want, grads_of(model, loss_of, spill_dir, steps=1, **options))
    policy = RecomputeWherePossible()
    assert_same(want * 3, grads_of(model, loss_of, spill_dir, steps=3, policy=policy, profile_steps=1))
    assert policy.recomputable == [False] * 3


class SparseMask(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        indices = torch.tensor([[0, 1, 2, 5], [3, 4, 1, 0]])
        self.register_buffer("mask", torch.sparse_coo_tensor(indices, torch.ones(4), (8, 8)).coalesce())

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.sparse.mm(self.mask, torch.tanh(self.linear(h)))


def test_a_layer_with_a_sparse_buffer(spill_dir):
    torch.manual_seed(0)
    model = nn.ModuleList(SparseMask() for _ in range(2))
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(2))

    def loss_of() -> torch.Tensor:
        h = x
        for block in model:
            h = block(h) + h
        return h.square().sum()

    want = grads_of(model, loss_of)
    for options in ({}, {"policy": "offload"}, {"policy": tba.Plan(("keep", "offload"), 1 << 20)}):
        assert_same(want, grads_of(model, loss_of, spill_dir, **options))
