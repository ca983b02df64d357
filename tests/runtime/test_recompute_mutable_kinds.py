"""State of kinds beyond list, dict, set and deque that a recomputed layer's forward updates and reads: a
``collections.Counter``, a ``bytearray`` and an ``array.array``, held in a public attribute or nested one level deeper
(Note [Side effects of a recomputed forward] in tba/runtime/_layer_state.py, Note [The walk of nested state] in
tba/runtime/_nested_state.py). Each must be recomputed from the state the first call started from, and end as after
training without tba."""

from __future__ import annotations

import array
import collections
import contextlib
import itertools
import types

import pytest
import torch
from torch import nn

import tba

KINDS = {
    "counter": lambda: collections.Counter(),
    "bytearray": lambda: bytearray(1),
    "array": lambda: array.array("q", [0]),
}


def _bump(held) -> int:
    """Count one call in ``held`` and return the count."""
    if isinstance(held, collections.Counter):
        held["calls"] += 1
        return held["calls"]
    held[0] += 1
    return held[0]


class Counts(nn.Module):
    """Counts its calls in ``held`` (a public attribute, or nested in a public dict) and scales by the count."""

    def __init__(self, kind: str, nested: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(32, 32)
        self.nested = nested
        self.held = {"inner": KINDS[kind]()} if nested else KINDS[kind]()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        count = _bump(self.held["inner"] if self.nested else self.held)
        return x + torch.tanh(self.linear(x)) * count


def _train(kind: str, nested: bool, spill_dir: str | None, decision: str | None) -> tuple[list[torch.Tensor], list]:
    torch.manual_seed(0)
    model = nn.ModuleList(Counts(kind, nested) for _ in range(2))
    out = []
    for step in range(3):
        model.zero_grad()
        block = (tba.offload_activations(spill_dir, layers=list(model), policy=tba.Plan((decision, "keep"), 1 << 20),
                                         min_offload_bytes=0) if decision else contextlib.nullcontext())
        with block:
            loss = model[1](model[0](torch.randn(8, 32, generator=torch.Generator().manual_seed(step)))).pow(2).sum()
        loss.backward()
        out += [loss.detach(), *(p.grad.clone() for p in model.parameters())]
    return out, [layer.held for layer in model]


@pytest.mark.parametrize("nested", [False, True], ids=["attribute", "nested"])
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("decision", ["recompute", "offloaded_recompute"])
def test_a_count_kept_in_a_counter_bytearray_or_array_is_recomputed_exactly(spill_dir, decision, kind, nested):
    want, want_held = _train(kind, nested, None, None)
    got, got_held = _train(kind, nested, spill_dir, decision)
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True)), "recomputed from another count"
    assert got_held == want_held, "the program's own object does not end as after training without tba"


PRIVATE = {
    "set": lambda: {0},
    "deque": lambda: collections.deque([0]),
    "bytearray": lambda: bytearray(1),
    "array": lambda: array.array("q", [0]),
}


