"""The staged route: device storage <-> host staging blocks <-> file.

For tensors that ``pwrite`` cannot read directly (CUDA memory), bytes go through blocks of a
:class:`StagingPool`. Writing: take a block (waiting if none is free), queue the device-to-host
copies behind the producers' events, and when the copies' event completes, submit the block to the
host engine; the block returns to the pool when the write completes. Reading is the mirror: block,
file read, host-to-device copies on the prefetch stream, and the block returns once those copies'
event completes. Storages queued together whose extents are adjacent share a block
(``tba/device/_block_groups.py``); a storage larger than a block goes piece by piece
(``tba/device/_staged_pieces.py``). Ordering is :class:`DeviceOps`' job (``tba/device/_ops.py``).

Who runs what, so that nothing waits while holding a lock another step needs:

* the caller (pack / unpack) only records the producer event and queues a job;
* one *stager* thread takes blocks from the pool (this is where backpressure waits) and queues
  copies or file reads;
* copy completions arrive on the device waiter threads, file completions on engine threads;
  neither ever waits for a block.

The consumer of a read waits on one event recorded after every copy of that read on the prefetch
stream.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

import torch

from tba import _sched
from tba.device._block_groups import BlockGroup, ReadGroup, ReadJob, WriteJob, tell
from tba.device._ops import DeviceOps
from tba.device._pinned_pool import StagingPool
from tba.device._protocol import WRITE_NOT_NEEDED, Callback, ReadCallback, Route
from tba.device._staged_pieces import PieceTransfers
from tba.io import Engine, Op, Request

logger = logging.getLogger(__name__)


_NOTHING = object()
"""What the stager holds when it took no job beyond the writes it is starting."""


class StagedRoute(Route):
    """Moves storages of one device kind to and from the spill file through a staging pool.

    Args:
        ops: Device ordering (streams and events).
        engine: Host engine that does the file I/O.
        pool: Staging blocks shared by writes and reads.
    """

    def __init__(self, ops: DeviceOps, engine: Engine, pool: StagingPool) -> None:
        self.ops = ops
        self.engine = engine
        self.pool = pool
        self._pieces = PieceTransfers(ops, engine, pool)
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="tba-stager", daemon=True)
        self._thread.start()

    def mark_ready(self) -> Any:
        return self.ops.mark_ready()

    def write(self, src: torch.Tensor, phase_bytes: int, fd: int, offset: int, on_done: Callback,
              ready: Any, wanted: Callable[[], bool] | None = None) -> None:
        """Write the ``uint8`` device tensor ``src`` to ``fd`` at ``offset`` after ``ready``; ``on_done(error)`` at the end."""
        self._jobs.put(WriteJob(src, fd, offset, ready, on_done, wanted))

    def _write_jobs(self, jobs: list[WriteJob]) -> None:
        """Start the writes queued together: adjacent ones share a block (Note [Storages queued together share a block])."""
        group: BlockGroup | None = None
        for job in jobs:
            try:
                needed = job.wanted is None or job.wanted()
            except BaseException as error:
                logger.exception("tba: a staged write failed before it started")
                tell(job.on_done, error)
                continue
            if not needed:
                tell(job.on_done, WRITE_NOT_NEEDED)  # Note [A write nobody needs is not started] in _protocol.py
                continue
            try:
                if group is not None and not group.takes(job):
                    group, sending = None, group
                    self._send(sending)  # before the next block is taken: a pool of one block must not wait on itself
                if job.extent_bytes > self.pool.block_bytes:
                    self._pieces.write(job)
                elif group is None:
                    group = BlockGroup(self.pool.acquire(), job)
                else:
                    group.add(job)
            except BaseException as error:
                logger.exception("tba: a staged write failed before it started")
                job.on_done(error)
        if group is not None:
            self._send(group)

    def _send(self, group: BlockGroup) -> None:
        """Queue the group's copies into its block, then (on their event) its file write."""
        try:
            event, queued, error = self.ops.copy_to_host_many(group.copies())
        except BaseException as copy_error:
            event, queued, error = None, 0, copy_error
        for job in group.split(queued):
            tell(job.on_done, error)  # the members copied, and the block, must still go on
        if not group.members:
            self.pool.release(group.block)
            return
        # Note: [The route holds the source until its copy ran]
        # The store may drop its reference while the copy is still queued (the entry died: a
        # backward that raced the writes). The caching allocator would then hand the memory to
        # the next allocation while the side stream still reads it; the group holds its members'
        # sources until the copies' event completed.
        try:
            self.ops.when_done(event, functools.partial(self._group_copied, group))
        except BaseException as wait_error:
            # Nothing will say when the copies ran: the block stays out of the pool rather than be reused under them.
            group.done(wait_error)

    def _group_copied(self, group: BlockGroup, error: BaseException | None) -> None:
        group.copied()
        if error is None:
            try:
                # Note [A block's file transfer reports by callback]
                request = Request(Op.WRITE, group.fd, group.block.data_ptr(), group.end - group.start, group.start, group.block)
                self.engine.submit_calls((request,), (functools.partial(self._group_written, group),))
                return
            except BaseException as submit_error:
                error = submit_error
        self._group_written(group, error)

    def _group_written(self, group: BlockGroup, error: BaseException | None) -> None:
        self.pool.release(group.block)
        group.done(error)

    def read(self, device: torch.device, nbytes: int, phase_bytes: int, fd: int, offset: int,
             on_done: ReadCallback) -> None:
        """Read ``nbytes`` at ``offset`` into a new ``uint8`` tensor on ``device``.

        ``on_done(error, tensor, event)`` runs when every copy is queued; the consumer must wait on
        ``event`` (:meth:`DeviceOps.consume`) before using ``tensor``.
        """
        self._jobs.put(ReadJob(device, nbytes, fd, offset, on_done))

    def _read_jobs(self, jobs: list[ReadJob]) -> None:
        """Start the reads queued together: adjacent ones share a block (Note [Storages queued together share a block])."""
        group: ReadGroup | None = None
        for job in jobs:
            try:
                if group is not None and not group.takes(job):
                    group, sending = None, group
                    self._send_read(sending)
                if job.extent_bytes > self.pool.block_bytes:
                    self._pieces.read(job)
                elif group is None:
                    group = ReadGroup(self.pool.acquire(), job)
                else:
                    group.add(job)
            except BaseException as error:
                logger.exception("tba: a staged read failed before it started")
                job.on_done(error, None, None)
        if group is not None:
            self._send_read(group)

    def _send_read(self, group: ReadGroup) -> None:
        try:
            group.destinations = self.ops.empty_many([job.nbytes for job in group.members], group.device)
            # Note [A block's file transfer reports by callback]
            request = Request(Op.READ, group.fd, group.block.data_ptr(), group.end - group.start, group.start, group.block)
            self.engine.submit_calls((request,), (functools.partial(self._group_read, group),))
        except BaseException as error:
            self.pool.release(group.block)
            group.done(error)

    def _group_read(self, group: ReadGroup, error: BaseException | None) -> None:
        event, queued = None, 0
        if error is None:
            try:
                event, queued, error = self.ops.copy_to_device_many(group.copies())
            except BaseException as copy_error:
                error = copy_error
        if queued:
            # The group (its destinations) is held until the copies ran: a read whose entry died
            # meanwhile must not give the memory back under the prefetch stream's copy.
            try:
                self.ops.when_done(event, functools.partial(self._copied_in, group.block, list(group.destinations)))
            except BaseException:
                # The consumers still wait on the event; only the block's return is unknown: it stays out of the pool.
                logger.exception("tba: cannot learn when a staged read's copies ran; its staging block is not reused")
        else:
            self.pool.release(group.block)
        group.done(error, event, queued)

    def _copied_in(self, block: torch.Tensor, destinations: list[torch.Tensor], error: BaseException | None) -> None:
        del destinations
        self.pool.release(block)

    def _run(self) -> None:
        _sched.background()
        # A job that raises before it handed out any piece fails its transfer through ``fail``, so
        # the waiter sees the error instead of waiting forever; the stager thread lives on.
        jobs = self._jobs
        item = jobs.get()
        while item is not None:
            following: Any = _NOTHING
            kind = type(item)
            if kind is WriteJob or kind is ReadJob:
                # Every transfer of the same kind already queued behind this one goes with it
                # (Note [Storages queued together share a block]).
                batch = [item]
                while not jobs.empty():
                    following = jobs.get()
                    if type(following) is not kind:
                        break
                    batch.append(following)
                    following = _NOTHING
                try:
                    if kind is WriteJob:
                        self._write_jobs(batch)
                    else:
                        self._read_jobs(batch)
                except BaseException:  # each job heard its own failure inside; the stager must live on
                    logger.exception("tba: staged transfers failed before they started")
                batch = []
            else:
                job, fail = item
                try:
                    job()
                except BaseException as error:
                    logger.exception("tba: a staged transfer failed before it started")
                    fail(error)
            # Note: [A worker keeps nothing of its last job]
            # The loop's names would otherwise hold the last job, and through its closure a
            # saved storage or a read-back buffer, until the next job arrives: between steps,
            # through the optimizer step (seen on an H100 as device memory that moved by one
            # read buffer from step to step; tests/runtime/test_no_retention.py).
            item = job = fail = None
            item = jobs.get() if following is _NOTHING else following
            following = None

    def drain(self) -> None:
        """Wait until the stager has queued every job given so far."""
        done = threading.Event()
        self._jobs.put((done.set, lambda error: done.set()))
        done.wait()

    def consume(self, event: Any, tensor: torch.Tensor) -> None:
        self.ops.consume(event, tensor)

    def stop(self) -> None:
        """Stop the stager thread after the queued jobs, then wait for the copies they queued. Idempotent.

        The copies' completions submit file writes: they must all have run before the host engine
        closes (after a forward that raised, copies may still be queued on a lagging side stream).
        """
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join()
        self.ops.drain()

    def close(self) -> None:
        self.ops.close()
