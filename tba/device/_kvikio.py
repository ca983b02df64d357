"""The kvikio route: CUDA storages straight to the file with ``kvikio.CuFile``, and back.

With GPUDirect Storage the NVMe drive reads and writes device memory by DMA, with no host copy;
without it kvikio's compatibility mode bounces through its own host buffers. Either way the route
never blocks the compute stream: a worker thread waits (host side) for the producer's event, starts
the kvikio transfer, and a waiter thread waits for kvikio's future and reports completion.

``backend="kvikio"`` asks for this route (compatibility mode where GDS is missing);
``backend="auto"`` takes it only when GDS is really available (:func:`gds_unavailable_reason`).
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import queue
import threading
from collections.abc import Callable
from typing import Any

import torch

from tba import _sched
from tba.defaults import ALIGN_BYTES
from tba.device._cuda import cuda_api
from tba.device._cuda_ops import CudaOps
from tba.device._protocol import WRITE_NOT_NEEDED, Callback, ReadCallback, Route
from tba.errors import error_text, names_cuda_error
from tba.io import FULL_DISK_ERRNOS

logger = logging.getLogger("tba")


@functools.cache
def kvikio_unavailable_reason() -> str | None:
    """None when kvikio can move CUDA memory to files here, else why not."""
    try:
        import kvikio  # noqa: F401
    except ImportError as err:
        return f"kvikio is not installed ({err}); pip install 'tba-offload[gds]'"
    if not cuda_api().is_available():
        return "no CUDA device"
    return None


KVIKIO_API = (
    "CuFile", "CuFile.pread", "CuFile.pwrite", "CuFile.close", "defaults.set", "defaults.get",
    "defaults.is_compat_mode_preferred", "cufile_driver.get",
)
"""Every attribute of the ``kvikio`` package tba calls (checked against the installed package by a contract test)."""

KVIKIO_THREADS = 8
"""kvikio threads tba asks for (kvikio's default is 1: every transfer of a step queued behind one thread)."""
KVIKIO_TASK_BYTES = 16 << 20
"""kvikio's task size tba asks for (default 4 MiB)."""
KVIKIO_WAITERS = 4
"""Threads of tba that wait on kvikio futures, so that one slow transfer does not hold back the others' completions."""
KVIKIO_WRITE_BYTES_IN_FLIGHT = 256 << 20
"""Most bytes of writes handed to kvikio and not yet finished (as much as the staged route's pinned pool
holds); a larger write goes alone. Note [kvikio gets writes a few at a time]."""


@functools.cache
def gds_unavailable_reason() -> str | None:
    """None when GPUDirect Storage is really available (not kvikio's compatibility mode).

    Uses ``kvikio.cufile_driver.get("is_gds_available")`` and ``kvikio.defaults.is_compat_mode_preferred()``
    (kvikio 25.04 and later; ``kvikio.DriverProperties`` was removed in 24.12).
    """
    reason = kvikio_unavailable_reason()
    if reason is not None:
        return reason
    import kvikio
    import kvikio.cufile_driver
    import kvikio.defaults

    try:
        if kvikio.defaults.is_compat_mode_preferred():
            return "kvikio runs in compatibility mode (no GDS driver or file system support)"
        if not kvikio.cufile_driver.get("is_gds_available"):
            return "the cuFile driver reports GDS unavailable"
    except (RuntimeError, AttributeError, KeyError) as err:
        return f"cannot query GDS support (kvikio 25.04 or later is needed): {err}"
    return None


class KvikioRoute(Route):
    """CUDA storages straight to the file with ``kvikio.CuFile`` (GDS, or kvikio's compatibility mode).

    A write worker waits for the producer's event (host side, off the compute stream) and starts
    the kvikio write; a read worker starts reads, so that reads never queue behind writes waiting
    for their producers. A small pool waits on kvikio's futures and reports each as it completes.
    kvikio's own thread count and task size are raised from its defaults (1 thread, 4 MiB) unless
    ``KVIKIO_NTHREADS`` / ``KVIKIO_TASK_SIZE`` are set. A storage keeps its address's phase in the
    file (``phase_bytes``), so GDS moves whole aligned pages instead of splitting off a POSIX part.

    Note: [kvikio gets writes a few at a time]
    kvikio queues whatever it is handed, so a write thread that handed over each write as soon as
    its producer finished had queued a whole forward's writes before backward began, and no write
    could then be skipped (Note [A write nobody needs is not started] in ``tba/device/_protocol.py``): an
    offload-all step of a 1.3B GPT took 18.8 s on an H200 through kvikio against 0.51 s staged, where
    the pinned pool bounds what is in transfer. The write thread now waits until fewer than
    :data:`KVIKIO_WRITE_BYTES_IN_FLIGHT` bytes are in kvikio's hands, and asks whether the write is
    still wanted only after that wait.
    """

    def __init__(self, ops: CudaOps) -> None:
        import kvikio
        import kvikio.defaults

        self._kvikio = kvikio
        settings = {}
        if "KVIKIO_NTHREADS" not in os.environ:
            settings["num_threads"] = KVIKIO_THREADS
        if "KVIKIO_TASK_SIZE" not in os.environ:
            settings["task_size"] = KVIKIO_TASK_BYTES
        if settings:
            kvikio.defaults.set(settings)
        self._task_bytes = max(1, int(kvikio.defaults.get("task_size")))
        """The pieces a transfer is cut into, each one kvikio task (Note [A transfer waits for every piece it started])."""
        self.ops = ops
        self._write_limit = KVIKIO_WRITE_BYTES_IN_FLIGHT
        self._writing_bytes = 0
        self._writing = threading.Condition()
        self._files: dict[int, Any] = {}
        self._files_lock = threading.Lock()
        self._writes: queue.SimpleQueue = queue.SimpleQueue()
        self._reads: queue.SimpleQueue = queue.SimpleQueue()
        # Note: [kvikio's completions are queued to tba's own waiters]
        # A ThreadPoolExecutor built a Future and a work item for each transfer's completion, which
        # nobody read (issue 25); the waiters now take plain jobs from one queue, as the workers do.
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._loop, args=(self._writes,), name="tba-kvikio-write", daemon=True),
            threading.Thread(target=self._loop, args=(self._reads,), name="tba-kvikio-read", daemon=True),
        ]
        self._waiters = [threading.Thread(target=self._loop, args=(self._done,), name=f"tba-kvikio-wait-{i}", daemon=True)
                         for i in range(KVIKIO_WAITERS)]
        for thread in self._waiters:
            thread.start()
        for thread in self._threads:
            thread.start()

    def phase_bytes(self, address: int) -> int:
        return address % ALIGN_BYTES

    def _file(self, fd: int) -> Any:
        with self._files_lock:
            if fd not in self._files:
                self._files[fd] = self._kvikio.CuFile(f"/proc/self/fd/{fd}", "r+")
            return self._files[fd]

    def mark_ready(self) -> Any:
        return self.ops.mark_ready()

    def write(self, src: torch.Tensor, phase_bytes: int, fd: int, offset: int, on_done: Callback,
              ready: Any, wanted: Callable[[], bool] | None = None) -> None:
        held = [src]  # Note [A finished write lets go of its source]

        def start() -> None:
            nbytes = held[0].numel()
            self._hand_over(nbytes)  # Note [kvikio gets writes a few at a time]
            wrote = functools.partial(self._wrote, nbytes, on_done)
            try:
                if wanted is not None and not wanted():
                    held.clear()
                    wrote(WRITE_NOT_NEEDED)  # Note [A write nobody needs is not started] in tba/device/_protocol.py
                    return
                ready.synchronize()
                futures = self._pieces(self._file(fd).pwrite, held[0], nbytes, offset + phase_bytes)
            except BaseException as error:
                held.clear()
                wrote(error)
                return
            self._done.put(functools.partial(self._finish_write, futures, held, wrote))

        self._writes.put(start)

    def _hand_over(self, nbytes: int) -> None:
        """Wait until a write of ``nbytes`` fits beside those kvikio has (alone, if larger than the bound)."""
        with self._writing:
            self._writing.wait_for(lambda: self._writing_bytes == 0
                                   or self._writing_bytes + nbytes <= self._write_limit)
            self._writing_bytes += nbytes

    def _wrote(self, nbytes: int, on_done: Callback, error: BaseException | None) -> None:
        with self._writing:
            self._writing_bytes -= nbytes
            self._writing.notify_all()
        on_done(error)

    def read(self, device: torch.device, nbytes: int, phase_bytes: int, fd: int, offset: int,
             on_done: ReadCallback) -> None:
        def start() -> None:
            try:
                dst = self.ops.empty_for_host(nbytes, device)
                futures = self._pieces(self._file(fd).pread, dst, nbytes, offset + phase_bytes)
            except BaseException as error:
                on_done(error, None, None)
                return
            self._done.put(functools.partial(self._finish_read, futures, [dst], on_done))

        self._reads.put(start)

    def _pieces(self, transfer: Callable[..., Any], buffer: torch.Tensor, nbytes: int, file_offset: int) -> list[Any]:
        """Start ``transfer`` (a ``CuFile``'s ``pwrite`` or ``pread``) of ``buffer``'s ``nbytes`` at ``file_offset``, one
        kvikio future per task-size piece; what :func:`_failure` waits for.

        Note: [A transfer waits for every piece it started]
        kvikio cuts a transfer into task-size pieces, and its future's ``get()`` raises the first piece's error while
        others may still move bytes, with no way to wait for them: a failed transfer's buffer was kept for good. On a
        full disk, where training goes on, every step's failed writes so kept their storages, a warning each
        (helper-161: 46 warnings, 12 MiB after three steps). tba cuts the transfer itself, each piece one call whose
        ``task_size`` is its size, which kvikio runs as one task (its single-task guard): the call's future ends when
        its bytes stop moving. :func:`_failure` waits for every piece, and only then is the buffer let go.
        """
        futures: list[Any] = []
        try:
            for start in range(0, nbytes, self._task_bytes):
                size = min(self._task_bytes, nbytes - start)
                futures.append(transfer(buffer[start:start + size], size, file_offset + start, size))
        except BaseException:
            _wait_all(futures)
            raise
        return futures

    def _finish_write(self, futures: list[Any], held: list[torch.Tensor], wrote: Callback) -> None:
        """Wait for kvikio's write, let go of its source (``held``), then report.

        Note: [A finished write lets go of its source]
        ``held`` is the one place the route keeps a write's source from the submission to the
        completion (the store may drop its own reference meanwhile, and kvikio must not lose the
        memory under its DMA). It is emptied before the completion is reported: a waiter (once a
        ``ThreadPoolExecutor``) keeps a job's arguments until after the job returns, and the write
        thread keeps its job until it returns, so a source passed to either directly could still be
        held when ``flush()`` saw the write finished (found while looking into an H200 failure of
        ``test_no_leak_over_twenty_steps[kvikio]``, which this did not explain: docs/gpu.md).
        """
        error = _failure(futures)
        held.clear()
        wrote(error)

    def _finish_read(self, futures: list[Any], held: list[torch.Tensor], on_done: ReadCallback) -> None:
        """Wait for kvikio's read, then hand its buffer to ``on_done`` (or the error)."""
        error = _failure(futures)
        if error is not None:
            held.clear()
            on_done(error, None, None)
        else:
            on_done(None, held.pop(), None)

    @staticmethod
    def _loop(jobs: queue.SimpleQueue) -> None:
        _sched.background()
        while True:
            job = jobs.get()
            if job is None:
                return
            try:
                job()
            except BaseException:  # noqa: BLE001 - a callback that raised must not stop every later transfer
                logger.exception("tba: a kvikio transfer's job failed")
            job = None  # Note [A worker keeps nothing of its last job] in tba/device/_staged_route.py

    def consume(self, event: Any, tensor: torch.Tensor) -> None:
        self.ops.consume(event, tensor)

    def stop(self) -> None:
        for jobs, thread in zip((self._writes, self._reads), self._threads):
            if thread.is_alive():
                jobs.put(None)
                thread.join()
        for thread in self._waiters:  # after the workers: no completion is queued any more
            if thread.is_alive():
                self._done.put(None)
        for thread in self._waiters:
            thread.join()
        with self._files_lock:
            for handle in self._files.values():
                handle.close()
            self._files.clear()

    def close(self) -> None:
        self.ops.close()


def _wait_all(futures: list[Any]) -> BaseException | None:
    """Wait for every one of kvikio's ``futures``; the first error any raised (Note [A transfer waits for every piece it
    started])."""
    first = None
    for future in futures:
        try:
            future.get()
        except BaseException as error:  # noqa: BLE001 - every piece is waited for before any error is reported
            first = first or error
    return first


def _failure(futures: list[Any]) -> BaseException | None:
    """None once every piece of a transfer succeeded; else the first error, once no piece moves any more."""
    error = _wait_all(futures)
    if error is None or isinstance(error, OSError) or names_cuda_error(error):  # a CUDA error: the GPU's, not the disk's
        return error
    # kvikio raises RuntimeError for I/O failures ("POSIX error on pwrite: No space left on device"); the store turns
    # OSError into TbaReadError, and a write's errno into its warning's cause and fix (one warning per cause).
    text = error_text(error)
    number = next((number for number in _NAMED_ERRNOS if os.strerror(number) in text), errno.EIO)
    return OSError(number, f"kvikio: {text}")


_NAMED_ERRNOS = (*FULL_DISK_ERRNOS, errno.EFBIG, errno.EROFS, errno.EIO)
"""The errnos whose text a kvikio error message is read for: those a failed write's warning names a fix for."""
