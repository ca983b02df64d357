"""The host route: CPU storages straight from their own memory to the file, and back into pooled buffers.

A host storage can be handed to the engine as it is: with the file laid out at the storage's page
phase (``tba/runtime/_entry.py``), the aligned range that covers the storage starts at the
storage's address rounded down to a page and ends rounded up, so ``O_DIRECT`` writes go out with
no bounce copy. The route cuts that range into requests of at most ``block_size_bytes``.

Reads land in an aligned buffer of the same phase taken from the read pool
(``tba/io/_read_pool.py``); the storage handed back is a lease on it, so the buffer returns to the
pool when the last tensor rebuilt on it dies. Host memory needs no ordering: events are None.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from tba.defaults import ALIGN_BYTES
from tba.device._protocol import Callback, Countdown, ReadCallback, Route, pieces
from tba.io import BufferPool, Engine, Op, Request, round_up


class HostRoute(Route):
    """CPU storages through the host engine.

    Args:
        engine: The host engine.
        pool: Aligned read buffers, reused by size.
        block_size_bytes: Largest request, a multiple of :data:`ALIGN_BYTES`.
    """

    def __init__(self, engine: Engine, pool: BufferPool, block_size_bytes: int) -> None:
        self.engine = engine
        self.pool = pool
        self.block_size_bytes = block_size_bytes

    def phase_bytes(self, address: int) -> int:
        return address % ALIGN_BYTES

    def _submit(self, op: Op, fd: int, address: int, nbytes: int, offset: int, on_done: Callback,
                owner: object) -> None:
        requests = [Request(op, fd, address + start, length, offset + start, owner)
                    for start, length in pieces(nbytes, self.block_size_bytes)]
        countdown = Countdown(len(requests), on_done)
        for future in self.engine.submit_many(requests):
            future.add_done_callback(lambda done: countdown.done(done.exception()))

    def write(self, data: torch.Tensor, phase_bytes: int, fd: int, offset: int, on_done: Callback,
              ready: Any = None, wanted: Any = None) -> None:
        extent_bytes = round_up(phase_bytes + data.numel(), ALIGN_BYTES)
        self._submit(Op.WRITE, fd, data.data_ptr() - phase_bytes, extent_bytes, offset, on_done, data)

    def read(self, device: torch.device, nbytes: int, phase_bytes: int, fd: int, offset: int,
             on_done: ReadCallback) -> None:
        buffer = self.pool.take(round_up(phase_bytes + nbytes, ALIGN_BYTES))
        self._submit(Op.READ, fd, buffer.data_ptr(), buffer.numel(), offset,
                     functools.partial(self._read_done, buffer, phase_bytes, nbytes, on_done), buffer)

    def _read_done(self, buffer: torch.Tensor, phase_bytes: int, nbytes: int, on_done: ReadCallback,
                   error: BaseException | None) -> None:
        if error is not None:
            on_done(error, None, None)
        else:
            on_done(None, self.pool.lease(buffer, phase_bytes, nbytes), None)

