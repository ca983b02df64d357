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
    """Note [A block inside a user's non-reentrant checkpoint] in tba/runtime/_step_cycle.py: the block took every
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
    """Note [A block inside a user's non-reentrant checkpoint] in tba/runtime/_step_cycle.py: above that context's pair,
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
