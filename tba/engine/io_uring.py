"""Native engine: one io_uring instance driven through the ``tba._uring`` C extension.

The extension (``native/``) sets up a ring with raw ``io_uring_setup``/``io_uring_enter``
syscalls and owns ``queue_depth`` request slots. :meth:`IoUringEngine.submit_many` turns each
request into a :class:`concurrent.futures.Future` and hands as many as there are free slots to
the ring in one call; the rest wait in a Python deque. One background thread sits in
``Ring.reap()`` with the GIL released; the C side resubmits short transfers and ``EAGAIN`` from
the completion queue without coming back to Python, so a request surfaces exactly once: with its
byte count, with an :class:`OSError` built from the kernel's errno, or as a read that met end of
file early (:class:`tba.errors.ShortTransferError`). After each batch of completions the thread
resolves the futures and refills the freed slots from the deque, keeping the ring full.

Buffers can optionally be registered with the kernel (:meth:`IoUringEngine.register_buffers`);
requests that fall inside a registered buffer then use ``READ_FIXED``/``WRITE_FIXED``, which
skips pinning pages per request. Registration counts against ``RLIMIT_MEMLOCK`` for non-root
users and is skipped with a log line when the limit forbids it.
"""

from __future__ import annotations

import collections
import errno
import functools
import itertools
import logging
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Sequence

from tba.engine.base import Engine, Op, Request
from tba.errors import ShortTransferError

logger = logging.getLogger("tba")

DEFAULT_QUEUE_DEPTH = 32
"""Requests in flight at once (ring slots) when not told otherwise."""

MAX_QUEUE_DEPTH = 4096
"""Largest queue depth the native ring accepts."""

_DISABLED_SYSCTL = Path("/proc/sys/kernel/io_uring_disabled")


def _errno_name(err: OSError) -> str:
    return errno.errorcode.get(err.errno or 0, str(err.errno))


@functools.cache
def probe() -> str | None:
    """Check once per process whether the io_uring engine can run here.

    Returns:
        None when it can, else a one-line reason, e.g. ``"extension not built: ..."``,
        ``"/proc/sys/kernel/io_uring_disabled = 2"`` or ``"io_uring_setup failed: EPERM
        (seccomp?)"``.
    """
    try:
        from tba import _uring
    except ImportError as err:
        return f"extension not built: {err}"
    try:
        disabled = _DISABLED_SYSCTL.read_text().strip()
    except OSError:
        disabled = "0"
    if disabled == "2":
        return f"{_DISABLED_SYSCTL} = 2"
    try:
        ring = _uring.Ring(2)
    except OSError as err:
        hint = " (seccomp?)" if err.errno == errno.EPERM else ""
        return f"io_uring_setup failed: {_errno_name(err)}{hint}"
    try:
        ring.wake()
        ring.reap()
    except OSError as err:
        return f"io_uring_enter failed: {_errno_name(err)}"
    finally:
        ring.close()
    return None


