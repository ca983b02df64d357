"""A recomputed layer's call taken apart and rebuilt (Note [A recomputation gets the call as it was])."""

from __future__ import annotations

import collections
import contextlib

import pytest
import torch
from torch import nn

import tba
from tba.runtime._call_args import take_apart


def test_lists_tuples_and_dicts_are_rebuilt_as_they_were_and_other_objects_pass_as_they_are():
    a, b, c = torch.ones(2), torch.zeros(3), torch.arange(4)
    size = torch.Size([2, 3])
    Pair = collections.namedtuple("Pair", "left right")
    pair = Pair(a, 1)
    items = [a, {"b": b, "n": 5}, (c, "s")]
    args, kwargs = (items, size, pair), {"mask": None, "extra": [c]}
    template, tensors = take_apart(args, kwargs)
    assert [id(t) for t in tensors] == [id(a), id(b), id(c)]  # c twice in the call, saved once
    items.append("added after the call")  # what the caller does later is not what the recomputation sees
    saved = tuple(t.clone() for t in tensors)
    got_args, got_kwargs = template.call(saved)
    assert got_args[0] is not items and got_args[0] == [saved[0], {"b": saved[1], "n": 5}, (saved[2], "s")]
    assert got_args[1] is size and got_args[2] is pair  # not taken apart: the very objects
    assert got_kwargs == {"mask": None, "extra": [saved[2]]}
    again_args, _ = template.call(saved)
    assert again_args[0] is not got_args[0]  # each recomputation gets containers of its own


def test_a_tensor_or_container_met_twice_is_one_object_twice_in_the_rebuilt_call():
    h, shared = torch.ones(2), [torch.zeros(1)]
    template, tensors = take_apart((h, h, shared, shared), {"again": h})
    assert [id(t) for t in tensors] == [id(h), id(shared[0])]  # each tensor saved once
    saved = tuple(t.clone() for t in tensors)
    args, kwargs = template.call(saved)
    assert args[0] is args[1] is kwargs["again"] is saved[0]  # attention's query is key is value path
    assert args[2] is args[3] and args[2] is not shared


def test_a_tensor_inside_an_object_passed_as_it_is_changed_after_the_call_raises():
    Pair = collections.namedtuple("Pair", "left right")
    inside = torch.ones(3)
    template, tensors = take_apart((Pair(inside, 2),), {})
    assert tensors == []  # not taken apart: the namedtuple passes as it is
    inside.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        template.call(())


class _Context:
    """A per-forward object handed to every block, its attributes rebound between blocks (Note [An object passed to
    a recomputed layer is called as it was])."""

    def __init__(self) -> None:
        self.scale = 1.0
        self.shift = torch.zeros(16)
        self.calls = 0
        self.total = torch.zeros(())


class _SlottedContext(_Context):
    __slots__ = ("scale", "shift", "calls", "total")


class _Block(nn.Module):
    def __init__(self, count_in_place: bool = False) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)
        self.count_in_place = count_in_place

    def forward(self, x: torch.Tensor, context: _Context) -> torch.Tensor:
        context.calls += 1  # rebinds an attribute of the caller's object
        h = torch.tanh(self.linear(x) * context.scale + context.shift)
        if self.count_in_place:
            context.total += h.detach().sum()  # changes a tensor of the caller's object in place
        return x + h


class _Model(nn.Module):
    def __init__(self, count_in_place: bool = False, context: type = _Context) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block(count_in_place) for _ in range(3))
        self.context = context

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, _Context]:
        context = self.context()
        for block in self.blocks:
            x = block(x, context=context)
            context.scale *= 0.5  # what the recomputation of the block just run must not see
            context.shift = context.shift + 0.25
        return x.pow(2).mean(), context


