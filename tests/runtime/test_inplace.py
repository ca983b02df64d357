"""A saved tensor changed in place before backward raises torch's in-place error, as without tba."""

from __future__ import annotations

import pytest
import torch

import tba

INPLACE = "one of the variables needed for gradient computation has been modified by an inplace operation"


def step(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    y = a * 2
    return y, y.sin().sum()


def test_torch_itself_raises():
    a = torch.randn(64, 1024, requires_grad=True)
    y, z = step(a)
    y.mul_(3)
    with pytest.raises(RuntimeError, match=INPLACE):
        z.backward()


@pytest.mark.parametrize("flush", [False, True])
def test_inplace_after_save_raises(spill_dir, backend, flush):
    a = torch.randn(64, 1024, requires_grad=True)
    with tba.offload_activations(spill_dir, backend=backend, min_offload_bytes=0) as off:
        y, z = step(a)
    if flush:
        off.flush()
    y.mul_(3)
    with pytest.raises(RuntimeError, match=INPLACE):
        z.backward()


def test_unchanged_tensor_still_exact(spill_dir, backend):
    a = torch.randn(64, 1024, requires_grad=True)
    y, z = step(a)
    z.backward()
    want = a.grad.clone()
    a.grad = None
    with tba.offload_activations(spill_dir, backend=backend, min_offload_bytes=0):
        y, z = step(a)
    z.backward()
    assert torch.equal(a.grad, want)
