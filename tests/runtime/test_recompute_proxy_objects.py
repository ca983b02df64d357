"""A recomputed layer given an object whose ``__getattr__`` answers names it does not store (a proxy looking them up in
a dict of its own), directly or in a passed function's closure, trains as without tba (Note [An object's fields are
read without its __getattr__] in tba/runtime/_state_objects.py): tba's reads of its fields ran that ``__getattr__``,
and the forward failed with ``KeyError('__dict__')`` (or ``vars``' ``TypeError``), the closure case since the generator
search looks into passed functions."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

import tba


class Strict:
    """Unknown names come from ``_data``, raising ``KeyError`` as a dict does."""

    __slots__ = ("_data", "unset")

    def __init__(self) -> None:
        self._data = {"scale": 2.0}

    def __getattr__(self, name: str):
        return self._data[name]


class Lenient(Strict):
    """Every unknown name is None."""

    __slots__ = ()

    def __getattr__(self, name: str):
        return self._data.get(name)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, context) -> torch.Tensor:
        scale = context if callable(context) else (lambda t: t * context.scale)
        return scale(torch.tanh(self.linear(x)))


def _scaled(context):
    return lambda t: t * context.scale


def _grads(directory, proxy: type, passed: str, decision: str | None) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.ModuleList([Block(), Block()])
    x = torch.randn(4, 8, requires_grad=True)
    context = proxy()
    offload = contextlib.nullcontext() if decision is None else tba.offload_activations(
        directory, layers=list(model), policy=tba.Plan((decision,) * 2, window_bytes=1 << 20), min_offload_bytes=0)
    with offload:
        h = x
        for block in model:
            h = block(h, context if passed == "object" else _scaled(context))
        loss = h.pow(2).sum()
    loss.backward()
    return [x.grad, *(p.grad for p in model.parameters())]


@pytest.mark.parametrize("decision", ["recompute", "offloaded_recompute"])
@pytest.mark.parametrize("passed", ["object", "closure"])
@pytest.mark.parametrize("proxy", [Strict, Lenient])
def test_a_proxy_object_passed_to_a_recomputed_layer(spill_dir, proxy, passed, decision):
    want = _grads(None, proxy, passed, None)
    got = _grads(spill_dir, proxy, passed, decision)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
