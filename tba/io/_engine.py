"""The engine interface: asynchronous reads and writes of raw memory ranges at file offsets.

An engine moves bytes between memory and an open file descriptor and knows nothing about
tensors. The runtime hands it requests ``(op, fd, address, nbytes, offset)`` and gets back one
:class:`concurrent.futures.Future` per request. A future resolves to ``nbytes`` when every byte
was transferred, or fails with an :class:`OSError` carrying the right ``errno`` (``ENOSPC`` for a
full disk, ``EIO`` through :class:`tba.errors.ShortTransferError` for a read that ends early).
Engines resubmit short transfers and ``EAGAIN`` themselves; callers never see partial success.

Alignment is the caller's job: when the file was opened with ``O_DIRECT``, the runtime passes
addresses, lengths and offsets that are multiples of :data:`tba.defaults.ALIGN_BYTES`.

Completion callbacks (``Future.add_done_callback``) run on an engine thread; they must be short
and must not submit new work that waits on the same engine.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import ClassVar, NamedTuple


class Op(enum.Enum):
    READ = "read"
    WRITE = "write"


class Request(NamedTuple):
    """One transfer between ``[address, address + nbytes)`` and ``[offset, offset + nbytes)`` of ``fd``.

    ``owner`` is whatever keeps that memory alive (a tensor, a buffer). Engines hold the request,
    and so the owner, until the transfer is over: the memory cannot be freed under the kernel
    even when the caller is interrupted right after submitting (Note [Asynchronous exceptions] in
    ``tba/_control.py``).
    """

    op: Op
    fd: int
    address: int
    nbytes: int
    offset: int
    owner: object = None
    pieces: tuple[tuple[int, int], ...] | None = None
    """A vectored request's ``(address, nbytes)`` pieces, which fill the file range one after another
    (``address`` is then the first piece's); only for engines whose :attr:`Engine.vectored` is true."""


class Engine(abc.ABC):
    """Asynchronous block I/O on raw memory. Subclasses implement :meth:`submit_many` and :meth:`close`."""

    name: ClassVar[str] = "abstract"
    vectored: ClassVar[bool] = False
    """Whether requests may carry ``pieces`` (one transfer for several memory ranges)."""
    write_ahead_bytes: ClassVar[int | None] = None
    """Most bytes of host storages' writes tba hands this engine at once, the others waiting in tba's queue (Note
    [Writes wait in tba's queue, not the engine's] in ``tba/runtime/_host_io.py``); None:
    :data:`tba.defaults.HOST_WRITE_AHEAD_BYTES`. A device storage's writes go from its staging blocks
    (``tba/device/_staged_route.py``), as many at once as the staging pool has blocks, whatever this says."""

    @abc.abstractmethod
    def submit_many(self, requests: Sequence[Request]) -> list[Future]:
        """Queue ``requests`` and return one future per request, in order.

        The memory of each request must stay valid until its future is done.
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Wait for queued requests to finish, then release the engine's threads and kernel objects.

        Idempotent. Submitting after ``close`` raises ``RuntimeError``.
        """

    def submit_calls(self, requests: Sequence[Request], on_done: Sequence[Callable[[BaseException | None], None]]) -> None:
        """Queue ``requests``; ``on_done[i](error)`` runs on an engine thread when request ``i`` is over.

        ``error`` is None when every byte moved, else what its future would have raised. The same
        guarantees as :meth:`submit_many`, without a future per request: engines that can skip
        them (io_uring) save their cost for every saved tensor (``docs/host-cost.md``).
        """
        for future, callback in zip(self.submit_many(requests), on_done):
            future.add_done_callback(lambda done, callback=callback: callback(done.exception()))

    def submit_write(self, fd: int, address: int, nbytes: int, offset: int) -> Future:
        """Queue one write of ``nbytes`` from ``address`` to ``fd`` at ``offset``."""
        return self.submit_many([Request(Op.WRITE, fd, address, nbytes, offset)])[0]

    def submit_read(self, fd: int, address: int, nbytes: int, offset: int) -> Future:
        """Queue one read of ``nbytes`` from ``fd`` at ``offset`` into ``address``."""
        return self.submit_many([Request(Op.READ, fd, address, nbytes, offset)])[0]

    def __repr__(self) -> str:
        depth = getattr(self, "queue_depth", None) or getattr(self, "workers", None)
        return f"{type(self).__name__}(name={self.name!r}" + (f", queue_depth={depth})" if depth else ")")

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