def _train(decision: str | None, directory: str, context: type) -> tuple[list, list[int]]:
    torch.manual_seed(0)
    model = _Model(context=context)
    plan = None if decision is None else tba.Plan((decision,) * 3, window_bytes=1 << 20)
    offloader = None if plan is None else tba.Offloader(directory, layers=list(model.blocks), policy=plan,
                                                        min_offload_bytes=0)
    grads, calls = [], []
    for step in range(2):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
        with offloader if offloader is not None else contextlib.nullcontext():
            loss, context = model(x)
        loss.backward()
        calls.append(context.calls)
        grads += [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
    if offloader is not None:
        offloader.close()
    return grads, calls


@pytest.mark.parametrize("context", [_Context, _SlottedContext])
@pytest.mark.parametrize("decision", ["recompute", "offloaded_recompute"])
def test_an_object_whose_attributes_change_after_the_call_is_recomputed_as_it_was_called(tmp_path, decision, context):
    expected, expected_calls = _train(None, str(tmp_path), context)
    got, calls = _train(decision, str(tmp_path), context)
    assert all(torch.equal(a, b) for a, b in zip(expected, got))  # silently different before
    assert calls == expected_calls == [3, 3]  # the recomputation's own count went back


def test_a_layer_that_changes_a_tensor_of_an_object_in_place_is_not_recomputed_by_the_adaptive_policy(tmp_path):
    recomputable = []

    class Recompute(tba.Policy):
        def plan(self, profile):
            recomputable.extend(layer.recomputable for layer in profile.layers)
            return tba.Plan(tuple("recompute" if r else "offload" for r in recomputable), window_bytes=1 << 20)

    model = _Model(count_in_place=True)
    offloader = tba.Offloader(str(tmp_path), layers=list(model.blocks), policy=Recompute(), profile_steps=1)
    for _ in range(3):
        with offloader:
            loss, _context = model(torch.randn(8, 16))
        loss.backward()
    offloader.close()
    assert recomputable == [False, False, False]


class _Scaling(nn.Module):
    """A module the model hands every block (as a rotary embedding may be), its attribute rebound between blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = 1.0

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h * self.scale


class _ScaledBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, scaling: nn.Module) -> torch.Tensor:
        return x + torch.tanh(scaling(self.linear(x)))


class _ScaledModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_ScaledBlock() for _ in range(3))
        self.scaling = _Scaling()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, self.scaling)
            self.scaling.scale *= 0.5
        self.scaling.scale = 1.0
        return x.pow(2).mean()


@pytest.mark.parametrize("decision", [None, "recompute", "offloaded_recompute"])
def test_a_module_passed_to_a_recomputed_layer_is_recomputed_as_it_was_called(tmp_path, decision):
    torch.manual_seed(0)
    model = _ScaledModel()
    plan = None if decision is None else tba.Plan((decision,) * 3, window_bytes=1 << 20)
    offloader = None if plan is None else tba.Offloader(str(tmp_path), layers=list(model.blocks), policy=plan)
    with offloader if offloader is not None else contextlib.nullcontext():
        loss = model(torch.randn(8, 16, generator=torch.Generator().manual_seed(1)))
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    if offloader is not None:
        offloader.close()
    torch.manual_seed(0)
    reference = _ScaledModel()
    reference(torch.randn(8, 16, generator=torch.Generator().manual_seed(1))).backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(grads, reference.parameters()))
    assert model.scaling.scale == 1.0


class _FunctionBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, scaled) -> torch.Tensor:
        return x + torch.tanh(scaled(self.linear(x)))


def _closure_model_grads(decision: str | None, directory: str) -> list[torch.Tensor]:
    torch.manual_seed(0)
    blocks = nn.ModuleList(_FunctionBlock() for _ in range(3))
    plan = None if decision is None else tba.Plan((decision,) * 3, window_bytes=1 << 20)
    offloader = None if plan is None else tba.Offloader(directory, layers=list(blocks), policy=plan)
    x, scale = torch.randn(8, 16, generator=torch.Generator().manual_seed(1)), 1.0
    with offloader if offloader is not None else contextlib.nullcontext():
        for block in blocks:
            x = block(x, lambda h: h * scale)  # noqa: B023 (the late binding is the case tested)
            scale *= 0.5  # rebinds the cell the lambda reads
    x.pow(2).mean().backward()
    if offloader is not None:
        offloader.close()
    return [p.grad for p in blocks.parameters()]


@pytest.mark.parametrize("decision", ["recompute", "offloaded_recompute"])
def test_a_function_passed_to_a_recomputed_layer_is_recomputed_with_what_its_closure_held(tmp_path, decision):
    expected = _closure_model_grads(None, str(tmp_path))
    got = _closure_model_grads(decision, str(tmp_path))
    assert all(torch.equal(a, b) for a, b in zip(expected, got))


class _Losses:
    def __init__(self) -> None:
        self.losses: list[torch.Tensor] = []


class _AppendingBlock(_FunctionBlock):
    def forward(self, x: torch.Tensor, record: _Losses) -> torch.Tensor:
        record.losses.append(x.pow(2).mean())  # an auxiliary loss, appended before what the block saves
        return x + torch.tanh(self.linear(x) / len(record.losses))


@pytest.mark.parametrize("decision", [None, "recompute", "offloaded_recompute"])
def test_a_list_held_by_an_object_passed_to_a_recomputed_layer_is_recomputed_as_it_was(tmp_path, decision):
    torch.manual_seed(0)
    blocks = nn.ModuleList(_AppendingBlock() for _ in range(3))
    plan = None if decision is None else tba.Plan((decision,) * 3, window_bytes=1 << 20)
    offloader = None if plan is None else tba.Offloader(str(tmp_path), layers=list(blocks), policy=plan)
    x, record = torch.randn(8, 16, generator=torch.Generator().manual_seed(1)), _Losses()
    with offloader if offloader is not None else contextlib.nullcontext():
        for block in blocks:
            x = block(x, record)
    (x.pow(2).mean() + sum(record.losses)).backward()
    if offloader is not None:
        offloader.close()
    assert len(record.losses) == 3  # 6 before: each recomputation appended again
    grads = [p.grad.sum().item() for p in blocks.parameters()]
    torch.manual_seed(0)
    reference = nn.ModuleList(_AppendingBlock() for _ in range(3))
    x, record = torch.randn(8, 16, generator=torch.Generator().manual_seed(1)), _Losses()
    for block in reference:
        x = block(x, record)
    (x.pow(2).mean() + sum(record.losses)).backward()
    assert grads == [p.grad.sum().item() for p in reference.parameters()]
