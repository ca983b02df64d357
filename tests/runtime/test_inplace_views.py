"""PyTorch's in-place check survives tba when the saved tensor is a view (issue 21, item 3).

A view shares its version counter with its base, and every view holds its base: watching the base
sees any in-place change made through the base or another view after the save.
"""

from __future__ import annotations

import pytest
import torch

import tba


def test_inplace_on_the_base_of_a_saved_temporary_view_raises(spill_dir):
    w = torch.randn(2048, 2048, requires_grad=True)
    h = w * 1
    with tba.offload_activations(spill_dir):
        y = torch.sin(h[:, :1024])
        h.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_inplace_through_a_sibling_view_raises(spill_dir):
    w = torch.randn(512, 512, requires_grad=True)
    h = w * 1
    sibling = h[:, 256:]
    with tba.offload_activations(spill_dir, min_offload_bytes=0):
        y = torch.sin(h[:, :256])
    del h
    sibling.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_without_inplace_the_view_path_is_exact(spill_dir):
    w = torch.randn(1024, 1024, requires_grad=True)
    torch.sin((w * 1)[:, :512]).sum().backward()
    want, w.grad = w.grad, None
    with tba.offload_activations(spill_dir, min_offload_bytes=0):
        y = torch.sin((w * 1)[:, :512])
    y.sum().backward()
    assert torch.equal(w.grad, want)
