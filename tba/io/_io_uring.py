"""Native engine: one io_uring instance driven through the ``tba._uring`` C extension.

The extension (``native/``) sets up a ring with raw ``io_uring_setup``/``io_uring_enter`` syscalls and
owns ``queue_depth`` request slots. :meth:`IoUringEngine.submit_many` turns each request into a
:class:`concurrent.futures.Future` and hands the batch to the extension in one call, which queues it
in C and, if the completion thread is blocked in the kernel, kicks it with a no-op ring entry. That
one thread sits in ``Ring.reap()`` with the GIL released and is the only thread that issues reads
and writes: io_uring ties each request to the thread that submitted it (its retries run as that
thread's task work and can be cancelled when the thread exits). Inside the C loop the thread moves
queued requests into freed slots as completions arrive, without the GIL, and resubmits short
transfers and ``EAGAIN``; it returns to Python only to hand back finished requests. A request thus
surfaces exactly once: with its byte count, an :class:`OSError` from the kernel's errno, or as a read
that met end of file early (:class:`tba.errors.ShortTransferError`).

Note: [No transfer ends during finalization]
The completion thread is a daemon: it runs the requests' callbacks (the store's bookkeeping, which
calls into torch) and sends the writes that waited for room. A write still in flight when a script
ends without closing its offloader (a forward whose graph lives to the end, an engine never
closed) completed while the interpreter finalized: the thread took the GIL and ran the callbacks
beside the teardown, and one that lost the GIL inside torch's C++ code was ended there by
``pthread_exit``: "terminate called without an active exception" (SIGABRT), 1 run in 70 of a
script whose forward left 16 MiB storages unwritten at exit. So once the control thread has stopped
at exit (``tba._control.at_stop``), every live engine waits until nothing is in flight and its
callbacks have returned; the thread then sleeps in the kernel, and nothing is left to wake it. The
wait is bounded (:data:`tba.defaults.EXIT_IO_WAIT_S`, with a warning): a disk that never answers
must not hang the exit, as an unbounded ``close()`` would.

Note: [A completion callback's error fails nothing else]
A request's target is a future or a callback (:meth:`IoUringEngine.submit_calls`); the completion thread
calls each one, and a callback can raise. That error ended the thread's loop as a failure of the ring: the
callbacks after it in the same batch, whose requests the loop had already taken from the table, never ran
(their owners waited for ever); every request the kernel still held was reported failed, its memory released
while the kernel could still write into it, before the ring was closed; and the engine refused every later
request. So each callback's error is logged and the loop goes on, as a future logs its callbacks' errors
(the engines' default ``submit_calls``); the thread ends only when the ring itself fails.

Note: [A failed ring lets go of nothing the kernel holds]
A submission made while a failed completion thread was failing every request (their memory released)
handed the kernel the entries it had not taken. Now the ring fails for good in C (``native/uring_ring.h``):
it takes them back, refuses every later submission, and ``reap`` raises only once the kernel holds none.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future

from tba import _control, _sched
from tba._weak import WeakRegistry
from tba.defaults import EXIT_IO_WAIT_S, MAX_QUEUE_DEPTH, QUEUE_DEPTH
from tba.errors import EngineClosedError, ShortTransferError, TbaConfigError
from tba.io._directory import lacks_descriptors, out_of_descriptors
from tba.io._engine import Engine, Op, Request
from tba.io._io_uring_probe import probe

__all__ = ["IoUringEngine", "probe"]

logger = logging.getLogger("tba")


class IoUringEngine(Engine):
    """io_uring engine.

    Args:
        queue_depth: Requests in flight at once (ring slots), 1 to 4096. Default 32. Further
            requests wait in submission order and go out as slots free up.

    Raises:
        RuntimeError: When :func:`probe` reports that io_uring cannot be used here.
        TbaConfigError: When the kernel refuses the ring (Note [A ring the kernel refuses]).
    """

    name = "io_uring"
    vectored = True

    def __init__(self, queue_depth: int = QUEUE_DEPTH) -> None:
        if not 1 <= queue_depth <= MAX_QUEUE_DEPTH:
            raise ValueError(f"queue_depth must be in 1..{MAX_QUEUE_DEPTH}, got {queue_depth}")
        reason = probe()
        if reason is not None:
            raise RuntimeError(f"io_uring engine unavailable: {reason}")
        from tba import _uring

        self.queue_depth = queue_depth
        try:
            self._ring = _uring.Ring(queue_depth)
        except OSError as err:
            if lacks_descriptors(err):
                # An OutOfDescriptorsError: the shared runtimes close idle ones and open again (tba/runtime/_shared.py).
                raise out_of_descriptors("an io_uring ring", err) from err
            # Note: [A ring the kernel refuses]
            # The probe's two-entry ring can work where this one fails: before Linux 5.12 a ring's memory
            # counts against the locked-memory limit, so a deep queue fails with ENOMEM (as does a cgroup
            # out of memory, or a sysctl changed since the probe). The bare OSError reached the user's
            # with line, and backend='auto' did not use threads: make_engine falls back on this error.
            raise TbaConfigError(
                f"cannot set up an io_uring ring of {queue_depth} entries: {err.strerror or err}; lower queue_depth, "
                "raise the locked-memory limit (ulimit -l; kernels before 5.12 count rings against it), or pass "
                "backend='threads'") from err
        self._lock = threading.Lock()
        self._close_lock = threading.Lock()
        self._requests: dict[int, tuple[Future | Callable, Request]] = {}
        self._tags = itertools.count()
        self._closing = False
        self._ring_closed = False
        self._failure: BaseException | None = None
        self._resolving = False
        """The completion thread is running callbacks of requests it took (which may submit more)."""
        self._reaping = False  # the completion thread has begun: Note [A constructor interrupted while its thread starts]
        self._reaper = threading.Thread(target=self._reap_loop, name="tba-io_uring", daemon=True)
        try:
            self._reaper.start()
        except BaseException:
            self._abandon_start()
            raise
        _engines.add(self)

    def _abandon_start(self) -> None:
        """Note: [A constructor interrupted while its thread starts]
        ``Thread.start()`` waits for the new thread to run, and a signal handler's exception (Ctrl-C) can
        land in that wait: the constructor raised with the completion thread running, which sat in
        ``reap()`` for ever with the ring open, and no engine was left to close them (``tba.checkpoint``
        builds its engines in the caller's thread; the offloader's are built on the control thread). The
        thread, if it runs, is told to end (the ring closes as it does), else the ring is closed here. The thread
        says it runs, under the lock: one created but not yet run reaped a ring closed here (logged as a failed
        engine), or, once in ``reap()``, made ``close()`` raise RuntimeError in place of the interrupt.
        """
        with self._lock:
            if not self._reaping:  # the thread, if it ever runs, ends at once
                self._ring.close()
                self._ring_closed = True
                return
            self._closing = True
            self._ring.wake()
        self._reaper.join()

    def submit_many(self, requests: Sequence[Request]) -> list[Future]:
        futures = []
        for _ in requests:
            future: Future = Future()
            future.set_running_or_notify_cancel()
            futures.append(future)
        self._submit(requests, futures)
        return futures

    def submit_calls(self, requests: Sequence[Request], on_done: Sequence[Callable[[BaseException | None], None]]) -> None:
        self._submit(requests, on_done)

    def _submit(self, requests: Sequence[Request], targets: Sequence[Future | Callable]) -> None:
        """Queue ``requests``; each one's ``target`` (a future, or a callback taking the error) hears its end."""
        for request in requests:
            if request.nbytes < 0 or request.offset < 0:
                raise ValueError(f"negative size or offset in {request}")
        entries = []
        empty = []
        with self._lock:
            if self._closing:
                raise EngineClosedError("engine is closed")
            if self._failure is not None:
                raise RuntimeError(f"io_uring engine failed: {self._failure}")
            for request, target in zip(requests, targets):
                if request.nbytes == 0:
                    empty.append(target)
                    continue
                tag = next(self._tags)
                self._requests[tag] = (target, request)
                is_write = 1 if request.op is Op.WRITE else 0
                address = request.address if request.pieces is None else request.pieces
                entries.append((is_write, request.fd, address, request.nbytes, request.offset, tag))
            try:
                self._ring.submit(entries)
            except (OSError, TypeError, ValueError, OverflowError, MemoryError):
                # Only errors of submit itself, which queues all or nothing. An asynchronous exception
                # (a signal handler's) can surface right after submit returned: the requests are then
                # in the kernel and must stay known to the completion thread.
                for entry in entries:
                    del self._requests[entry[-1]]
                raise
        for target in empty:
            target.set_result(0) if isinstance(target, Future) else target(None)

    def _reap_loop(self) -> None:
        with self._lock:  # Note [A constructor interrupted while its thread starts]
            if self._ring_closed:
                return
            self._reaping = True
        _sched.background()
        try:
            while True:
                finished, _ = self._ring.reap()
                done = []
                with self._lock:
                    pop = self._requests.pop
                    for tag, result, moved in finished:
                        # The transfer is over: its request, and the memory's owner with it, is let go here.
                        target, request = pop(tag)
                        done.append((target, request.op, request.nbytes, request.offset, result, moved))
                    request = None
                    self._resolving = bool(done)
                for target, op, nbytes, offset, result, moved in done:
                    try:
                        _resolve(target, op, nbytes, offset, result, moved)
                    except BaseException:  # noqa: BLE001 - Note [A completion callback's error fails nothing else]
                        logger.exception("tba: an io_uring completion callback failed")
                # Note [A worker keeps nothing of its last job] in tba/device/_staged_route.py.
                done = target = finished = None
                with self._lock:
                    self._resolving = False
                    if self._closing and not self._requests:
                        return
        except BaseException as err:  # noqa: BLE001 - the ring itself failed; fail every waiter
            # Note [A failed ring lets go of nothing the kernel holds]: reap raised once the kernel held none.
            logger.exception("tba: io_uring completion thread failed")
            with self._lock:
                self._failure = err
                lost, self._requests = list(self._requests.values()), {}
            for target, _ in lost:
                failure = RuntimeError(f"io_uring engine failed: {err}")
                target.set_exception(failure) if isinstance(target, Future) else target(failure)
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

    def _wait_idle(self, timeout_s: float) -> bool:
        """Block until no request is in flight and no callback is running (Note [No transfer ends during
        finalization]), at most ``timeout_s`` seconds; at once when the completion thread has ended.
        Returns whether it got there."""
        deadline = time.monotonic() + timeout_s
        while self._reaper.is_alive():
            with self._lock:
                if not self._requests and not self._resolving:
                    return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.001)
        return True


