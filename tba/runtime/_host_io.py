"""Host storages' writes and reads, submitted to the engine in batches, one callback per storage.

The host route (``tba/device/_host.py``) submits each storage on its own: one engine call, one
ring submission (a syscall, and a hand-over of the GIL) and one future with its condition, lock
and callback chain per request. For the tens of thousands of small storages a step can save that
was most of tba's host time per tensor (``docs/host-cost.md``). :class:`HostBatch` moves the same
bytes the same way (the same extents, pieces of at most ``block_size_bytes``, reads into pooled
aligned buffers of the same phase, leased back), but:

* writes wait in a batch that goes to the engine in one :meth:`~tba.io.Engine.submit_calls` once
  the deferred saves queued so far have run (``tba._control.after_batch``); reads of one prefetch
  step go together too (:meth:`HostBatch.flush`);
* a completion calls the storage's callback directly, with no future in between;
* at most ``write_ahead_bytes`` of writes are in the engine at once (Note [Writes wait in tba's
  queue, not the engine's]);
* storages whose extents touch in the file go to an engine that takes vectored requests as one
  request (Note [Adjacent storages, one request] in ``tba/runtime/_host_requests.py``).

A batch that the engine refuses (closed, failed) completes each of its requests with that error,
so every entry still hears the end of its transfer.

Note: [Writes wait in tba's queue, not the engine's]
An engine runs its requests in the order they came. When forward saves faster than the disk
writes, handing every write to the engine at once left gigabytes queued there when backward
began: backward's first reads waited behind all of them, and so did the writes of the storages
backward takes from memory anyway (the last layers', held by the prefetch window), which nobody
will ever read. So the engine holds at most ``write_ahead_bytes`` of writes (enough to keep its
queue full); the others wait here in save order and go out as earlier ones complete (from the
engine's completion thread, in batches, once less than three quarters of the allowance is in the
engine). Reads are sent ahead of any write still waiting here. Just before a write goes to the
engine, ``wanted()`` asks the store whether it still serves anything (Note [A write nobody needs is
not started] in ``tba/device/_protocol.py``); when not, the storage hears ``WRITE_NOT_NEEDED`` and
stays in memory for what is left of its use. Closing drops the writes still waiting
(:meth:`HostBatch.drop_waiting_writes`): a closed store keeps none of its storages.
"""

from __future__ import annotations

import collections
import functools
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from tba import _control
from tba.defaults import ALIGN_BYTES, HOST_WRITE_AHEAD_BYTES
from tba.device import WRITE_NOT_NEEDED
from tba.errors import EngineClosedError
from tba.io import BufferPool, Engine, Op, Request, round_up
from tba.runtime._host_requests import Callback, Transfer, add_requests, alone

REFILL_FRACTION = 0.75
"""Writes waiting in tba's queue go to the engine once less than this share of the allowance is there."""


class _Write(NamedTuple):
    """A storage's write waiting for room in the engine."""

    data: torch.Tensor
    address: int
    extent_bytes: int
    fd: int
    offset: int
    on_done: Callback
    wanted: Callable[[], bool] | None