class IoUringEngine(Engine):
    """io_uring engine.

    Args:
        queue_depth: Requests in flight at once (ring slots), 1 to 4096. Default 32. Further
            requests wait in submission order and go out as slots free up.

    Raises:
        RuntimeError: When :func:`probe` reports that io_uring cannot be used here.
        OSError: When the ring cannot be set up.
    """

    name = "io_uring"

    def __init__(self, queue_depth: int = DEFAULT_QUEUE_DEPTH) -> None:
        if not 1 <= queue_depth <= MAX_QUEUE_DEPTH:
            raise ValueError(f"queue_depth must be in 1..{MAX_QUEUE_DEPTH}, got {queue_depth}")
        reason = probe()
        if reason is not None:
            raise RuntimeError(f"io_uring engine unavailable: {reason}")
        from tba import _uring

        self.queue_depth = queue_depth
        self._ring = _uring.Ring(queue_depth)
        self._lock = threading.Lock()
        self._close_lock = threading.Lock()
        self._pending: collections.deque[tuple[int, int, int, int, int, int]] = collections.deque()
        self._requests: dict[int, tuple[Future, Request]] = {}
        self._tags = itertools.count()
        self._closing = False
        self._ring_closed = False
        self._failure: BaseException | None = None
        self._reaper = threading.Thread(target=self._reap_loop, name="tba-io_uring", daemon=True)
        self._reaper.start()

    def register_buffers(self, buffers: Sequence[tuple[int, int]]) -> bool:
        """Register ``(address, nbytes)`` ranges as fixed buffers; call once, before any I/O.

        The memory must stay valid until :meth:`close`. Later requests lying wholly inside one
        registered range use ``READ_FIXED``/``WRITE_FIXED``.

        Returns:
            True when registered; False (logged) when the kernel refused, e.g. over the memlock
            limit.
        """
        try:
            with self._lock:
                self._ring.register_buffers(list(buffers))
        except OSError as err:
            logger.info("tba: io_uring buffer registration skipped: %s", err)
            return False
        return True

    def submit_many(self, requests: Sequence[Request]) -> list[Future]:
        futures = []
        with self._lock:
            if self._closing:
                raise RuntimeError("engine is closed")
            if self._failure is not None:
                raise RuntimeError(f"io_uring engine failed: {self._failure}")
            for request in requests:
                if request.nbytes < 0 or request.offset < 0:
                    raise ValueError(f"negative size or offset in {request}")
                future: Future = Future()
                future.set_running_or_notify_cancel()
                futures.append(future)
                if request.nbytes == 0:
                    future.set_result(0)
                    continue
                tag = next(self._tags)
                self._requests[tag] = (future, request)
                is_write = 1 if request.op is Op.WRITE else 0
                self._pending.append(
                    (is_write, request.fd, request.address, request.nbytes, request.offset, tag)
                )
            failed = self._pump_locked()
        _fail(failed)
        return futures

    def _pump_locked(self) -> list[tuple[Future, BaseException]]:
        """Move queued requests into free ring slots (caller holds ``_lock``).

        Returns:
            Futures whose requests the ring rejected outright, with the error; the caller fails
            them after releasing the lock, so that their callbacks may submit again.
        """
        failed = []
        while self._pending:
            batch = list(itertools.islice(self._pending, self.queue_depth))
            try:
                accepted = self._ring.submit(batch)
            except Exception as err:  # noqa: BLE001 - fail the batch, never lose a future
                for item in batch:
                    self._pending.popleft()
                    failed.append((self._requests.pop(item[-1])[0], err))
                continue
            for _ in range(accepted):
                self._pending.popleft()
            if accepted < len(batch):
                break
        return failed

    def _reap_loop(self) -> None:
        try:
            while True:
                finished, _ = self._ring.reap()
                with self._lock:
                    done = [(self._requests.pop(tag), result, moved) for tag, result, moved in finished]
                for (future, request), result, moved in done:
                    _resolve(future, request, result, moved)
                with self._lock:
                    failed = self._pump_locked()
                    stop = self._closing and not self._requests
                _fail(failed)
                if stop:
                    return
        except BaseException as err:  # noqa: BLE001 - the ring itself failed; fail every waiter
            logger.exception("tba: io_uring completion thread failed")
            with self._lock:
                self._failure = err
                lost, self._requests = list(self._requests.values()), {}
                self._pending.clear()
            for future, _ in lost:
                future.set_exception(RuntimeError(f"io_uring engine failed: {err}"))
        finally:
            with self._lock:
                self._ring.close()
                self._ring_closed = True

    def close(self) -> None:
        """Wait for every submitted request to finish, then free the ring. Idempotent."""
        with self._close_lock:
            with self._lock:
                if self._closing:
                    return
                self._closing = True
                if not self._requests and not self._ring_closed:
                    self._ring.wake()
            if threading.current_thread() is not self._reaper:
                self._reaper.join()


def _fail(failed: list[tuple[Future, BaseException]]) -> None:
    for future, err in failed:
        future.set_exception(err)


def _resolve(future: Future, request: Request, result: int | OSError | None, moved: int) -> None:
    if isinstance(result, OSError):
        future.set_exception(result)
    elif result is None:
        future.set_exception(ShortTransferError(request.op.value, moved, request.nbytes, request.offset))
    else:
        future.set_result(result)
