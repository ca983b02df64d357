"""Timed sequential passes over a scratch file: the disk-bandwidth probe shared by tools and integrations.

``python -m tba bench-io`` measures with these passes, and :func:`directory_bandwidth` (one write and the
best of some reads) serves ``doctor``, ``bench-hooks --many``'s disk floor and the shared-disk check of
the DeepSpeed integration (``tba/integrations/shared_disk.py``), which must not depend on a
command-line tool. A pass submits every request of a file at once and waits for the last one, so
the engine keeps its queue full; the scratch file has no name and disappears with its descriptor.
"""

from __future__ import annotations

import concurrent.futures
import errno
import os
import time

import torch

from tba.defaults import MIB
from tba.io._directory import open_anonymous
from tba.io._engine import Engine, Op, Request
from tba.io._memory import host_buffer
from tba.io._spill import NO_RESERVATION_ERRNOS, free_bytes, reserve

PROBE_BUFFER_BLOCKS = 32
"""Blocks of :func:`directory_bandwidth`'s buffer (its requests cycle through them)."""


def filled_buffer(nbytes: int, *, hugepages: bool = True) -> torch.Tensor:
    """A page-aligned buffer of ``nbytes`` random bytes, every page touched now.

    Physical layout matters on virtual disks: each physically discontiguous page is one more DMA
    segment of a request, and on this project's VM a buffer faulted in from fragmented memory read
    at half the bandwidth of a contiguous one. With ``hugepages`` (default) the mapping asks for
    transparent huge pages (``MADV_HUGEPAGE``), so every 2 MiB is contiguous; without it the pages
    come from one ``MAP_POPULATE`` pass and are contiguous only as far as free memory happens to
    be. fio's own buffer gets no huge pages; ``--no-hugepages`` compares on that footing.
    """
    buffer = host_buffer(nbytes, hugepages=hugepages)
    buffer.random_(0, 256, generator=torch.Generator().manual_seed(0))
    return buffer


def open_scratch(directory: str, size: int, *, direct: bool = True) -> int:
    """A nameless file in ``directory`` (O_DIRECT by default) with ``size`` bytes preallocated, as fio does."""
    fd = open_anonymous(directory, direct=direct)
    try:
        if size > free_bytes(fd):  # Note [No reservation past the free space] in tba/io/_spill.py
            raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} ({size} bytes wanted, less free in {directory})")
        reserve(fd, 0, size)  # Note [No reservation written as zeros] in tba/io/_spill.py
    except OSError as err:
        if err.errno not in NO_RESERVATION_ERRNOS:
            os.close(fd)
            raise
    return fd


def timed_pass(engine: Engine, op: Op, fd: int, buffer: torch.Tensor, size: int, block: int) -> float:
    """Move ``size`` bytes in ``block``-byte requests; return seconds from submit to last done."""
    slots = buffer.numel() // block
    base = buffer.data_ptr()
    requests = [
        Request(op, fd, base + (i % slots) * block, block, i * block) for i in range(size // block)
    ]
    start = time.perf_counter()
    futures = engine.submit_many(requests)
    concurrent.futures.wait(futures)  # one wake-up at the end, not one per request
    elapsed = time.perf_counter() - start
    for future in futures:
        future.result()
    return elapsed


def directory_bandwidth(engine: Engine, directory: str, size_bytes: int, *, block_size_bytes: int = MIB,
                        direct: bool = True, reads: int = 1) -> tuple[float, float]:
    """``(write, read)`` in bytes per second: ``size_bytes`` (whole blocks, at least one) written through ``engine``
    to a nameless file in ``directory``, then read back, the read the best of ``reads`` passes."""
    size = max(block_size_bytes, size_bytes - size_bytes % block_size_bytes)
    buffer = filled_buffer(block_size_bytes * min(PROBE_BUFFER_BLOCKS, size // block_size_bytes))
    fd = open_scratch(directory, size, direct=direct)
    try:
        write_s = timed_pass(engine, Op.WRITE, fd, buffer, size, block_size_bytes)
        read_s = min(timed_pass(engine, Op.READ, fd, buffer, size, block_size_bytes) for _ in range(max(1, reads)))
    finally:
        os.close(fd)
    return size / write_s, size / read_s
