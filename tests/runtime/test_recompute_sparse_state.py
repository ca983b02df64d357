"""A recomputed layer that holds a sparse tensor as state (a graph's adjacency matrix as a buffer, read or updated by its
forward) is recomputed exactly (Note [Side effects of a recomputed forward] in ``tba/runtime/_layer_state.py``).

Found by an adversarial review (helper-117): the first call's bookkeeping asked the sparse buffer for ``nbytes``, which
torch refuses for a sparse COO tensor, so every pinned plan that recomputed such a layer (and the adaptive default,
once it planned one) failed its forward with torch's ``RuntimeError: nbytes is not defined for sparse tensors``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from utils import pinned_steps

WIDTH = 16


class Graph(nn.Module):
    """Mixes the rows of a batch of 4 through a sparse adjacency buffer, which ``decay`` shrinks in place (read after)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.how = how
        adjacency = torch.tensor([[1.0, 0, 0, 0.5], [0, 1, 0.25, 0], [0, 0, 1, 0], [0.75, 0, 0, 1]])
        self.register_buffer("adjacency", adjacency.to_sparse())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.how == "decay":
            with torch.no_grad():
                self.adjacency.mul_(0.5)
        elif self.how == "rebind":
            self.adjacency = (self.adjacency * 0.5).coalesce()
        return torch.sparse.mm(self.adjacency, torch.tanh(self.linear(x))) + x


@pytest.mark.parametrize("how", ["read", "decay", "rebind"])
@pytest.mark.parametrize("decision", ["recompute", "offloaded_recompute"])
def test_a_sparse_buffer_of_a_recomputed_layer_is_recomputed_exactly(spill_dir, how, decision):
    reference, plain = pinned_steps(lambda: Graph(how), WIDTH, spill_dir, None)
    result, model = pinned_steps(lambda: Graph(how), WIDTH, spill_dir, (decision, "keep"))
    assert all(torch.equal(a, b) for a, b in zip(reference, result, strict=True))
    for ours, theirs in zip(model, plain, strict=True):
        assert torch.equal(ours.adjacency.to_dense(), theirs.adjacency.to_dense())
