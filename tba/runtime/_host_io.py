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
* a completion calls the storage's callback directly, with no future in between.

A batch that the engine refuses (closed, failed) completes each of its requests with that error,
so every entry still hears the end of its transfer.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from tba import _control
from tba.defaults import ALIGN_BYTES
from tba.device import Countdown
from tba.io import BufferPool, Engine, Op, Request, round_up

Callback = Callable[[BaseException | None], None]


class HostBatch:
    """Batched transfers of host storages through ``engine``; reads land in ``pool``'s buffers.

    Used on the control thread only (the store's jobs); completions run on the engine's thread.
    """

    def __init__(self, engine: Engine, pool: BufferPool, block_size_bytes: int) -> None:
        self.engine = engine
        self.pool = pool
        self.block_size_bytes = block_size_bytes
        self._requests: list[Request] = []
        self._callbacks: list[Callback] = []
        self._flush_scheduled = False

    def write(self, data: torch.Tensor, phase_bytes: int, fd: int, offset: int, on_done: Callback) -> None:
        """Queue the write of the storage ``data`` at ``offset + phase_bytes``; sent with the batch."""
        extent_bytes = round_up(phase_bytes + data.numel(), ALIGN_BYTES)
        self._queue(Op.WRITE, fd, data.data_ptr() - phase_bytes, extent_bytes, offset, on_done, data)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            _control.after_batch(self.flush)

    def read(self, nbytes: int, phase_bytes: int, fd: int, offset: int,
             on_done: Callable[[BaseException | None, Any, Any], None]) -> None:
        """Queue the read of ``nbytes`` written at ``offset``; sent at the next :meth:`flush`."""
        buffer = self.pool.take(round_up(phase_bytes + nbytes, ALIGN_BYTES))
        self._queue(Op.READ, fd, buffer.data_ptr(), buffer.numel(), offset,
                    functools.partial(self._read_done, buffer, phase_bytes, nbytes, on_done), buffer)

    def _queue(self, op: Op, fd: int, address: int, nbytes: int, offset: int, on_done: Callback,
               owner: object) -> None:
        block = self.block_size_bytes
        if nbytes <= block:
            self._requests.append(Request(op, fd, address, nbytes, offset, owner))
            self._callbacks.append(on_done)
            return
        starts = range(0, nbytes, block)
        pieces = Countdown(len(starts), on_done)
        for start in starts:
            self._requests.append(Request(op, fd, address + start, min(block, nbytes - start), offset + start, owner))
            self._callbacks.append(pieces.done)

    def flush(self) -> None:
        """Send every queued request to the engine in one call."""
        self._flush_scheduled = False
        requests, callbacks = self._requests, self._callbacks
        if not requests:
            return
        self._requests, self._callbacks = [], []
        try:
            self.engine.submit_calls(requests, callbacks)
        except Exception as err:  # noqa: BLE001 - each storage hears it through its callback
            for callback in callbacks:
                callback(err)

    def _read_done(self, buffer: torch.Tensor, phase_bytes: int, nbytes: int,
                   on_done: Callable[[BaseException | None, Any, Any], None], error: BaseException | None) -> None:
        if error is not None:
            on_done(error, None, None)
        else:
            on_done(None, self.pool.lease(buffer, phase_bytes, nbytes), None)
