"""A recomputed layer's inputs as its recomputation gets them: changed in place by the program before backward (Note [A
recomputed layer's input changed before backward]) and views (Note [A recomputation gets its input's view-ness]),
both in tba/runtime/_recompute_inputs.py."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn
from utils import RecomputeWherePossible

import tba

RECOMPUTED = ("recompute", "offloaded_recompute")


class AddsFirst(nn.Module):
    """Uses its input only through an addition, which saves nothing: changing the input after the call is legal
    without tba."""

    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.randn(16))
        self.linear = nn.Linear(16, 16)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.linear(torch.tanh(h + self.bias))


def _change(where: str, x: torch.Tensor, h0: torch.Tensor, base: torch.Tensor) -> None:
    if where == "batch":
        x.mul_(2)  # the first layer's input
    elif where == "activation":
        h0.mul_(2)  # the second layer's: a linear saves no output
    else:
        base.add_(1)  # the base of the first layer's input, a view


def _step(plan: tuple[str, ...] | None, directory: str | None, where: str) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.ModuleList(AddsFirst() for _ in range(2))
    base = torch.randn(8, 32, generator=torch.Generator().manual_seed(1))
    x = base[:, 8:24] if where == "base" else base[:, :16].clone()
    with (tba.offload_activations(directory, layers=list(model), policy=tba.Plan(plan, window_bytes=1 << 20),
                                  min_offload_bytes=0) if plan else contextlib.nullcontext()):
        h0 = model[0](x)
        loss = model[1](h0).pow(2).sum()
    _change(where, x, h0, base)
    loss.backward()
    return [p.grad for p in model.parameters()]


@pytest.mark.parametrize("where", ["batch", "activation", "base"])
@pytest.mark.parametrize("decision", RECOMPUTED)
def test_an_input_changed_after_the_call_raises_naming_the_layer(spill_dir, decision, where):
    """Legal and exact without tba; a recomputation would start from the changed input. torch's in-place error, whose
    hint names neither the layer nor its placement, was raised before."""
    _step(None, None, where)
    layer, shape = (1 if where == "activation" else 0), (32 if where == "base" else 16)
    with pytest.raises(tba.TbaError, match=rf"input of a recomputed layer \(layer {layer}, AddsFirst; torch.float32 "
                                           rf"\[8, {shape}\], the input or its base\) was changed in place.*"
                                           r"Clone the input.*keep or offload"):
        _step((decision,) * 2, spill_dir, where)


@pytest.mark.parametrize("where", ["batch", "activation"])
def test_kept_or_offloaded_the_changed_input_is_exact(spill_dir, where):
    want = _step(None, None, where)
    for plan in (("keep", "keep"), ("offload", "offload")):
        assert all(torch.equal(a, b) for a, b in zip(want, _step(plan, spill_dir, where)))


def test_under_allow_mutation_the_change_is_legal_and_exact(spill_dir):
    """That context clones a saved tensor before an in-place change: the change is legal there, and no check is pushed
    (Note [Hook nesting of a recomputed layer] in tba/runtime/_recompute.py)."""

    def grads(decision: str | None) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = nn.ModuleList(AddsFirst() for _ in range(2))
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
        block = (tba.offload_activations(spill_dir, layers=list(model), policy=tba.Plan((decision,) * 2, 1 << 20),
                                         min_offload_bytes=0) if decision else contextlib.nullcontext())
        with block, torch.autograd.graph.allow_mutation_on_saved_tensors():
            loss = model[1](model[0](x)).pow(2).sum()
            x.mul_(2)
            loss.backward()
        return [p.grad for p in model.parameters()]

    want = grads(None)
    for decision in RECOMPUTED:
        assert all(torch.equal(a, b) for a, b in zip(want, grads(decision)))


def test_the_adaptive_default_does_not_recompute_such_a_layer(spill_dir):
    """The profiled steps see the change (Note [A recomputed layer's input changed after its forward] in
    tba/runtime/_timer.py): the layer whose input the program changes is planned kept or offloaded."""
    torch.manual_seed(0)
    model = nn.ModuleList(AddsFirst() for _ in range(2))
    policy = RecomputeWherePossible()
    offloader = tba.Offloader(spill_dir, layers=list(model), policy=policy, profile_steps=1, min_offload_bytes=0)
    for step in range(3):
        with offloader:
            h0 = model[0](torch.randn(8, 16, generator=torch.Generator().manual_seed(step)))
            loss = model[1](h0).pow(2).sum()
        h0.mul_(2)
        loss.backward()
    offloader.close()
    assert policy.recomputable == [True, False]


class ReadsItsBase(nn.Module):
    """Scales by the mean of its input's base when it has one: what a view's base holds beyond the view counts."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        BRANCHES.append((h._is_view(), h._base is not None))
        scale = h._base.mean() if h._base is not None else h.mean()
        return torch.tanh(self.linear(h * scale))


BRANCHES: list[tuple[bool, bool]] = []
"""What each call of a ReadsItsBase saw (a module-level list: a recomputation puts its layer's attributes back)."""


def _view_step(plan: tuple[str, ...] | None, directory: str | None, view: str) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.ModuleList([nn.Linear(16, 32), ReadsItsBase()])
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    with (tba.offload_activations(directory, layers=list(model), policy=tba.Plan(plan, window_bytes=1 << 20),
                                  min_offload_bytes=0) if plan else contextlib.nullcontext()):
        h0 = model[0](x)
        h = {"slice": lambda: h0[:, 8:24], "transpose": lambda: h0.t()[8:24].t(),
             "detached": lambda: h0.detach()[:, :16]}[view]()
        loss = model[1](h).pow(2).sum() + h0.pow(2).sum()
    loss.backward()
    return [h0.detach(), *(p.grad for p in model.parameters())]


@pytest.mark.parametrize("view", ["slice", "transpose", "detached"])
@pytest.mark.parametrize("plan", [("keep", "recompute"), ("offload", "offloaded_recompute"), ("keep", "offloaded_recompute")])
def test_a_recomputation_gets_a_view_where_the_call_had_one(spill_dir, plan, view):
    """The recomputation got a tensor that is a view of nothing: ``_base`` None, another scale, other gradients
    without an error. Torch's checkpoint hands back the view."""
    BRANCHES.clear()
    want = _view_step(None, None, view)
    assert BRANCHES == [(True, True)]
    BRANCHES.clear()
    got = _view_step(plan, spill_dir, view)
    assert BRANCHES == [(True, True)] * 2
    assert all(torch.equal(a, b) for a, b in zip(want, got))


class TwoInputs(nn.Module):
    """Records whether its inputs are one tensor, and whether the second is a view of the first."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        BRANCHES.append((a is b, b._base is a))
        return torch.tanh(self.linear(b)) * a[:, :16].mean()


@pytest.mark.parametrize("decision", RECOMPUTED)
def test_a_recomputation_gets_the_views_identities_as_they_were(spill_dir, decision):
    """One view held twice is one tensor twice (attention's ``query is key`` path); a view and its base stay so."""
    for call in (lambda h0: (h0[:, 8:24], None), lambda h0: (h0, h0[:, 8:24])):
        model = nn.ModuleList([nn.Linear(16, 32), TwoInputs()])
        with tba.offload_activations(spill_dir, layers=list(model), policy=tba.Plan(("keep", decision), 1 << 20),
                                     min_offload_bytes=0):
            a, b = call(model[0](torch.randn(8, 16)))
            loss = model[1](a, a if b is None else b).sum()
        BRANCHES.clear()
        loss.backward()
        assert BRANCHES == [(b is None, b is not None)]


class ScalesInPlaceWhenNotAView(nn.Module):
    """Never writes through a view into the caller's tensor; scales any other input in place (and, once
    ``RECOMPUTING_CHANGES`` is set, any input: another path than the first call's for a reason tba cannot see)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        y = h if RECOMPUTING_CHANGES[0] or not h._is_view() else h.clone()
        return torch.tanh(self.linear(y.mul_(2)))


RECOMPUTING_CHANGES = [False]
"""A module-level flag tba does not replay: set between forward and backward, the recomputation takes the other path."""


def _scaled_step(plan: tuple[str, ...] | None, directory: str | None, flip: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.ModuleList([nn.Linear(16, 32), ScalesInPlaceWhenNotAView()])
    RECOMPUTING_CHANGES[0] = False
    with (tba.offload_activations(directory, layers=list(model), policy=tba.Plan(plan, window_bytes=1 << 20),
                                  min_offload_bytes=0) if plan else contextlib.nullcontext()):
        h0 = model[0](torch.randn(8, 16, generator=torch.Generator().manual_seed(1)))
        loss = model[1](h0[:, 8:24]).pow(2).sum() + h0.sum()
    RECOMPUTING_CHANGES[0] = flip
    loss.backward()
    return [h0.detach(), *(p.grad for p in model.parameters())]


@pytest.mark.parametrize("plan", [("keep", "recompute"), ("offload", "offloaded_recompute")])
def test_a_recomputation_that_changes_its_input_raises(spill_dir, plan):
    """Note [A recomputation must leave its inputs as they are]: the view's clone-or-scale branch changed the caller's
    activation in backward while the recomputation got no view; any other path the recomputation takes alone that
    changes its input is loud."""
    want = _scaled_step(None, None, False)
    assert all(torch.equal(a, b) for a, b in zip(want, _scaled_step(plan, spill_dir, False)))
    with pytest.raises(tba.TbaError, match=r"recomputation of a recomputed layer \(layer 1, ScalesInPlaceWhenNotAView\) "
                                           r"changed its input .* in place, which its first call did not"):
        _scaled_step(plan, spill_dir, True)


class Narrow(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(h))


def _cloned_base_step(decision: str | None, directory: str) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.ModuleList([nn.Linear(16, 32), Narrow()])
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    block = (tba.offload_activations(directory, layers=list(model), policy=tba.Plan(("keep", decision), 1 << 20),
                                     min_offload_bytes=0) if decision else contextlib.nullcontext())
    with block, torch.autograd.graph.allow_mutation_on_saved_tensors():
        h0 = model[0](x)
        gappy = h0[:, :16].detach()  # not a view, and not dense: a clone of it has other strides
        loss = model[1](gappy[:2, :4]).pow(2).sum() + h0.sum()
        gappy.mul_(2)
        loss.backward()
    return [p.grad for p in model.parameters()]


@pytest.mark.parametrize("decision", RECOMPUTED)
def test_under_allow_mutation_a_view_of_a_base_a_clone_relays_out_is_exact(spill_dir, decision):
    """That context clones a changed saved tensor, and a clone of a base that is not dense has other strides: the view
    rebuilt with the strides it had on the base read other elements of the clone, silently."""
    want = _cloned_base_step(None, spill_dir)
    assert all(torch.equal(a, b) for a, b in zip(want, _cloned_base_step(decision, spill_dir)))


@pytest.mark.parametrize("replacement", ["same shape", "one element"])
def test_a_base_whose_data_the_program_replaces_after_the_call_is_exact(spill_dir, replacement):
    """Megatron frees a sent output by swapping its ``.data`` (Note [A save writes the storage its tensor had at pack] in
    tba/runtime/_views.py). Autograd, and checkpoint, hold the view, whose storage stays; a ``recompute`` layer kept
    the base object itself, and rebuilt the view on its new data: other gradients, or an out-of-bounds error."""

    def grads(decision: str | None) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = nn.ModuleList([nn.Linear(16, 32), Narrow()])
        with (tba.offload_activations(spill_dir, layers=list(model), policy=tba.Plan(("keep", decision), 1 << 20),
                                      min_offload_bytes=0) if decision else contextlib.nullcontext()):
            h0 = model[0](torch.randn(8, 16, generator=torch.Generator().manual_seed(1)))
            loss = model[1](h0[:, :4]).pow(2).sum()
        h0.data = torch.ones_like(h0) if replacement == "same shape" else torch.empty(1)
        loss.backward()
        return [p.grad for p in model.parameters()]

    want = grads(None)
    for decision in RECOMPUTED:
        assert all(torch.equal(a, b) for a, b in zip(want, grads(decision)))


class ScalesByItsAttribute(nn.Module):
    """Reads a Python attribute the program set on its input (``getattr(h, "scale", 1.0)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, *hs: torch.Tensor) -> torch.Tensor:
        return sum(torch.tanh(self.linear(h[:, :4] * getattr(h, "scale", 1.0))) for h in hs)


@pytest.mark.parametrize("holder", ["view", "base"])
def test_an_input_with_attributes_reaches_the_recomputation_with_them(spill_dir, holder):
    """A view rebuilt on its base is a new tensor, without the attributes the program set on the view; an alias of the
    base held for a call that holds the base too is one without the base's: the recomputation scaled by 1.0, silently.
    Such a view is saved as it is, as before (Note [A recomputation gets its input's view-ness])."""

    def grads(decision: str | None) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = nn.ModuleList([nn.Linear(16, 32), ScalesByItsAttribute()])
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
        with (tba.offload_activations(spill_dir, layers=list(model), policy=tba.Plan(("keep", decision), 1 << 20),
                                      min_offload_bytes=0) if decision else contextlib.nullcontext()):
            h0 = model[0](x)
            view = x[:, 4:12]
            (view if holder == "view" else x).scale = 3.0
            loss = model[1](*((view,) if holder == "view" else (x, view))).pow(2).sum() + h0.sum()
        loss.backward()
        return [p.grad for p in model.parameters()]

    want = grads(None)
    for decision in RECOMPUTED:
        assert all(torch.equal(a, b) for a, b in zip(want, grads(decision))), decision


@pytest.mark.parametrize("replacement", ["same shape", "one element"])
def test_a_view_whose_base_has_another_storage_now_is_exact(spill_dir, replacement):
    """A base whose ``.data`` was swapped after the view was taken and before the call holds another storage than the
    view: the view rebuilt on it read the new bytes (other gradients, silently) or past its end."""

    def grads(decision: str | None) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = nn.ModuleList([nn.Linear(16, 32), Narrow()])
        with (tba.offload_activations(spill_dir, layers=list(model), policy=tba.Plan(("keep", decision), 1 << 20),
                                      min_offload_bytes=0) if decision else contextlib.nullcontext()):
            h0 = model[0](torch.randn(8, 16, generator=torch.Generator().manual_seed(1)))
            view = h0[:, :4]
            h0.data = torch.ones_like(h0) if replacement == "same shape" else torch.empty(1)
            loss = model[1](view).pow(2).sum()
        loss.backward()
        return [p.grad for p in model.parameters()]

    want = grads(None)
    for decision in RECOMPUTED:
        assert all(torch.equal(a, b) for a, b in zip(want, grads(decision))), decision


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
def test_a_view_of_a_nested_tensor_is_saved_as_it_is(spill_dir):
    """``nested.unbind()[i]`` is a view whose base is a nested tensor of the strided layout, which has no sizes: saved as
    its base, the call failed in forward with torch's internal error."""

    def grads(decision: str | None) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = nn.ModuleList([nn.Linear(4, 4), Narrow()])
        leaf = torch.nested.nested_tensor([torch.randn(2, 4), torch.randn(3, 4)], requires_grad=True)
        with (tba.offload_activations(spill_dir, layers=list(model), policy=tba.Plan(("keep", decision), 1 << 20),
                                      min_offload_bytes=0) if decision else contextlib.nullcontext()):
            nested = leaf * 2.0
            loss = model[1](nested.unbind()[1]).pow(2).sum()
        loss.backward()
        return [*(p.grad for p in model[1].parameters()), *leaf.grad.unbind()]

    want = grads(None)
    for decision in RECOMPUTED:
        assert all(torch.equal(a, b) for a, b in zip(want, grads(decision))), decision
