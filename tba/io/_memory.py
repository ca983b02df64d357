"""Aligned host memory for direct I/O, as ordinary torch storages.

``O_DIRECT`` needs the memory address, the length and the file offset of each request to be
multiples of the device's block size. The torch CPU allocator only promises 64-byte alignment,
so this module over-allocates a ``uint8`` tensor and returns the view that starts at the wanted
alignment. The returned view keeps the whole allocation alive, and any tensor rebuilt on its
storage does too. :func:`host_buffer` maps large, long-lived buffers (benchmarks, checkpoint
images) straight from the kernel instead, page-aligned by construction.
"""

from __future__ import annotations

import ctypes
import mmap

import torch

from tba.defaults import ALIGN_BYTES


def aligned_empty(nbytes: int, *, pinned: bool = False, alignment_bytes: int = ALIGN_BYTES) -> torch.Tensor:
    """A 1-D ``uint8`` CPU tensor of ``nbytes`` whose address is a multiple of ``alignment_bytes``.

    Args:
        nbytes: Length of the returned view in bytes.
        pinned: Page-lock the memory (needs CUDA). Default False.
        alignment_bytes: Boundary, a power of two. Default :data:`ALIGN_BYTES` (4096).
    """
    raw = torch.empty(nbytes + alignment_bytes, dtype=torch.uint8, device="cpu", pin_memory=pinned)
    start = -raw.data_ptr() % alignment_bytes
    return raw[start : start + nbytes]


def host_buffer(nbytes: int, *, hugepages: bool = True) -> torch.Tensor:
    """A 1-D ``uint8`` tensor of ``nbytes`` from an anonymous ``mmap``: page-aligned, zeroed, every
    page touched now (first touch of fresh memory runs at ~1 GB/s, so pay it once, up front).

    With ``hugepages`` (default) the mapping asks for transparent huge pages before the first touch
    (each 2 MiB physically contiguous: fewer DMA segments per O_DIRECT request); without, its pages
    come from one ``MAP_POPULATE`` pass.
    """
    if hugepages and hasattr(mmap, "MADV_HUGEPAGE"):
        buffer = mapped_empty(nbytes)
    else:
        region = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE)
        buffer = torch.frombuffer(region, dtype=torch.uint8)[:nbytes]
    buffer.zero_()
    return buffer


def mapped_empty(nbytes: int) -> torch.Tensor:
    """A 1-D ``uint8`` tensor of ``nbytes`` from an anonymous ``mmap`` asking for transparent huge
    pages, left untouched (the kernel zero-fills each page at first touch, an ``O_DIRECT`` read's
    included). Page-aligned by construction; its pages go back to the kernel when the tensor and
    every view of it die. Where huge pages cannot be asked for, the mapping has ordinary pages
    (:func:`advise_huge_pages`)."""
    region = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advise_huge_pages(region)
    return torch.frombuffer(region, dtype=torch.uint8)[:nbytes]


def advise_huge_pages(region: mmap.mmap) -> bool:
    """Ask for transparent huge pages on ``region``; False where that cannot be asked (no
    ``MADV_HUGEPAGE`` in this Python, or a kernel built without them, which answers ``EINVAL``):
    the memory then works on ordinary pages."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
    except OSError:
        return False
    return True


def round_up(nbytes: int, alignment_bytes: int) -> int:
    """Smallest multiple of ``alignment_bytes`` that is >= ``nbytes``."""
    return -(-nbytes // alignment_bytes) * alignment_bytes


def memory_view(address: int, nbytes: int) -> memoryview:
    """A writable memoryview of ``nbytes`` of raw memory at ``address`` (no copy)."""
    return memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")


def storage_view(buffer: torch.Tensor, start_bytes: int, nbytes: int, owner: object = None) -> torch.Tensor:
    """A ``uint8`` tensor over ``buffer[start_bytes : start_bytes + nbytes]`` with a storage of its own.

    The new storage starts exactly at that byte and is ``nbytes`` long, so views rebuilt on it get
    the same ``storage_offset`` and storage size as the originals. No bytes are copied: the storage
    borrows the memory and keeps ``owner`` alive (default: ``buffer``) until it dies.
    """
    window = (ctypes.c_char * nbytes).from_address(buffer.data_ptr() + start_bytes)
    window.owner = buffer if owner is None else owner
    return torch.frombuffer(window, dtype=torch.uint8)
