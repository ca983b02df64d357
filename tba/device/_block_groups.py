"""Staged transfers queued together share one staging block, one copy event and one file request.

Note: [Storages queued together share a block]
A staged write used to take a whole staging block (4 MiB by default) per piece, however small the
storage, and then paid per storage: a block from the pool, a stream context, a copy event, a
waiter thread's wake-up on it, one file request and its completion callback. On an H200 that path
cost 280-410 us of host time per 64 KiB storage, most of it GIL hand-overs between tba's threads
(docs/gpu.md, "The fifth run"). The pack hook's saves reach the stager in batches (the control
thread defers them), and consecutive saves get consecutive extents in the spill file. So the stager
now takes every write job waiting in its queue at once and packs the ones whose extents follow each
other into one block, at the same offsets relative to the block as in the file: one copy per storage
on the side stream, one event after the last, one waiter wake-up, one file write of the whole span,
and every member hears the write's outcome. A group ends at the block's end, at a storage larger
than a block (it still goes piece by piece), at an extent that does not follow the last member's
(a write skipped as not needed leaves such a gap: its extent goes back to the spill file at once
and may be handed to another storage, so a group never writes across it), or at another file.
Reads are the mirror: a prefetch step queues the reads of extents that backward wants next, in
reverse, so a read group grows at either end; one file read fills the block, and the copies to
the members' new device memory are queued in one stream context behind one event.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from tba.defaults import ALIGN_BYTES
from tba.device._protocol import Callback, ReadCallback
from tba.io import round_up

logger = logging.getLogger(__name__)


def tell(callback: Callable[..., None], *outcome: Any) -> None:
    """Run a transfer's completion callback; one that raises is logged, so that every other member still hears."""
    try:
        callback(*outcome)
    except BaseException:
        logger.exception("tba: a staged transfer's completion callback failed")


class WriteJob:
    """One storage's staged write, as queued by :meth:`StagedRoute.write`."""

    __slots__ = ("src", "fd", "offset", "ready", "on_done", "wanted")

    def __init__(self, src: torch.Tensor, fd: int, offset: int, ready: Any, on_done: Callback,
                 wanted: Callable[[], bool] | None) -> None:
        self.src: torch.Tensor | None = src
        self.fd = fd
        self.offset = offset
        self.ready = ready
        self.on_done = on_done
        self.wanted = wanted

    @property
    def extent_bytes(self) -> int:
        """The bytes the write covers in the file: the storage rounded up to the I/O alignment."""
        assert self.src is not None
        return round_up(self.src.numel(), ALIGN_BYTES)


class BlockGroup:
    """Write jobs whose extents follow each other in one file, copied into one staging block.

    Member ``i`` lands at ``block[offset_i - start]``: the block is an image of the file's span
    ``[start, end)``, written with one request.
    """

    __slots__ = ("block", "fd", "start", "end", "members")

    def __init__(self, block: torch.Tensor, job: WriteJob) -> None:
        self.block = block
        self.fd = job.fd
        self.start = self.end = job.offset
        self.members: list[WriteJob] = []
        self.add(job)

    def takes(self, job: WriteJob) -> bool:
        """Whether ``job``'s extent follows the last member's in the same file and still fits the block."""
        return job.fd == self.fd and job.offset == self.end and self.end + job.extent_bytes - self.start <= self.block.numel()

    def add(self, job: WriteJob) -> None:
        self.end = job.offset + job.extent_bytes
        self.members.append(job)

    def copies(self) -> list[tuple[torch.Tensor, torch.Tensor, Any]]:
        """``(source, its place in the block, ready)`` for each member, in order."""
        out = []
        for job in self.members:
            assert job.src is not None
            place = job.offset - self.start
            out.append((job.src, self.block[place : place + job.src.numel()], job.ready))
        return out

    def split(self, count: int) -> list[WriteJob]:
        """Keep the first ``count`` members (the span shrinks to them); returns the rest."""
        rest = self.members[count:]
        del self.members[count:]
        if self.members:
            self.end = self.members[-1].offset + self.members[-1].extent_bytes
        return rest

    def copied(self) -> None:
        """The copies ran: the sources are no longer needed here (the store holds them until written)."""
        for job in self.members:
            job.src = None
            job.ready = None

    def done(self, error: BaseException | None) -> None:
        """Tell every member the outcome of the group's write; one callback that raises stops none of the others."""
        members, self.members = self.members, []
        for job in members:
            tell(job.on_done, error)


class ReadJob:
    """One storage's staged read, as queued by :meth:`StagedRoute.read`."""

    __slots__ = ("device", "nbytes", "fd", "offset", "on_done")

    def __init__(self, device: torch.device, nbytes: int, fd: int, offset: int, on_done: ReadCallback) -> None:
        self.device = device
        self.nbytes = nbytes
        self.fd = fd
        self.offset = offset
        self.on_done = on_done

    @property
    def extent_bytes(self) -> int:
        return round_up(self.nbytes, ALIGN_BYTES)


class ReadGroup:
    """Read jobs of one device whose extents are adjacent in one file: one file read into one block.

    Member ``i``'s bytes are ``block[offset_i - start:][:nbytes_i]`` once the read is over.
    """

    __slots__ = ("block", "fd", "device", "start", "end", "members", "destinations")

    def __init__(self, block: torch.Tensor, job: ReadJob) -> None:
        self.block = block
        self.fd = job.fd
        self.device = job.device
        self.start = job.offset
        self.end = job.offset + job.extent_bytes
        self.members = [job]
        self.destinations: list[torch.Tensor] = []

    def takes(self, job: ReadJob) -> bool:
        """Whether ``job``'s extent touches either end of the span in the same file and device, within the block."""
        if job.fd != self.fd or job.device != self.device:
            return False
        if job.offset == self.end:
            return job.offset + job.extent_bytes - self.start <= self.block.numel()
        return job.offset + job.extent_bytes == self.start and self.end - job.offset <= self.block.numel()

    def add(self, job: ReadJob) -> None:
        self.start = min(self.start, job.offset)
        self.end = max(self.end, job.offset + job.extent_bytes)
        self.members.append(job)

    def copies(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(its bytes in the block, its destination)`` per member, in the order the members came."""
        return [(self.block[job.offset - self.start :][: job.nbytes], dst) for job, dst in zip(self.members, self.destinations)]

    def done(self, error: BaseException | None, event: Any = None, count: int | None = None) -> None:
        """Hand the first ``count`` members (all: None) their bytes and ``event``; the others hear ``error``."""
        members, destinations = self.members, self.destinations
        self.members, self.destinations = [], []
        if count is None:
            count = len(members) if error is None else 0
        for index, job in enumerate(members):
            if index < count:
                tell(job.on_done, None, destinations[index], event)
            else:
                tell(job.on_done, error, None, None)
