"""Calls in the wrong order raise a :class:`tba.TbaError` that says what to do, never a bare AttributeError."""

from __future__ import annotations

import pytest
import torch

import tba
from tba import TbaError


def test_pack_before_first_entry(spill_dir):
    off = tba.Offloader(spill_dir, min_offload_bytes=0)
    with pytest.raises(TbaError, match="only valid inside 'with offloader:'"):
        off.pack(torch.randn(64, 1024))
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
