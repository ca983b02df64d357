"""A recomputed layer whose forward rebinds state it reads (``self.gate = self.gate * 0.99``) leaves the object it held
before alone: often the user's own tensor or array (Note [A rebound tensor is not written back] in
``tba/runtime/_layer_restore.py``).

Found by an adversarial review (helper-93): loading the state the first call started from wrote the old bytes into
that object, which the copy back after the recomputation no longer covered, so the user's change to their own tensor
between forward and backward (``fill_(7)``) was silently undone under ``recompute`` and ``offloaded_recompute``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from utils import pinned_steps

HOW = ["attribute", "attribute requiring grad", "buffer", "list", "dict", "tuple", "array", "array in a list"]


class Gated(nn.Module):
    """Reads the user's gate, held as ``how`` says, then rebinds it to a decayed copy."""

    def __init__(self, how: str, gate: torch.Tensor | np.ndarray) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.how = how
        if how == "buffer":
            self.register_buffer("gate", gate)
        elif how in ("attribute", "attribute requiring grad", "array"):
            self.gate = gate
        elif how == "dict":
            self.gates = {"gate": gate}
        elif how == "tuple":
            self.pair = (gate, "gate")
        else:
            self.gates = [gate]

    def _gate(self) -> torch.Tensor | np.ndarray:
        return {"dict": lambda: self.gates["gate"], "tuple": lambda: self.pair[0],
                "list": lambda: self.gates[0], "array in a list": lambda: self.gates[0]}.get(self.how, lambda: self.gate)()

    def _rebind(self, value: torch.Tensor | np.ndarray) -> None:
        if self.how == "dict":
            self.gates["gate"] = value
        elif self.how == "tuple":
            self.pair = (value, "gate")
        elif self.how in ("list", "array in a list"):
            self.gates[0] = value
        else:
            self.gate = value

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self._gate()
        read = torch.from_numpy(gate.copy()) if isinstance(gate, np.ndarray) else gate
        self._rebind(gate * 0.99)
        return torch.tanh(self.linear(x) + read) + x


def _train(spill_dir: str, how: str, plan: tuple[str, ...] | None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Losses, gradients (the user's gate's too) and what the layers hold; and the user's gates, changed after forward."""
    mine: list = []
    changed: list[bool] = []

    def make() -> Gated:
        gate = np.ones(8, dtype=np.float32) if how.startswith("array") else torch.ones(8, requires_grad=how.endswith("grad"))
        mine.append(gate)
        return Gated(how, gate)

    def change_mine(model: nn.Module) -> None:  # the user reuses their own objects before the first backward
        if changed:
            return
        changed.append(True)
        for gate in mine:
            if isinstance(gate, np.ndarray):
                gate.fill(7.0)
            else:
                with torch.no_grad():
                    gate.fill_(7.0)

    result, model = pinned_steps(make, 8, spill_dir, plan, between=change_mine)
    as_tensors = [torch.from_numpy(gate) if isinstance(gate, np.ndarray) else gate.detach() for gate in mine]
    grads = [gate.grad for gate in mine if isinstance(gate, torch.Tensor) and gate.requires_grad]
    held = [torch.as_tensor(layer._gate()).detach() for layer in model]
    return result + grads + held, as_tensors


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("decision", ["recompute", "offloaded_recompute"])
def test_the_tensor_a_forward_rebinds_is_not_written_into(spill_dir, decision, how):
    reference, _ = _train(spill_dir, how, None)
    result, mine = _train(spill_dir, how, (decision, "keep"))
    assert all(torch.equal(gate, torch.full_like(gate, 7.0)) for gate in mine), "the user's own object was written into"
    assert all(torch.equal(a, b) for a, b in zip(reference, result, strict=True))
