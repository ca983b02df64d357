"""Torch's checkpoint errors from a layer tba recomputes are a TbaError naming the layer and the fix, with torch's
error as its cause (Note [Torch's checkpoint errors name the recomputed layer] in tba/runtime/_checkpoint_errors.py):
a saved tensor unpacked twice, and a recomputation that saves fewer, more or other tensors than the first forward."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import CheckpointError, set_checkpoint_early_stop

import tba
from tba import TbaError

RECOMPUTED = ("recompute", "offloaded_recompute")
_width = {"n": 8}


class Twice(torch.autograd.Function):
    """Its backward reads ``ctx.saved_tensors`` twice: legal without tba, refused by torch's checkpoint."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        (again,) = ctx.saved_tensors
        return grad * (x + again)


class Reads(nn.Module):
    """Saves its input through ``Twice``."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return Twice.apply(self.linear(x)) + x


class Global(nn.Module):
    """Uses the first ``_width["n"]`` features, a global it reads as it is in its recomputation."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.linear(x))
        if _width["n"] > 8:
            h = torch.sigmoid(h) * torch.tanh(h)
        return x + torch.tanh(h[:, :_width["n"]]).sum(1, keepdim=True)


def _train(directory: str, block: type[nn.Module], decisions: tuple[str, ...], between=lambda: None,
           early_stop: bool = True) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(*(block() for _ in decisions))
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    with set_checkpoint_early_stop(early_stop), tba.offload_activations(
            directory, layers=list(model), policy=tba.Plan(decisions, window_bytes=1 << 20)):
        loss = model(x).pow(2).mean()
    between()
    loss.backward()
    return [p.grad for p in model.parameters()]


def _set_width(n: int):
    def set_it() -> None:
        _width["n"] = n
    return set_it


@pytest.fixture(autouse=True)
def _width_back():
    yield
    _width["n"] = 8


def _raised(caught: pytest.ExceptionInfo, index: int, cls: str, torch_says: str) -> None:
    assert isinstance(caught.value.__cause__, CheckpointError), repr(caught.value.__cause__)
    assert torch_says in str(caught.value.__cause__)
    message = str(caught.value)
    assert f"layer {index} ({cls})" in message, message
    assert "a tba.Plan that does not recompute it" in message, message


@pytest.mark.parametrize("decision", RECOMPUTED)
def test_a_tensor_unpacked_twice_names_the_layer(spill_dir, decision):
    with pytest.raises(TbaError) as caught:
        _train(spill_dir, Reads, (decision, "keep"))
    _raised(caught, 0, "Reads", "already unpacked once")


@pytest.mark.parametrize("decision", RECOMPUTED)
def test_fewer_tensors_recomputed_names_the_layer(spill_dir, decision):
    _width["n"] = 9
    with pytest.raises(TbaError) as caught:
        _train(spill_dir, Global, ("keep", decision), between=_set_width(8))
    _raised(caught, 1, "Global", "A different number of tensors was saved")


@pytest.mark.parametrize("decision", RECOMPUTED)
def test_other_metadata_recomputed_names_the_layer(spill_dir, decision):
    with pytest.raises(TbaError) as caught:
        _train(spill_dir, Global, (decision, "keep"), between=_set_width(4))
    _raised(caught, 0, "Global", "have different metadata")


@pytest.mark.parametrize("decision", RECOMPUTED)
def test_more_tensors_recomputed_names_the_layer(spill_dir, decision):
    with pytest.raises(TbaError) as caught:
        _train(spill_dir, Global, (decision, decision), between=_set_width(9), early_stop=False)
    _raised(caught, 1, "Global", "trying to save more tensors")


@pytest.mark.parametrize("decision", ["keep", "offload"])
def test_such_layers_kept_or_offloaded_are_exact(spill_dir, decision):
    for block in (Reads, Global):
        torch.manual_seed(0)
        model = nn.Sequential(block(), block())
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
        model(x).pow(2).mean().backward()
        want = [p.grad for p in model.parameters()]
        got = _train(spill_dir, block, (decision, decision))
        assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
