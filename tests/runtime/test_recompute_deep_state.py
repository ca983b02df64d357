"""State nested deeper than one level, or in a plain object with ``__slots__``, under a recomputed layer.

A review found these recomputed silently from the state the first forward left (Note [Nested state
a recomputation is given back] in ``tba/runtime/_private_state.py``): a list or dict inside a plain
object, containers three levels deep, and a ``__slots__`` object. Within the walk's bound they are
put back for the recomputation; beyond it an object is held shallow and put back too (Note [The walk of
nested state] in ``tba/runtime/_nested_state.py``): a list growing past the bound, or a counter in a
dict past it, recomputes exactly.
"""

from __future__ import annotations

import copy
import types

import pytest
import torch
from torch import nn
from utils import pinned_steps

from tba import defaults


class _Config:
    def __init__(self) -> None:
        self.history: list[int] = []
        self.counts = {"n": 0}


class _Slot:
    __slots__ = ("n", "inner")

    def __init__(self) -> None:
        self.n = 0
        self.inner = {"n": 0}


def _nested(depth: int) -> dict:
    """Dicts ``depth`` levels deep (the public attribute's is level 1); the innermost holds ``"calls": []``, one level
    deeper: past the walk's bound for ``depth`` = :data:`~tba.defaults.RECOMPUTE_NESTED_STATE_DEPTH`."""
    inner: dict = {"calls": []}
    for _ in range(depth - 1):
        inner = {"k": inner}
    return inner


def _innermost(value: dict) -> dict:
    while "k" in value:
        value = value["k"]
    return value


class Deep(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)
        self.how = how
        self.namespace = types.SimpleNamespace(history=[], counts={"n": 0})
        self.config = _Config()
        self.deep = {"a": {"b": {"n": 0}}}
        self.slot = _Slot()
        self.cycle = types.SimpleNamespace(calls=[])
        self.cycle.me = self.cycle
        self.far = _nested(defaults.RECOMPUTE_NESTED_STATE_DEPTH) if how.startswith("beyond") else {}
        if how == "beyond, a counter":
            _innermost(self.far)["box"] = {"n": 0}  # one level past the walk's depth, as the list beside it
        self.big = types.SimpleNamespace(rows=list(range(defaults.RECOMPUTE_NESTED_STATE_ITEMS))) if how == "big" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.how == "list in a namespace":
            self.namespace.history.append(1)
            n = len(self.namespace.history)
        elif self.how == "dict in an object":
            self.config.counts["n"] += 1
            n = self.config.counts["n"]
        elif self.how == "three dicts":
            self.deep["a"]["b"]["n"] += 1
            n = self.deep["a"]["b"]["n"]
        elif self.how == "slots":
            self.slot.n += 1
            n = self.slot.n
        elif self.how == "dict in slots":
            self.slot.inner["n"] += 1
            n = self.slot.inner["n"]
        elif self.how == "cycle":
            self.cycle.me.calls.append(1)
            n = len(self.cycle.calls)
        elif self.how == "big":
            self.big.rows.append(1)
            n = len(self.big.rows)
        elif self.how == "beyond, a counter":
            box = _innermost(self.far)["box"]
            box["n"] += 1
            n = box["n"]
        else:
            _innermost(self.far)["calls"].append(1)
            n = len(_innermost(self.far)["calls"])
        return x + torch.sin(self.linear(x) * (1 + 0.5 * n))


def _state(model: nn.Module) -> list:
    return [(layer.namespace.history, layer.namespace.counts, layer.config.history, layer.config.counts, layer.deep,
             layer.slot.n, layer.slot.inner, layer.cycle.calls, _innermost(layer.far), layer.big) for layer in model]


def _steps(spill_dir, how: str, plan: tuple[str, ...] | None, between=None) -> tuple[list[torch.Tensor], list]:
    result, model = pinned_steps(lambda: Deep(how), 16, spill_dir, plan, between=between)
    return result, copy.deepcopy(_state(model))


_CASES = ["list in a namespace", "dict in an object", "three dicts", "slots", "dict in slots", "cycle", "beyond",
          "beyond, a counter", "big"]


@pytest.mark.parametrize("how", _CASES)
@pytest.mark.parametrize("decision", ["recompute", "offloaded_recompute"])
def test_state_nested_deeper_is_put_back_for_the_recomputation(spill_dir, decision, how):
    want, want_state = _steps(spill_dir, how, None)
    got, got_state = _steps(spill_dir, how, (decision,) * 2)
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
    assert got_state == want_state


def _schedule(model: nn.Module) -> None:
    for layer in model:
        layer.config.counts["n"] += 10
        layer.deep["a"]["b"]["n"] += 10


def test_deeper_state_changed_between_forward_and_backward_is_put_back(spill_dir):
    want, want_state = _steps(spill_dir, "three dicts", None, _schedule)
    got, got_state = _steps(spill_dir, "three dicts", ("recompute",) * 2, _schedule)
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
    assert got_state == want_state
