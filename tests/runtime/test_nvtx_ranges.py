"""With nvtx installed, the per-storage paths mark their ranges (Note [No range without nvtx] in tba/_trace.py).

Without nvtx, the save skips the range altogether; these tests stand a recording ``annotate`` in for nvtx's, so that
the branch taken with a profiler's package installed runs too, and gives the same gradients.
"""

from __future__ import annotations

import contextlib

import torch

import tba
from tba import _trace


def _gradient(directory: str | None) -> torch.Tensor:
    torch.manual_seed(0)
    leaf = torch.randn(64, 1024, requires_grad=True)
    context = tba.offload_activations(directory) if directory is not None else contextlib.nullcontext()
    with context:
        loss = torch.tanh(torch.tanh(leaf) * 2).sum()
    loss.backward()
    return leaf.grad


def test_a_save_marks_its_write_range_when_nvtx_is_installed(spill_dir, monkeypatch):
    names: list[str] = []

    @contextlib.contextmanager
    def annotate(name, domain):
        assert domain == "tba"
        names.append(name)
        yield

    monkeypatch.setattr(_trace, "_annotate", lambda: annotate)
    assert _trace.nvtx_enabled()
    with_ranges = _gradient(spill_dir)
    monkeypatch.undo()
    assert "write" in names and "pack" in names, names
    assert torch.equal(with_ranges, _gradient(None))