class CountsPrivately(nn.Module):
    """Counts its calls in a private container, updated in place, and scales by the count."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.linear = nn.Linear(32, 32)
        self._held = PRIVATE[kind]()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        held = self._held
        if isinstance(held, set):
            held.add(len(held))
            count = len(held)
        elif isinstance(held, collections.deque):
            held.append(held[-1] + 1)
            count = held[-1]
        else:
            held[0] += 1
            count = held[0]
        return x + torch.tanh(self.linear(x)) * count


@pytest.mark.parametrize("kind", list(PRIVATE))
@pytest.mark.parametrize("decision", ["recompute", "offloaded_recompute"])
def test_a_private_set_deque_bytearray_or_array_changed_in_forward_raises(spill_dir, decision, kind):
    """Note [Private state of a recomputed layer] in tba/runtime/_private_state.py: the contents of a private dict, list
    or tuple were compared, not those of a private set, deque, bytearray or array.array, which were recomputed from
    their changed contents, silently (under the adaptive default too)."""
    model = nn.ModuleList([CountsPrivately(kind) for _ in range(2)])
    with pytest.raises(tba.TbaError, match=r"changed private state of its modules \(CountsPrivately\._held\["):
        with tba.offload_activations(spill_dir, layers=list(model), policy=tba.Plan((decision,) * 2, 1 << 20)):
            model[1](model[0](torch.randn(8, 32)))


@pytest.mark.parametrize("kind", list(PRIVATE))
def test_the_adaptive_default_never_recomputes_such_a_layer(spill_dir, kind):
    from utils import RecomputeWherePossible

    model, policy = nn.ModuleList([CountsPrivately(kind) for _ in range(2)]), RecomputeWherePossible()
    offloader = tba.Offloader(spill_dir, layers=list(model), policy=policy, profile_steps=1, min_offload_bytes=0)
    for step in range(2):
        with offloader:
            loss = model[1](model[0](torch.randn(8, 32, generator=torch.Generator().manual_seed(step)))).sum()
        loss.backward()
    offloader.close()
    assert policy.recomputable == [False, False]


ITERATORS = {
    "count": lambda: itertools.count(1),
    "generator": lambda: (step for step in itertools.count(1)),
    "iter": lambda: iter(range(1, 1000)),
    "in a list": lambda: [itertools.count(1)],
    "in a config": lambda: types.SimpleNamespace(steps=itertools.count(1)),
}


class Draws(nn.Module):
    """Scales by the next value of an iterator it holds (a schedule)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.linear = nn.Linear(32, 32)
        self.schedule = ITERATORS[kind]()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        held = self.schedule
        step = next(held[0] if isinstance(held, list) else held.steps if isinstance(held, types.SimpleNamespace) else held)
        return x + torch.tanh(self.linear(x)) * step


@pytest.mark.parametrize("kind", list(ITERATORS))
def test_the_adaptive_default_never_recomputes_a_layer_holding_an_iterator(spill_dir, kind):
    """Note [An iterator a layer holds is not put back] in tba/runtime/_layer_state.py: a recomputation drew the next
    value, and the adaptive default planned such layers for recomputation (every planned step's gradients wrong)."""
    from utils import RecomputeWherePossible

    torch.manual_seed(0)
    model, policy = nn.ModuleList([Draws(kind), nn.Sequential(nn.Linear(32, 32), nn.Tanh())]), RecomputeWherePossible()
    offloader = tba.Offloader(spill_dir, layers=list(model), policy=policy, profile_steps=1, min_offload_bytes=0)
    for step in range(2):
        with offloader:
            loss = model[1](model[0](torch.randn(8, 32, generator=torch.Generator().manual_seed(step)))).sum()
        loss.backward()
    offloader.close()
    assert policy.recomputable == [False, True]


class DrawsFromItsArgument(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor, schedule) -> torch.Tensor:
        return x + torch.tanh(self.linear(x)) * next(schedule)


@pytest.mark.parametrize("how", ["argument", "keyword"])
def test_the_adaptive_default_never_recomputes_a_layer_passed_an_iterator(spill_dir, how):
    from utils import RecomputeWherePossible

    torch.manual_seed(0)
    model, policy = nn.ModuleList([DrawsFromItsArgument(), DrawsFromItsArgument()]), RecomputeWherePossible()
    offloader = tba.Offloader(spill_dir, layers=list(model), policy=policy, profile_steps=1, min_offload_bytes=0)
    schedule = itertools.count(1)
    for step in range(2):
        with offloader:
            h = torch.randn(8, 32, generator=torch.Generator().manual_seed(step))
            h = model[0](h, schedule) if how == "argument" else model[0](h, schedule=schedule)
            loss = model[1](h, iter([2.0])).sum()
        loss.backward()
    offloader.close()
    assert policy.recomputable == [False, False]
