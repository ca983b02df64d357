"""Timed sequential passes over a scratch file: the disk-bandwidth probe shared by tools and integrations.

``python -m tba bench-io`` and ``doctor`` measure with these, and so does the shared-disk check of
the DeepSpeed integration (``tba/integrations/shared_disk.py``), which must not depend on a
command-line tool. A pass submits every request of a file at once and waits for the last one, so
the engine keeps its queue full; the scratch file has no name and disappears with its descriptor.
"""

from __future__ import annotations

import concurrent.futures
import os
import time

import torch

from tba.io._directory import open_anonymous
from tba.io._engine import Engine, Op, Request
from tba.io._memory import host_buffer
from tba.io._spill import NO_RESERVATION_ERRNOS, reserve


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
