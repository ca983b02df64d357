"""numpy arrays in a recomputed layer's call, changed in place after it (Note [A recomputation gets the call as it
was] in tba/runtime/_call_args.py; found by helper-93)."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from torch import nn

import tba
from tba.runtime._call_args import take_apart


def test_an_array_in_the_call_is_rebuilt_as_it_was_at_the_call():
    scale, point, shared = np.array([1.0, 2.0]), np.array(3.0), np.arange(4.0)
    number = np.float32(0.5)
    fortran = np.asfortranarray(np.ones((2, 3)))
    template, tensors = take_apart((scale, [point, {"s": shared}], (shared, number)), {"f": fortran})
    assert tensors == []
    scale *= 0.5  # the caller's schedule advanced before backward
    point[...] = 7.0
    shared += 1
    fortran[0, 0] = 9.0
    args, kwargs = template.call(())
    assert args[0].tolist() == [1.0, 2.0] and args[0] is not scale
    assert args[1][0].shape == () and float(args[1][0]) == 3.0
    assert args[1][1]["s"] is args[2][0]  # one array twice in the call is one array twice in the rebuilt call
    assert args[2][0].tolist() == [0.0, 1.0, 2.0, 3.0] and args[2][1] is number
    assert kwargs["f"].flags.f_contiguous and kwargs["f"][0, 0] == 1.0
    args[0][0] = 100.0  # a recomputation that writes into its array ...
    again, _ = template.call(())
    assert again[0].tolist() == [1.0, 2.0]  # ... does not change what the next one gets


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, scale: np.ndarray, extras: dict, context: _Context) -> torch.Tensor:
        k = float(scale[0]) * float(extras["shift"]) * float(context.gain[0])
        return x + torch.tanh(self.linear(x) * k)


class _Context:
    def __init__(self) -> None:
        self.gain = np.array([1.0])


def _grads(decision: str | None, directory: str) -> list[torch.Tensor]:
    torch.manual_seed(0)
    blocks = nn.ModuleList(_Block() for _ in range(3))
    plan = None if decision is None else tba.Plan((decision,) * 3, window_bytes=1 << 20)
    offloader = None if plan is None else tba.Offloader(directory, layers=list(blocks), policy=plan, min_offload_bytes=0)
    scale, shift, context = np.array([1.0]), np.array(2.0), _Context()
    gain = context.gain
    grads = []
    for step in range(2):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
        with offloader if offloader is not None else contextlib.nullcontext():
            for block in blocks:
                x = block(x, scale, {"shift": shift}, context)
                context.gain *= 0.75  # an array attribute of an object passed as it is, changed in place
            loss = x.pow(2).mean()
        scale *= 0.5  # a per-step schedule advanced in place before backward
        shift[...] = shift * 0.5  # a 0-d array in a dict of the call
        loss.backward()
        assert context.gain is gain  # the recomputation's copy was taken back
        grads += [p.grad.clone() for p in blocks.parameters()]
        blocks.zero_grad()
    if offloader is not None:
        offloader.close()
    return grads


@pytest.mark.parametrize("decision", ["offload", "recompute", "offloaded_recompute"])
def test_an_array_changed_in_place_after_the_call_is_recomputed_as_it_was(tmp_path, decision):
    expected = _grads(None, str(tmp_path))
    got = _grads(decision, str(tmp_path))
    assert all(torch.equal(a, b) for a, b in zip(expected, got))  # silently different before under recomputation
