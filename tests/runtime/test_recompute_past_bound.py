"""What a recomputed layer's forward changes below an object held shallow (past the nested walk's depth or items
bound, Note [The walk of nested state] in ``tba/runtime/_nested_state.py``) is not seen: its recomputation ran from the
changed value, silently (a counter in a dict one level below a shallow one; a tensor in a shallow list updated in
place). Such state is refused when the layer is recomputed; a shallow list of plain values still recomputes exactly."""

from __future__ import annotations

import contextlib
import logging
import types

import pytest
import torch
from torch import nn
from utils import pinned_steps

import tba
from tba import defaults


def _nested(depth: int, leaf: dict) -> dict:
    for _ in range(depth):
        leaf = {"k": leaf}
    return leaf


class Layer(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)
        self.how = how
        if how == "below the depth":
            self.far = _nested(defaults.RECOMPUTE_NESTED_STATE_DEPTH, {"inner": {"n": 0}})
        elif how == "past the items":
            self.table = types.SimpleNamespace(rows=[(i, "a") for i in range(defaults.RECOMPUTE_NESTED_STATE_ITEMS - 3)])
            self.config = types.SimpleNamespace(counts={"a": {"b": {"n": 0}}})
        elif how == "a tensor past the items":
            self.table = types.SimpleNamespace(rows=[(i, "a") for i in range(defaults.RECOMPUTE_NESTED_STATE_ITEMS - 2)])
            self.config = types.SimpleNamespace(scale=[torch.zeros(())])
        else:
            self.table = types.SimpleNamespace(rows=[(i, "a") for i in range(defaults.RECOMPUTE_NESTED_STATE_ITEMS - 2)])
            self.config = types.SimpleNamespace(history=[(1, "a")])
            self.logger = logging.getLogger("tba.test_recompute_past_bound")  # every logger of the process below it

    def counter(self) -> dict:
        if self.how == "below the depth":
            value = self.far
            while "k" in value:
                value = value["k"]
            return value["inner"]
        return self.config.counts["a"]["b"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.how == "a tensor past the items":
            self.config.scale[0].add_(1)
            n = self.config.scale[0].item()
        elif self.how == "plain values past the items":
            self.config.history.append((len(self.config.history), "a"))
            self.logger.debug("history %s", len(self.config.history))
            n = len(self.config.history)
        else:
            box = self.counter()
            box["n"] += 1
            n = box["n"]
        return x + torch.sin(self.linear(x) * (1 + 0.5 * n))


def _steps(spill_dir, how: str, plan: tuple[str, ...] | None) -> list[torch.Tensor]:
    return pinned_steps(lambda: Layer(how), 16, spill_dir, plan)[0]


@pytest.mark.parametrize("how", ["below the depth", "past the items", "a tensor past the items"])
@pytest.mark.parametrize("decision", ["recompute", "offloaded_recompute"])
def test_state_below_a_shallow_object_is_exact_or_refused(spill_dir, decision, how):
    want = _steps(spill_dir, how, None)
    try:
        got = _steps(spill_dir, how, (decision,) * 2)
    except tba.TbaError as error:
        assert "RECOMPUTE_NESTED_STATE" in str(error)
        return
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))


def test_plain_values_past_the_bound_and_a_logger_still_recompute(spill_dir):
    want = _steps(spill_dir, "plain values past the items", None)
    got = _steps(spill_dir, "plain values past the items", ("recompute",) * 2)
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))


class Growing(nn.Module):
    """A metrics list that grows every step beside a counter three dicts down: the list's growth must not push the
    counter past the walk's bound, which failed training after a few steps."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)
        self.config = types.SimpleNamespace(history=[0.0] * (defaults.RECOMPUTE_NESTED_STATE_ITEMS - 8),
                                            options={"a": {"b": {"n": 0}}})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.config.history.append(1.0)
        counter = self.config.options["a"]["b"]
        counter["n"] += 1
        return x + torch.sin(self.linear(x) * (1 + 0.5 * counter["n"]))


def test_a_growing_list_of_numbers_does_not_push_state_past_the_bound(spill_dir):
    results = []
    for plan in (None, ("recompute",) * 2):
        torch.manual_seed(0)
        model = nn.Sequential(Growing(), Growing())
        got = []
        for step in range(12):
            x = torch.randn(4, 16, generator=torch.Generator().manual_seed(step))
            with (tba.offload_activations(spill_dir, layers=list(model), policy=tba.Plan(plan, window_bytes=1 << 20))
                  if plan else contextlib.nullcontext()):
                loss = model(x).pow(2).mean()
            loss.backward()
            got += [loss.detach(), *(p.grad.clone() for p in model.parameters())]
            model.zero_grad()
        results.append(got)
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


def test_an_equal_number_made_anew_is_no_change():
    """A list of numbers is held shallow (compared by identity first); a forward that stores an equal number anew (a
    large int, a float) changes nothing, as in an object the walk compares item by item: else the profiled steps mark
    the layer not recomputable."""
    from tba.runtime._private_state import first_change, private_state

    layer = nn.Linear(2, 2)
    layer.stats = types.SimpleNamespace(rows=[int("2000"), 0.5 * 3], last={"ratio": 0.5 * 3})
    before = private_state(layer)
    layer.stats.rows[:] = [int("2000"), 0.5 * 3]
    layer.stats.last["ratio"] = 0.5 * 3
    assert first_change(before, private_state(layer)) is None
    layer.stats.rows[0] = 2001
    assert first_change(before, private_state(layer)) == "Linear.stats.rows"
    layer.stats.rows[0] = int("2000")
    layer.far = {"k": {"k": {"k": {"k": {"k": {"pairs": [(1, "a")]}}}}}}  # the list past the depth
    before = private_state(layer)
    layer.far["k"]["k"]["k"]["k"]["k"]["pairs"][0] = (2, "a")  # a tuple of one length, other items
    assert first_change(before, private_state(layer)) is not None
