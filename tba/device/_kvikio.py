"""The kvikio route: CUDA storages straight to the file with ``kvikio.CuFile``, and back.

With GPUDirect Storage the NVMe drive reads and writes device memory by DMA, with no host copy;
without it kvikio's compatibility mode bounces through its own host buffers. Either way the route
never blocks the compute stream: a worker thread waits (host side) for the producer's event, starts
the kvikio transfer, and a waiter thread waits for kvikio's future and reports completion.

``backend="kvikio"`` asks for this route (compatibility mode where GDS is missing);
``backend="auto"`` takes it only when GDS is really available (:func:`gds_unavailable_reason`).
"""

from __future__ import annotations

import functools
import queue
import threading
from collections.abc import Callable
from typing import Any

import torch

from tba.device._cuda import cuda_api
from tba.device._ops import CudaOps
from tba.device._protocol import Callback, ReadCallback, Route


@functools.cache
def kvikio_unavailable_reason() -> str | None:
    """None when kvikio can move CUDA memory to files here, else why not."""
    try:
        import kvikio  # noqa: F401
    except ImportError as err:
        return f"kvikio is not installed ({err}); pip install 'tba[gds]'"
    if not cuda_api().is_available():
        return "no CUDA device"
    return None


@functools.cache
def gds_unavailable_reason() -> str | None:
    """None when GPUDirect Storage is really available (not kvikio's compatibility mode)."""
    reason = kvikio_unavailable_reason()
    if reason is not None:
        return reason
    import kvikio
    import kvikio.defaults

    try:
        if kvikio.defaults.is_compat_mode_preferred():
            return "kvikio runs in compatibility mode (no GDS driver or file system support)"
        if not kvikio.DriverProperties().is_gds_available:
            return "the cuFile driver reports GDS unavailable"
    except (RuntimeError, AttributeError) as err:
        return f"cannot query GDS support: {err}"
    return None


class KvikioRoute(Route):
    """CUDA storages straight to the file with ``kvikio.CuFile`` (GDS, or kvikio's compatibility mode).

    A worker thread waits for the producer's event (host side, off the compute stream), starts the
    kvikio transfer, and a waiter thread waits for kvikio's future and reports completion.
    """

    def __init__(self, ops: CudaOps) -> None:
        import kvikio

        self._kvikio = kvikio
        self.ops = ops
        self._files: dict[int, Any] = {}
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._waits: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._loop, args=(self._jobs,), name="tba-kvikio", daemon=True),
            threading.Thread(target=self._loop, args=(self._waits,), name="tba-kvikio-wait", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def _file(self, fd: int) -> Any:
        if fd not in self._files:
            self._files[fd] = self._kvikio.CuFile(f"/proc/self/fd/{fd}", "r+")
        return self._files[fd]

    def write(self, src: torch.Tensor, phase_bytes: int, fd: int, offset: int, on_done: Callback) -> None:
        ready = self.ops.mark_ready()

        def start() -> None:
            try:
                ready.synchronize()
                future = self._file(fd).pwrite(src, src.numel(), offset)
            except BaseException as error:
                on_done(error)
                return
            self._waits.put(functools.partial(self._finish, future, lambda: on_done(None), on_done))

        self._jobs.put(start)

    def read(self, device: torch.device, nbytes: int, phase_bytes: int, fd: int, offset: int,
             on_done: ReadCallback) -> None:
        def start() -> None:
            try:
                dst = self.ops.empty_for_host(nbytes, device)
                future = self._file(fd).pread(dst, nbytes, offset)
            except BaseException as error:
                on_done(error, None, None)
                return
            self._waits.put(functools.partial(self._finish, future, lambda: on_done(None, dst, None),
                                              lambda error: on_done(error, None, None)))

        self._jobs.put(start)

    @staticmethod
    def _finish(future: Any, ok: Callable[[], None], failed: Callable[[BaseException], None]) -> None:
        try:
            future.get()
        except BaseException as error:
            failed(error)
            return
        ok()

    @staticmethod
    def _loop(jobs: queue.SimpleQueue) -> None:
        while True:
            job = jobs.get()
            if job is None:
                return
            job()

    def consume(self, event: Any, tensor: torch.Tensor) -> None:
        self.ops.consume(event, tensor)

    def stop(self) -> None:
        for jobs, thread in zip((self._jobs, self._waits), self._threads):
            jobs.put(None)
            thread.join()
        for handle in self._files.values():
            handle.close()
        self._files.clear()

    def close(self) -> None:
        self.ops.close()
