"""A recomputed layer's call taken apart and rebuilt (Note [A recomputation gets the call as it was])."""

from __future__ import annotations

import collections

import pytest
import torch

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
