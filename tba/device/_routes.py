"""Which route a saved storage takes to the file, by device.

* Host (CPU) storages take the *direct* route: the offloader hands their own memory to the host
  engine (``tba/offloader.py``); no route object is involved.
* CUDA storages take the *staged* route (``tba/staged.py``): device -> pinned staging block ->
  host engine, with copies on side streams.
* With kvikio and GPUDirect Storage, CUDA storages take the *kvikio* route instead: ``kvikio.CuFile``
  writes device memory to the file and reads it back with no host copy.

``backend="kvikio"`` asks for the kvikio route (kvikio's compatibility mode is used where GDS is
missing); ``backend="auto"`` takes it only when GDS is really available, else the staged route.
Routes are made on first use of a device and closed with the offloader.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
from typing import Any, Callable

import torch

from tba.device import Callback, CudaOps, DeviceOps, HostOps
from tba.engine.base import Engine
from tba.staged import ReadCallback, StagedRoute
from tba.staging import StagingPool

logger = logging.getLogger("tba")

DEVICE_TYPES = ("cpu", "cuda")
"""Device types whose storages can be offloaded; others stay in memory."""


@functools.cache
def kvikio_unavailable_reason() -> str | None:
    """None when kvikio can move CUDA memory to files here, else why not."""
    try:
        import kvikio  # noqa: F401
    except ImportError as err:
        return f"kvikio is not installed ({err}); pip install 'tba[gds]'"
    if not torch.cuda.is_available():
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


class KvikioRoute:
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

    def write(self, src: torch.Tensor, fd: int, offset: int, on_done: Callback) -> None:
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

    def read(self, device: torch.device, nbytes: int, fd: int, offset: int, on_done: ReadCallback) -> None:
        def start() -> None:
            try:
                dst = self.ops.empty(nbytes, device)
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

    def close(self) -> None:
        for jobs, thread in zip((self._jobs, self._waits), self._threads):
            jobs.put(None)
            thread.join()
        for handle in self._files.values():
            handle.close()
        self._files.clear()


class Routes:
    """The routes of one offloader, made per device on first use.

    Args:
        backend: The offloader's backend name; ``"kvikio"`` forces the kvikio route for CUDA.
        engine: Host engine, for the staged route.
        staging_bytes / block_bytes: Size of the staging pool and of one block.
        device_ops: Ordering to use instead of the device's own (tests drive the staged route on
            CPU with an asynchronous fake).
        staged_devices: Device types that take the staged route. Default ``("cuda",)``.
    """

    def __init__(self, backend: Any, engine: Engine, staging_bytes: int, block_bytes: int,
                 device_ops: DeviceOps | None = None, staged_devices: tuple[str, ...] = ("cuda",)) -> None:
        self.backend = backend
        self.engine = engine
        self.staging_bytes = staging_bytes
        self.block_bytes = block_bytes
        self.device_ops = device_ops
        self.staged_devices = staged_devices
        self._routes: dict[torch.device, Any] = {}
        self._pool: StagingPool | None = None

    def for_device(self, device: torch.device) -> StagedRoute | KvikioRoute | None:
        """The route for storages on ``device``; None means the direct host route."""
        if device.type not in self.staged_devices:
            return None
        route = self._routes.get(device)
        if route is None:
            route = self._routes[device] = self._make(device)
        return route

    def _make(self, device: torch.device) -> StagedRoute | KvikioRoute:
        ops = self.device_ops or (CudaOps(device) if device.type == "cuda" else HostOps())
        if device.type == "cuda" and (self.backend == "kvikio" or (self.backend == "auto" and gds_unavailable_reason() is None)):
            logger.info("tba: CUDA storages on %s go through kvikio", device)
            return KvikioRoute(ops)
        if self._pool is None:
            self._pool = StagingPool(self.staging_bytes, self.block_bytes)
        logger.info("tba: %s storages are staged through %d host blocks of %d bytes", device,
                    self._pool.capacity_blocks, self._pool.block_bytes)
        return StagedRoute(ops, self.engine, self._pool)

    def stop(self) -> None:
        """Stop the routes' own threads once their queued jobs have started their transfers.

        Call before closing the host engine; call :meth:`close` after it, so that completions
        still arriving from the engine can queue their device copies.
        """
        for route in self._routes.values():
            route.close()

    def close(self) -> None:
        """Stop the device orderings' waiter threads after their queued callbacks. Idempotent."""
        routes, self._routes = list(self._routes.values()), {}
        for route in routes:
            route.ops.close()
