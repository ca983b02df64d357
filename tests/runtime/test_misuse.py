"""Calls in the wrong order raise a :class:`tba.TbaError` that says what to do, never a bare AttributeError."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import tba
from tba import TbaError


def test_pack_before_first_entry(spill_dir):
    off = tba.Offloader(spill_dir, min_offload_bytes=0)
    with pytest.raises(TbaError, match="only valid inside 'with offloader:'"):
        off.pack(torch.randn(64, 1024))
    off.close()


def test_entry_where_the_program_disabled_saved_tensor_hooks(spill_dir):
    """Inside ``disable_saved_tensors_hooks`` the entry raises a TbaError naming tba, the region's own message and the
    fix (it raised the region's message alone), before opening anything; the offloader works outside the region."""
    x = torch.randn(64, 1024, requires_grad=True)
    off = tba.Offloader(spill_dir, min_offload_bytes=0)
    with torch.autograd.graph.disable_saved_tensors_hooks("no hooks in this region"):
        with pytest.raises(TbaError, match="tba cannot offload here: .*'no hooks in this region'.*enter the offload "
                                           "context outside it"):
            with off:
                pass
    assert not off._store.is_open
    with off:
        loss = (x * 2).sin().sum()
    loss.backward()
    assert torch.equal(x.grad, 2 * (x.detach() * 2).cos())
    off.close()


def test_close_inside_block_then_backward(spill_dir, backend):
    x = torch.randn(64, 1024, requires_grad=True)
    off = tba.Offloader(spill_dir, backend=backend, min_offload_bytes=0)
    with off:
        loss = (x * 2).sin().sum()
        off.close()
    with pytest.raises(TbaError, match="closed before backward; call close\\(\\) only after the last backward"):
        loss.backward()


def test_pack_after_close_inside_block(spill_dir):
    x = torch.randn(64, 1024, requires_grad=True)
    off = tba.Offloader(spill_dir, min_offload_bytes=0)
    with pytest.raises(TbaError, match="closed inside its with block"):
        with off:
            off.close()
            (x * 2).sin().sum()


def test_unpack_of_another_offloaders_view(spill_dir):
    """Note [A view is unpacked by its own offloader]: it read the other offloader's spill file at the view's offset
    (another tensor's bytes, or an AttributeError); now a TbaError, and the view's own offloader still unpacks it."""
    x, z = torch.randn(256, 256), torch.randn(256, 256)
    first = tba.Offloader(spill_dir, min_offload_bytes=0)
    second = tba.Offloader(spill_dir, min_offload_bytes=0)
    with first:
        packed = first.pack(x.clone())
    with second:
        other = second.pack(z.clone())
    first.flush()
    second.flush()
    with pytest.raises(TbaError, match="another offloader's pack.*unpack it with the offloader whose pack made it"):
        second.unpack(packed)
    assert torch.equal(first.unpack(packed), x)
    assert torch.equal(second.unpack(other), z)
    del packed, other
    first.close()
    second.close()


@pytest.mark.parametrize("reusable", [False, True])
def test_entry_inside_a_non_reentrant_checkpoint_raises(spill_dir, reusable):
    """Note [A block inside a user's non-reentrant checkpoint] in tba/runtime/_pairs.py: the block took every
    tensor the checkpointed function saved, the checkpoint recomputed nothing, and a BatchNorm's statistics were
    updated once where training without tba updates them twice; now a TbaError naming the fix. A reentrant
    checkpoint's recomputation enters the block in backward, exactly as without tba."""
    off = tba.Offloader(spill_dir, min_offload_bytes=0) if reusable else None

    def run(offload: bool, reentrant: bool) -> tuple[torch.Tensor, ...]:
        torch.manual_seed(0)
        block = nn.Sequential(nn.Linear(256, 256), nn.BatchNorm1d(256), nn.Tanh())
        x = torch.randn(64, 256, requires_grad=True)

        def forward(t: torch.Tensor) -> torch.Tensor:
            if not offload:
                return block(t)
            with off if off is not None else tba.offload_activations(spill_dir, min_offload_bytes=0):
                return block(t)

        checkpoint(forward, x, use_reentrant=reentrant).pow(2).sum().backward()
        return (x.grad, *(p.grad for p in block.parameters()), *block.buffers())

    with pytest.raises(TbaError, match=r"inside the function of torch.utils.checkpoint\(use_reentrant=False\).*enter "
                                       "the offload context around the checkpoint call"):
        run(offload=True, reentrant=False)
    assert torch._C._autograd._top_saved_tensors_default_hooks(True) is None
    for got, want in zip(run(offload=True, reentrant=True), run(offload=False, reentrant=True), strict=True):
        assert torch.equal(got, want)
    if off is not None:
        off.close()


def test_entry_inside_allow_mutation_on_saved_tensors_raises(spill_dir):
    """Note [A block inside a user's non-reentrant checkpoint] in tba/runtime/_pairs.py: above that context's pair,
    tba took the saved tensors, and an in-place change the context allows raised torch's in-place error; now a
    TbaError naming the fix. The context inside the block is exact (its pair on top keeps what is saved in it)."""

    def grad(offload: str | None) -> torch.Tensor:
        x = torch.randn(64, 1024, generator=torch.Generator().manual_seed(0), requires_grad=True)
        block = tba.offload_activations(spill_dir, min_offload_bytes=0) if offload else contextlib.nullcontext()
        allow = torch.autograd.graph.allow_mutation_on_saved_tensors()
        outer, inner = (block, allow) if offload == "inside" else (allow, block)
        with outer, inner:
            h = x * 2
            y = h.sin()
            h.mul_(3)  # sin saved h: allowed here, the context cloned it first
            (y * h).sum().backward()
        return x.grad

    with pytest.raises(TbaError, match=r"inside torch.autograd.graph.allow_mutation_on_saved_tensors\(\).*enter the "
                                       r"offload context around allow_mutation_on_saved_tensors\(\)"):
        grad("outside")
    assert torch.equal(grad("inside"), grad(None))


class EntersABlock(nn.Module):
    """A block whose forward runs its first half under a tba block of its own (in ``inner``), nested in the step's."""

    def __init__(self, inner: str) -> None:
        super().__init__()
        self.inner = inner
        self.first = nn.Linear(128, 128)
        self.second = nn.Linear(128, 128)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        with tba.offload_activations(self.inner, policy="offload", min_offload_bytes=0):
            a = torch.tanh(self.first(h))
        return h + torch.tanh(self.second(a))


def _model(inner: str) -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList([EntersABlock(inner), nn.Sequential(nn.Linear(128, 128), nn.Tanh())])


def _steps(model: nn.ModuleList, block: contextlib.AbstractContextManager, count: int = 3) -> list[torch.Tensor]:
    out = []
    for step in range(count):
        model.zero_grad()
        with block:
            x = torch.randn(64, 128, generator=torch.Generator().manual_seed(step))
            loss = model[1](model[0](x)).pow(2).sum()
        loss.backward()
        out += [p.grad.clone() for p in model.parameters()]
    return out


def test_a_layer_that_enters_a_block_is_never_planned_for_recomputation(spill_dir, tmp_path):
    """Note [A layer that enters a tba block is not recomputed] in tba/runtime/_block_entries.py: the adaptive default planned
    to recompute such a layer, and its first planned step raised (a tba block entered inside a checkpoint's function).
    The profiled steps mark it not recomputable; the steps after them are exact."""
    from utils import RecomputeWherePossible

    want = _steps(_model(str(tmp_path)), contextlib.nullcontext())
    model, policy = _model(str(tmp_path)), RecomputeWherePossible()
    offloader = tba.Offloader(spill_dir, layers=list(model), policy=policy, profile_steps=1, min_offload_bytes=0)
    got = _steps(model, offloader)
    offloader.close()
    assert policy.recomputable == [False, True]
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))


@pytest.mark.parametrize("decision", ["recompute", "offloaded_recompute"])
def test_a_plan_that_recomputes_a_layer_entering_a_block_names_the_layer(spill_dir, tmp_path, decision):
    """A pinned plan recomputing such a layer raises at the inner entry, naming the layer and the fix; the message
    said the program had entered the block inside a checkpoint call of its own, which it never made."""
    model = _model(str(tmp_path))
    offloader = tba.Offloader(spill_dir, layers=list(model), policy=tba.Plan((decision, "keep"), 1 << 20))
    with pytest.raises(TbaError, match=r"inside the forward of layer 0 \(EntersABlock\), which the plan recomputes.*"
                                       "keep or offload that layer"):
        _steps(model, offloader, count=1)
    offloader.close()
    assert torch._C._autograd._top_saved_tensors_default_hooks(True) is None
