"""Helpers for the checkpoint tests: small models, state-dict comparison, scratch mounts, slowed saves."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn


def make_model(seed: int = 0, width: int = 48) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A small MLP with LayerNorm and an Adam optimizer that has taken one step."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(width, 4 * width + 3), nn.GELU(), nn.Linear(4 * width + 3, width),
                          nn.LayerNorm(width))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    train_step(model, optimizer, seed)
    return model, optimizer


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    """One forward, backward and optimizer step on a batch drawn from ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    width = model[0].in_features
    loss = model(torch.randn(8, width, generator=generator)).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Model and optimizer state as one DCP state dict."""
    return {"model": model.state_dict(), "optim": optimizer.state_dict()}


def zeros_like_state(value: Any) -> Any:
    """The same structure with every tensor replaced by zeros (a load target)."""
    if isinstance(value, torch.Tensor):
        return torch.zeros_like(value)
    if isinstance(value, dict):
        return {k: zeros_like_state(v) for k, v in value.items()}
    if isinstance(value, list):
        return [zeros_like_state(v) for v in value]
    return value


def clone_state(value: Any) -> Any:
    """A deep copy with every tensor cloned."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: clone_state(v) for k, v in value.items()}
    if isinstance(value, list):
        return [clone_state(v) for v in value]
    return value


def assert_state_equal(actual: Any, expected: Any, where: str = "") -> None:
    """Every tensor ``torch.equal`` (same dtype and shape), every other value ``==``."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), where
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, where
        assert torch.equal(actual, expected), f"tensor {where} differs"
    elif isinstance(expected, dict):
        assert set(actual) == set(expected), where
        for key in expected:
            assert_state_equal(actual[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, list):
        assert len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_state_equal(a, e, f"{where}.{i}")
    else:
        assert actual == expected, where


def load_state(path: str, like: Any, reader: Any) -> Any:
    """Load the checkpoint at ``path`` into zeros shaped like ``like`` with ``reader``."""
    target = zeros_like_state(like)
    dcp.load(target, storage_reader=reader, no_dist=True)
    return target


@contextlib.contextmanager
def small_mount(directory: str, size_bytes: int, *, read_only: bool = False) -> Iterator[str]:
    """A tmpfs of ``size_bytes`` mounted at ``directory``; skips the test where mount is refused."""
    os.makedirs(directory, exist_ok=True)
    options = f"size={size_bytes}" + (",ro" if read_only else "")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", directory],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip() or done.returncode}")
    try:
        yield directory
    finally:
        subprocess.run(["umount", "-l", directory], check=False)


def slow_writes(monkeypatch: pytest.MonkeyPatch, meanwhile: Any = lambda: None) -> None:
    """Each lazy save's writes start 0.5 s late, after ``meanwhile()`` (the user's next lines) has run."""
    from tba.checkpoint import _layout

    write_image = _layout.write_image

    def slow_write_image(*args: Any, **kwargs: Any) -> Any:
        meanwhile()
        time.sleep(0.5)
        return write_image(*args, **kwargs)

    monkeypatch.setattr(_layout, "write_image", slow_write_image)


def load_during_a_save(monkeypatch: pytest.MonkeyPatch, path: str, load_path: str, width: int) -> None:
    """Save a Linear of ones to ``path``, then one of twos with its writes slowed (:func:`slow_writes`), and load
    ``load_path`` while that save runs: the load must wait for it and see the twos."""
    import tba.checkpoint as tc

    model = nn.Linear(width, width)
    with tc.LazyCheckpointer() as checkpointer:
        with torch.no_grad():
            model.weight.fill_(1.0)
        checkpointer.save(tc.state_dict(model), path).wait()
        with torch.no_grad():
            model.weight.fill_(2.0)
        slow_writes(monkeypatch)
        handle = checkpointer.save(tc.state_dict(model), path)
        fresh = nn.Linear(width, width)
        tc.load(load_path, fresh)
        assert handle.done()
    assert torch.equal(fresh.weight, model.weight)


def first_staging_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """Making the staging directory of a save to a path named ``first`` fails (EIO), as on a failing disk; any other
    save's is made."""
    import errno

    from tba.checkpoint import _writer

    real_hold = _writer.hold_staging

    def hold(staging: str) -> int:
        if os.path.basename(staging).startswith(".first.tba-partial-"):
            raise OSError(errno.EIO, "the staging directory's disk failed")
        return real_hold(staging)

    monkeypatch.setattr(_writer, "hold_staging", hold)