class HostBatch:
    """Batched transfers of host storages through ``engine``; reads land in ``pool``'s buffers.

    Reads and writes are queued on the control thread (the store's jobs); completions run on the
    engine's thread, which also sends the writes that were waiting for room.

    Args:
        write_ahead_bytes: Most bytes of writes in the engine at once (at least one storage goes).
            Default None: :data:`~tba.defaults.HOST_WRITE_AHEAD_BYTES`.
    """

    def __init__(self, engine: Engine, pool: BufferPool, block_size_bytes: int,
                 write_ahead_bytes: int | None = None) -> None:
        self.engine = engine
        self.pool = pool
        self.block_size_bytes = block_size_bytes
        self.write_ahead_bytes = HOST_WRITE_AHEAD_BYTES if write_ahead_bytes is None else write_ahead_bytes
        self._reads: list[Transfer] = []
        self._flush_scheduled = False
        self._lock = threading.Lock()
        self._waiting: collections.deque[_Write] = collections.deque()
        self._engine_write_bytes = 0
        """Bytes of writes handed to the engine and not yet completed."""
        self._closed = False
        self._local = threading.local()
        """``sending``: this thread is inside :meth:`_send_writes`; ``again``: a completion asked for more meanwhile."""

    @property
    def waiting_writes(self) -> int:
        """Writes queued here, not yet handed to the engine."""
        return len(self._waiting)

    def write(self, data: torch.Tensor, phase_bytes: int, fd: int, offset: int, on_done: Callback,
              wanted: Callable[[], bool] | None = None) -> None:
        """Queue the write of the storage ``data`` at ``offset + phase_bytes``; ``wanted()`` is asked
        before it goes to the engine (None: always written). After closing it hears ``WRITE_NOT_NEEDED``."""
        extent_bytes = -(-(phase_bytes + data.numel()) // ALIGN_BYTES) * ALIGN_BYTES  # round_up, inline
        # Note: [Per-storage tuples made without their Python __new__]
        # A NamedTuple's constructor is a Python function (a lambda ``collections.namedtuple`` compiles): one
        # Python call per storage for each of ``_Write`` and ``Transfer``. ``tuple.__new__`` makes the same
        # object, fields in declaration order, in C (docs/host-cost.md, twenty-ninth pass).
        write = tuple.__new__(_Write, (data, data.data_ptr() - phase_bytes, extent_bytes, fd, offset, on_done, wanted))
        with self._lock:
            closed = self._closed
            if not closed:
                self._waiting.append(write)
        if closed:
            on_done(WRITE_NOT_NEEDED)
        elif not self._flush_scheduled:
            self._schedule_flush(write)

    def _schedule_flush(self, write: _Write) -> None:
        """Flush once the deferred saves queued so far have run; ``write`` just joined the queue.

        Note: [A flush that could not be scheduled]
        Scheduling appends to the control thread's list of batch-end callbacks, and that append can fail (a
        MemoryError). The flag was set first: no later write scheduled a flush, and the queue waited for ever (a
        reusable offloader's ``flush()`` never returned). And the write the caller was told had failed stayed in the
        queue, to be sent for an entry its save had already undone or kept in memory (Note [A save that fails after
        its entry is registered] in ``tba/runtime/_store_lifetime.py``). So the flag is set once the flush is
        scheduled, and a failure takes ``write`` back out of the queue before it goes up: the save was not queued.
        """
        try:
            _control.after_batch(self.flush)
        except BaseException:
            with self._lock:
                if self._waiting and self._waiting[-1] is write:
                    self._waiting.pop()
            raise
        self._flush_scheduled = True

    def read(self, nbytes: int, phase_bytes: int, fd: int, offset: int,
             on_done: Callable[[BaseException | None, Any, Any], None]) -> None:
        """Queue the read of ``nbytes`` written at ``offset``; sent at the next :meth:`flush`."""
        buffer = self.pool.take(round_up(phase_bytes + nbytes, ALIGN_BYTES))
        self._reads.append(Transfer(Op.READ, fd, buffer.data_ptr(), buffer.numel(), offset,
                                     functools.partial(self._read_done, buffer, phase_bytes, nbytes, on_done), buffer))

    def flush(self) -> None:
        """Send every queued read, then the waiting writes that fit, to the engine in one call."""
        self._flush_scheduled = False
        reads, self._reads = self._reads, []
        requests: list[Request] = []
        callbacks: list[Callback] = []
        self._add_requests(requests, callbacks, reads)
        self._send_writes(requests, callbacks)

    def _send_writes(self, requests: list[Request], callbacks: list[Callback]) -> None:
        """Add the waiting writes that fit in the allowance to ``requests`` and submit them all.

        Runs on the control thread (:meth:`flush`) or an engine thread (:meth:`_write_done`). The
        store's lock may be held by the caller; ``wanted()`` takes it, so this object's lock is never
        held while asking. Writes found unwanted give their room back to the next ones at once.
        A completion heard inside the submit on this thread (an engine that failed the batch, or
        ran it inline) does not send more itself: this call goes round again instead, so a long
        queue never becomes a deep recursion.
        """
        local = self._local
        outer = getattr(local, "sending", False)
        if outer and not requests:
            local.again = True
            return
        local.sending = True
        try:
            while True:
                local.again = False
                self._send_round(requests, callbacks)
                if not local.again:
                    return
                requests, callbacks = [], []
        finally:
            local.sending = outer

    def _send_round(self, requests: list[Request], callbacks: list[Callback]) -> None:
        reads = len(requests)
        skipped: list[_Write] = []
        while True:
            with self._lock:
                taken = []
                while self._waiting and not self._closed and self._engine_write_bytes < max(self.write_ahead_bytes, 1):
                    write = self._waiting.popleft()
                    self._engine_write_bytes += write.extent_bytes
                    taken.append(write)
            unwanted = []
            transfers = []
            for write in taken:
                if write.wanted is not None and not write.wanted():
                    unwanted.append(write)
                    continue
                # Note [Per-storage tuples made without their Python __new__]
                transfers.append(tuple.__new__(Transfer, (
                    Op.WRITE, write.fd, write.address, write.extent_bytes, write.offset,
                    functools.partial(self._write_done, write.extent_bytes, write.on_done), write.data)))
            self._add_requests(requests, callbacks, transfers)
            if not unwanted:
                break
            with self._lock:
                self._engine_write_bytes -= sum(write.extent_bytes for write in unwanted)
            skipped.extend(unwanted)
        if requests:
            try:
                self.engine.submit_calls(requests, callbacks)
            except Exception as err:  # noqa: BLE001 - each storage hears it through its callback
                refused = self._refused_write(err)
                for index, callback in enumerate(callbacks):
                    callback(refused if index >= reads else err)
        for write in skipped:
            write.on_done(WRITE_NOT_NEEDED)

    def _write_done(self, extent_bytes: int, on_done: Callback, error: BaseException | None) -> None:
        with self._lock:
            self._engine_write_bytes -= extent_bytes
            refill = bool(self._waiting) and self._engine_write_bytes <= self.write_ahead_bytes * REFILL_FRACTION
        on_done(error)
        if refill:
            self._send_writes([], [])

    def _add_requests(self, requests: list[Request], callbacks: list[Callback], transfers: list[Transfer]) -> None:
        """``transfers`` as requests: adjacent ones joined only for an engine that takes vectored ones. The
        retry is bound here, per call: kept on ``self`` it would make a reference cycle, which holds the
        pool's buffers until a collection."""
        retry = self._retry_alone if self.engine.vectored else None
        add_requests(requests, callbacks, transfers, self.block_size_bytes, retry)

    def _retry_alone(self, transfers: list[Transfer]) -> None:
        """A vectored request failed: each of its storages goes again alone, to hear its own outcome
        (Note [Adjacent storages, one request] in ``tba/runtime/_host_requests.py``)."""
        try:
            self.engine.submit_calls([alone(transfer) for transfer in transfers], [t.on_done for t in transfers])
        except Exception as err:  # noqa: BLE001 - each storage hears it through its callback
            refused = self._refused_write(err)
            for transfer in transfers:
                transfer.on_done(refused if transfer.op is Op.WRITE else err)

    def _refused_write(self, error: Exception) -> BaseException:
        """What a write the engine refused with ``error`` hears. Writes taken just before closing (their
        wanted() waited on the store's lock that close held) meet the engine closed by close(): they were
        not needed, they did not fail."""
        return WRITE_NOT_NEEDED if self._closed and isinstance(error, EngineClosedError) else error

    def drop_waiting_writes(self) -> None:
        """Closing: every write not yet in the engine hears ``WRITE_NOT_NEEDED``; none is sent later."""
        with self._lock:
            self._closed = True
            dropped, self._waiting = list(self._waiting), collections.deque()
        for write in dropped:
            write.on_done(WRITE_NOT_NEEDED)

    def _read_done(self, buffer: torch.Tensor, phase_bytes: int, nbytes: int,
                   on_done: Callable[[BaseException | None, Any, Any], None], error: BaseException | None) -> None:
        if error is not None:
            on_done(error, None, None)
        else:
            on_done(None, self.pool.lease(buffer, phase_bytes, nbytes), None)
