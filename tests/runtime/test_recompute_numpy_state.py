"""numpy arrays a recomputed layer's forward updates in place and reads: in a public container or tuple, put back for
the recomputation; private, or in a plain object, a :class:`~tba.TbaError` (Notes [Side effects of a recomputed
forward] in ``tba/runtime/_layer_state.py`` and [Private state of a recomputed layer] in
``tba/runtime/_private_state.py``). Also a tensor, or a list, held in a public tuple.

Found by adversarial differential testing: each recomputed from the updated state, silently (the gradients and
the state of training without tba differed; an array has no version counter, tba copied only one held directly in
a public attribute, and it treated a tuple as a plain value, leaving what it holds alone)."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from torch import nn
from utils import pinned_steps

from tba import TbaError


class Counts(nn.Module):
    """Counts its calls in a numpy array, held as ``how`` says, and scales its output by the count."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.how = how
        self.in_dict, self.in_list, self._private = {"n": np.zeros(1)}, [np.zeros(1)], np.zeros(1)
        self.holder = types.SimpleNamespace(n=np.zeros(1))
        self.in_tuple = (np.zeros(1), torch.zeros(1), [])

    def _array(self) -> np.ndarray:
        return {"dict": self.in_dict["n"], "list": self.in_list[0], "private": self._private, "object": self.holder.n,
                "tuple": self.in_tuple[0]}.get(self.how, np.array([len(self.in_tuple[2])], dtype=float))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.how.startswith("tuple"):  # a tensor or a list in a tuple
            tensor, calls = self.in_tuple[1:]
            tensor.add_(1) if self.how == "tuple tensor" else calls.append(1)
            return torch.sin(self.linear(x) * (1.0 + 0.5 * (float(tensor[0]) + len(calls)))) + x
        array = self._array()
        array += 1
        return torch.sin(self.linear(x) * (1.0 + 0.5 * float(array[0]))) + x


def _steps(spill_dir: str, how: str, plan: tuple[str, ...] | None) -> list:
    result, model = pinned_steps(lambda: Counts(how), 8, spill_dir, plan)
    return result + [torch.from_numpy(layer._array().copy()) for layer in model] + [layer.in_tuple[1] for layer in model]


@pytest.mark.parametrize("how", ["dict", "list", "tuple", "tuple tensor", "tuple list"])
@pytest.mark.parametrize("decision", ["recompute", "offloaded_recompute"])
def test_an_array_in_a_public_container_is_put_back_for_the_recomputation(spill_dir, decision, how):
    reference = _steps(spill_dir, how, None)
    result = _steps(spill_dir, how, (decision, decision))
    assert all(torch.equal(a, b) for a, b in zip(reference, result, strict=True))


@pytest.mark.parametrize(("how", "label"), [("private", "Counts._private"), ("object", "Counts.holder.n")])
@pytest.mark.parametrize("decision", ["recompute", "offloaded_recompute"])
def test_a_private_or_nested_array_updated_in_place_raises(spill_dir, decision, how, label):
    with pytest.raises(TbaError, match=label):
        _steps(spill_dir, how, (decision, decision))
