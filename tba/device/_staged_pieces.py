"""Storages larger than one staging block: a block per piece, each piece copied and moved on its own.

The staged route (``tba/device/_staged_route.py``) packs storages that fit a block into shared
blocks (``tba/device/_block_groups.py``); a larger one is cut into block-sized pieces here. A write
takes a block per piece, queues its device-to-host copy behind the producer's event, and writes the
block once that copy ran; the storage hears one outcome when every piece is over. A read takes a
block per piece, reads the file into it and queues the copy into the new device memory; the last
piece's event stands for the whole read, since every copy of a read is queued under one lock.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

import torch

from tba.defaults import ALIGN_BYTES
from tba.device._block_groups import ReadJob, WriteJob
from tba.device._ops import DeviceOps
from tba.device._pinned_pool import StagingPool
from tba.device._protocol import Countdown, ReadCallback, pieces
from tba.io import Engine, Op, Request, round_up


class _Read:
    """A read in progress: the destination, and the copies issued so far."""

    def __init__(self, dst: torch.Tensor, count: int, on_done: ReadCallback) -> None:
        self.dst = dst
        self.lock = threading.Lock()
        self.remaining = count
        self.error: BaseException | None = None
        self.last_event: Any = None
        self.on_done = on_done


class PieceTransfers:
    """Block-by-block writes and reads of storages larger than one staging block.

    Args:
        ops: Device ordering (streams and events).
        engine: Host engine that does the file I/O.
        pool: Staging blocks shared with every other staged transfer.
    """

    def __init__(self, ops: DeviceOps, engine: Engine, pool: StagingPool) -> None:
        self.ops = ops
        self.engine = engine
        self.pool = pool

    def write(self, job: WriteJob) -> None:
        """A storage larger than a block: a block per piece, each copied and written on its own."""
        src = job.src
        assert src is not None
        spans = pieces(src.numel(), self.pool.block_bytes)
        countdown = Countdown(len(spans), job.on_done)
        for start, nbytes in spans:
            block = self.pool.acquire()
            piece = src[start : start + nbytes]
            try:
                event = self.ops.copy_to_host(piece, block[:nbytes], job.ready)
            except BaseException as error:
                self.pool.release(block)
                countdown.done(error)
                continue
            # Note [The route holds the source until its copy ran]
            copied = functools.partial(self._copied, block, job.fd, job.offset + start, nbytes, countdown, piece)
            self.ops.when_done(event, copied)

    def _copied(self, block: torch.Tensor, fd: int, offset: int, nbytes: int, countdown: Countdown,
                source: torch.Tensor, error: BaseException | None) -> None:
        del source
        if error is None:
            try:
                # Note: [A block's file transfer reports by callback]
                # ``submit_calls`` rather than a ``Future`` per block (``submit_write``/``submit_read``):
                # io_uring then runs the callback itself, with no future to build, resolve and chain on
                # the engine's completion thread for every staged storage (issue 25).
                request = Request(Op.WRITE, fd, block.data_ptr(), round_up(nbytes, ALIGN_BYTES), offset, block)
                self.engine.submit_calls((request,), (functools.partial(self._written, block, countdown),))
            except BaseException as submit_error:
                error = submit_error
        if error is not None:
            self.pool.release(block)
            countdown.done(error)

    def _written(self, block: torch.Tensor, countdown: Countdown, error: BaseException | None) -> None:
        self.pool.release(block)
        countdown.done(error)

    def read(self, job: ReadJob) -> None:
        """A storage larger than a block: a block per piece, each read and copied in on its own."""
        spans = pieces(job.nbytes, self.pool.block_bytes)
        try:
            read = _Read(self.ops.empty(job.nbytes, job.device), len(spans), job.on_done)
        except BaseException as error:
            job.on_done(error, None, None)
            return
        for start, length in spans:
            block = self.pool.acquire()
            # Note [A block's file transfer reports by callback]
            request = Request(Op.READ, job.fd, block.data_ptr(), round_up(length, ALIGN_BYTES), job.offset + start, block)
            try:
                self.engine.submit_calls((request,), (functools.partial(self._block_read, read, block, start, length),))
            except BaseException as error:  # the piece ends here: its block goes back, the read hears the error
                self._block_read(read, block, start, length, error)

    def _block_read(self, read: _Read, block: torch.Tensor, start: int, length: int, error: BaseException | None) -> None:
        copied = False
        with read.lock:
            if error is None and read.error is None:
                try:
                    event = self.ops.copy_to_device(block[:length], read.dst[start : start + length])
                    read.last_event = event
                    copied = True
                except BaseException as copy_error:
                    error = copy_error
            if error is not None and read.error is None:
                read.error = error
            read.remaining -= 1
            finished = read.remaining == 0
        if copied:
            # The read (and its destination) is held until the copy ran: a read whose entry died
            # meanwhile must not give the memory back under the prefetch stream's copy.
            self.ops.when_done(event, functools.partial(self._h2d_done, block, read))
        else:
            self.pool.release(block)
        if finished:
            if read.error is not None:
                read.on_done(read.error, None, None)
            else:
                read.on_done(None, read.dst, read.last_event)

    def _h2d_done(self, block: torch.Tensor, read: object, error: BaseException | None) -> None:
        del read
        self.pool.release(block)