_engines = WeakRegistry()
"""Live io_uring engines, for :func:`_wait_idle_at_exit` and :func:`_forget_after_fork`."""


def _forget_after_fork() -> None:
    """In a forked child, close every io_uring instance inherited from the parent.

    Note: [A forked child closes the parent's rings]
    A child of ``fork`` inherits the parent's ring descriptors and mappings, but not the completion
    thread blocked in ``reap()``: the ring stays marked in use, ``close()`` refuses, and the thread
    object still refers to the engine, so the descriptor (``anon_inode:[io_uring]``) stayed open for
    the child's whole life, and its children's, whatever the child closed. The parent's requests are
    not the child's to finish. So each inherited engine is failed here without taking its locks (a
    parent thread may have held them at the fork): its ring is unmapped and closed at once, its
    requests forgotten, and any later use raises, as the runtime and the offloaders drop it anyway
    (``tba/runtime/_shared.py``, ``tba/runtime/_store_lifetime.py``).
    """
    for engine in _engines.alive():
        engine._lock = threading.Lock()
        engine._close_lock = threading.Lock()
        engine._requests = {}
        engine._resolving = False
        engine._closing = True
        engine._failure = RuntimeError("this io_uring engine belongs to the parent process (inherited by fork)")
        if not engine._ring_closed:
            engine._ring.forget_after_fork()
            engine._ring_closed = True


os.register_at_fork(after_in_child=_forget_after_fork)


def _wait_idle_at_exit() -> None:
    deadline = time.monotonic() + EXIT_IO_WAIT_S
    for engine in _engines.alive():
        if not engine._wait_idle(max(0.0, deadline - time.monotonic())):
            logger.warning("tba: io_uring requests were still in flight %.0f s after exit began; exiting "
                           "without them (close the offloader before the script ends)", EXIT_IO_WAIT_S)
            return


_control.at_stop(_wait_idle_at_exit)


def _resolve(target: Future | Callable, op: Op, nbytes: int, offset: int, result: int | OSError | None,
             moved: int) -> None:
    if isinstance(result, OSError):
        error: BaseException | None = result
    elif result is None:
        error = ShortTransferError(op.value, moved, nbytes, offset)
    else:
        error = None
    if not isinstance(target, Future):
        target(error)
    elif error is not None:
        target.set_exception(error)
    else:
        target.set_result(result)
