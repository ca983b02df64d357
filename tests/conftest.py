"""Shared fixtures, and the skip conditions behind the markers registered in ``pyproject.toml``.

Tests mark what they need (``@pytest.mark.requires_cuda``, ``@pytest.mark.requires_io_uring``);
:func:`pytest_collection_modifyitems` turns each marker into a skip, with the reason, on machines
that lack it.
"""

from __future__ import annotations

import gc
import os

# Deterministic cuBLAS, so that GPU gradients with and without tba can be compared bit for bit.
# It must be set before CUDA is initialised; on CPU it has no effect.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import pytest
import torch

from tba.io import available_backends


def _missing_requirements() -> dict[str, str | None]:
    """Marker name -> why this machine lacks it (``None`` where it has it)."""
    return {
        "requires_cuda": None if torch.cuda.is_available() else "needs a CUDA device",
        "requires_io_uring": (
            None if available_backends()["io_uring"] is None
            else f"io_uring unavailable: {available_backends()['io_uring']}"
        ),
    }


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    missing = _missing_requirements()
    for item in items:
        for name, reason in missing.items():
            if reason is not None and item.get_closest_marker(name) is not None:
                item.add_marker(pytest.mark.skip(reason=reason))

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
