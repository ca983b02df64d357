"""Shared skip markers and fixtures. Markers are defined here once and imported by test modules."""

from __future__ import annotations

import gc
import os

# Deterministic cuBLAS, so that GPU gradients with and without tba can be compared bit for bit.
# It must be set before CUDA is initialised; on CPU it has no effect.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import pytest
import torch

from tba.engine import available_backends

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
requires_io_uring = pytest.mark.skipif(
    available_backends()["io_uring"] is not None,
    reason=f"io_uring unavailable: {available_backends()['io_uring']}",
)

USABLE_BACKENDS = [name for name, reason in available_backends().items() if reason is None]


@pytest.fixture(params=USABLE_BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    """Each backend this machine supports."""
    return request.param


@pytest.fixture
def spill_dir(tmp_path) -> str:
    """An empty directory for spill files; the test fails if anything is left in it."""
    path = tmp_path / "spill"
    path.mkdir()
    yield str(path)
    assert os.listdir(path) == [], "a spill file was left behind"


@pytest.fixture
def open_fds():
    """The number of open file descriptors, as a function, to compare before and after.

    Collects garbage first, so descriptors of objects left by earlier tests do not move the count.
    """

    def count() -> int:
        gc.collect()
        return len(os.listdir("/proc/self/fd"))

    return count
