"""Portable engine: a pool of threads calling ``os.pwrite`` / ``os.preadv``.

Both calls release the GIL while the kernel works, so ``workers`` requests are in flight at once
(the queue depth). Each request is carried to completion inside its worker: a short write is
continued from where it stopped, ``EAGAIN``/``EINTR`` are retried, and a read that reaches end of
file early fails with :class:`tba.errors.ShortTransferError`. Works on every POSIX file system,
with or without ``O_DIRECT``.
"""

from __future__ import annotations

import errno
import os
import sys as _sys
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import thread as _futures_thread

from tba import _sched
from tba._weak import WeakRegistry
from tba.defaults import QUEUE_DEPTH
from tba.errors import EngineClosedError, ShortTransferError, TbaConfigError
from tba.io._engine import Engine, Op, Request
from tba.io._memory import memory_view

_RETRY_ERRNOS = (errno.EAGAIN, errno.EINTR)


def _write_all(fd: int, address: int, nbytes: int, offset: int) -> int:
    view = memory_view(address, nbytes)
    done = 0
    while done < nbytes:
        try:
            n = os.pwrite(fd, view[done:], offset + done)
        except OSError as err:
            if err.errno in _RETRY_ERRNOS:
                continue
            raise
        if n == 0:
            raise ShortTransferError("write", done, nbytes, offset)
        done += n
    return done


def _read_all(fd: int, address: int, nbytes: int, offset: int) -> int:
    view = memory_view(address, nbytes)
    done = 0
    while done < nbytes:
        try:
            n = os.preadv(fd, [view[done:]], offset + done)
        except OSError as err:
            if err.errno in _RETRY_ERRNOS:
                continue
            raise
        if n == 0:
            raise ShortTransferError("read", done, nbytes, offset)
        done += n
    return done


_TRANSFER = {Op.WRITE: _write_all, Op.READ: _read_all}


def _transfer(box: list[Request]) -> int:
    """Carry out the request in ``box``, which holds it (and its memory's owner) until the transfer ended.

    The box is emptied before the future resolves, so the owner is not kept past completion. A
    vectored request's pieces move one after another, one call each, in the same worker.
    """
    request = box.pop()
    move = _TRANSFER[request.op]
    if request.pieces is None:
        return move(request.fd, request.address, request.nbytes, request.offset)
    done = 0
    for address, nbytes in request.pieces:
        try:
            done += move(request.fd, address, nbytes, request.offset + done)
        except ShortTransferError as err:
            raise ShortTransferError(request.op.value, done + err.done_bytes, request.nbytes, request.offset) from None
    return done


def _interpreter_shutting_down() -> bool:
    """True once ``threading._shutdown`` has begun (``atexit`` handlers run after it): pools take no new work."""
    return bool(getattr(_futures_thread, "_shutdown", False))


def _run_inline(request: Request) -> Future:
    """Carry out ``request`` on the calling thread (Note [Transfers during interpreter exit])."""
    future: Future = Future()
    try:
        future.set_result(_transfer([request]))
    except BaseException as err:  # noqa: BLE001 - reported through the future, as a pool would
        future.set_exception(err)
    return future


class ThreadEngine(Engine):
    """Thread-pool engine.

    Args:
        workers: Number of threads, i.e. requests in flight at once. Default 8.
    """

    name = "threads"
    vectored = True

    # Note: [Transfers during interpreter exit]
    # ``concurrent.futures`` refuses new work once the interpreter has begun to exit, and atexit
    # handlers run after that point: a training step run from one raised "cannot schedule new
    # futures after interpreter shutdown". Then each request runs on the calling thread instead.

    def __init__(self, workers: int = QUEUE_DEPTH) -> None:
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:  # public: tba.ThreadEngine
            raise TbaConfigError(f"workers must be a whole number >= 1, got {type(workers).__name__} {workers!r}; "
                                 f"pass workers=N threads, such as {QUEUE_DEPTH}")
        self.workers = workers
        self._pool = self._new_pool()
        self._lock = threading.Lock()
        self._closed = False
        _engines.add(self)

    def _new_pool(self) -> ThreadPoolExecutor:
        return ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="tba-io", initializer=_sched.background)

    def submit_many(self, requests: Sequence[Request]) -> list[Future]:
        with self._lock:
            if self._closed:
                raise EngineClosedError("engine is closed")
            if not _sys.is_finalizing() and not _interpreter_shutting_down():
                return [self._pool.submit(_transfer, [request]) for request in requests]
        return [_run_inline(request) for request in requests]

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._pool.shutdown(wait=True)


_engines = WeakRegistry()
"""Live thread engines, for :func:`_after_fork_in_child`."""


def _after_fork_in_child() -> None:
    """Note: [A forked child's thread engine gets threads of its own]
    A child of ``fork`` inherits the pool but none of its threads, and the pool starts no new ones while
    its count of idle workers (copied from the parent) says some wait: an engine passed to an offloader
    as ``backend=ThreadEngine(...)`` hung the child's first step, its writes queued for nobody. So each
    inherited engine gets a new pool and lock (a parent thread may have held the old ones); the parent's
    queued requests stay behind, as the io_uring engine's do (Note [A forked child closes the parent's
    rings] in ``tba/io/_io_uring.py``), but this engine has no kernel object of the parent's and goes on.
    """
    for engine in _engines.alive():
        engine._lock = threading.Lock()
        if not engine._closed:
            engine._pool = engine._new_pool()


os.register_at_fork(after_in_child=_after_fork_in_child)
