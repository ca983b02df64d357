"""Fixtures of the device tests: a simulated CUDA device whose problems fail the test."""

from __future__ import annotations

import threading

import pytest

import tba
from tba.device.sim import simulate


@pytest.fixture
def sim():
    """A simulated CUDA device for the test; afterwards no race, no use after free, no thread left."""
    before = set(threading.enumerate())
    with simulate(seed=1234) as device:
        yield device
        tba.shutdown()
    assert device.problems() == [], "\n".join(device.problems())
    left = [t.name for t in set(threading.enumerate()) - before if t.is_alive() and t.name.startswith(("tba", "fake"))]
    assert not left, f"threads left: {left}"
