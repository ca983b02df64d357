"""Shared fixtures' building blocks for the engine tests: aligned buffers, files, fd counts."""

from __future__ import annotations

import os

import numpy as np

from tba.defaults import ALIGN_BYTES

MIB = 1 << 20


def random_bytes(nbytes: int, seed: int = 0) -> np.ndarray:
    """``nbytes`` random bytes as a uint8 array."""
    return np.frombuffer(np.random.default_rng(seed).bytes(nbytes), dtype=np.uint8).copy()


def aligned_empty(nbytes: int, misalign: int = 0) -> np.ndarray:
    """A uint8 array of ``nbytes`` starting ``misalign`` bytes past a 4096-byte boundary."""
    raw = np.empty(nbytes + 2 * ALIGN_BYTES, dtype=np.uint8)
    start = (-raw.ctypes.data) % ALIGN_BYTES + misalign
    return raw[start : start + nbytes]


def open_fd_count() -> int:
    """Number of file descriptors this process holds."""
    return len(os.listdir("/proc/self/fd"))


def direct_io_unsupported(directory: str) -> str | None:
    """None when ``directory`` accepts O_DIRECT files, else why not (test-local check)."""
    try:
        fd = os.open(directory, os.O_RDWR | os.O_TMPFILE | os.O_DIRECT, 0o600)
    except OSError as err:
        return f"O_DIRECT not supported in {directory}: {err}"
    os.close(fd)
    return None
