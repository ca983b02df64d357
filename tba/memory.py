"""Aligned host memory for direct I/O, as ordinary torch storages.

``O_DIRECT`` needs the memory address, the length and the file offset of each request to be
multiples of the device's block size. The torch CPU allocator only promises 64-byte alignment,
so this module over-allocates a ``uint8`` tensor and returns the view that starts at the wanted
alignment. The returned view keeps the whole allocation alive, and any tensor rebuilt on its
storage does too.
"""

from __future__ import annotations

import ctypes

import torch

from tba.engine.base import ALIGN_BYTES


def aligned_empty(nbytes: int, *, phase_bytes: int = 0, alignment_bytes: int = ALIGN_BYTES) -> torch.Tensor:
    """A 1-D ``uint8`` CPU tensor of ``nbytes`` whose address is ``phase_bytes`` past an alignment boundary.

    Args:
        nbytes: Length of the returned view in bytes.
        phase_bytes: Wanted ``data_ptr() % alignment_bytes``; must be a multiple of 64 so the
            buffer can hold any dtype. Default 0 (aligned).
        alignment_bytes: Boundary, a power of two. Default :data:`ALIGN_BYTES` (4096).
    """
    if phase_bytes % 64 or not 0 <= phase_bytes < alignment_bytes:
        raise ValueError(f"phase_bytes must be a multiple of 64 below {alignment_bytes}, got {phase_bytes}")
    raw = torch.empty(nbytes + alignment_bytes, dtype=torch.uint8)
    start = (phase_bytes - raw.data_ptr()) % alignment_bytes
    return raw[start : start + nbytes]


def storage_view(buffer: torch.Tensor, start_bytes: int, nbytes: int) -> torch.Tensor:
    """A ``uint8`` tensor over ``buffer[start_bytes : start_bytes + nbytes]`` with a storage of its own.

    The new storage starts exactly at that byte and is ``nbytes`` long, so views rebuilt on it get
    the same ``storage_offset`` and storage size as the originals. No bytes are copied: the storage
    borrows the memory and keeps ``buffer`` alive.
    """
    window = (ctypes.c_char * nbytes).from_address(buffer.data_ptr() + start_bytes)
    window.owner = buffer
    return torch.frombuffer(window, dtype=torch.uint8)
