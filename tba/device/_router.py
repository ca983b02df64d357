"""Which route a saved storage takes to the file, by device.

* Host (CPU) storages take the *host* route (``tba/device/_host.py``): their own memory goes to the
  host engine, reads land in pooled aligned buffers.
* CUDA storages take the *staged* route (``tba/device/_staged_route.py``): device -> pinned staging block
  -> host engine, with copies on side streams.
* With kvikio and GPUDirect Storage, CUDA storages take the *kvikio* route instead
  (``tba/device/_kvikio.py``): ``kvikio.CuFile`` writes device memory to the file and reads it back
  with no host copy.

``backend="kvikio"`` asks for the kvikio route (kvikio's compatibility mode is used where GDS is
missing); ``backend="auto"`` takes it only when GDS is really available, else the staged route.
Device routes are made on first use of a device and closed with the offloader.
"""

from __future__ import annotations

import logging

import torch

from tba.device._cuda import cuda_api
from tba.device._cuda_ops import CudaOps
from tba.device._host import HostRoute
from tba.device._kvikio import KvikioRoute, gds_unavailable_reason, kvikio_unavailable_reason
from tba.device._ops import DeviceOps, HostOps
from tba.device._pinned_pool import StagingPool
from tba.device._protocol import Route
from tba.device._staged_route import StagedRoute
from tba.errors import TbaConfigError
from tba.io import BufferPool, Engine

logger = logging.getLogger("tba")

DEVICE_TYPES = ("cpu", "cuda")
"""Device types whose storages can be offloaded; others stay in memory."""


def host_engine_backend(backend: str) -> str:
    """The host engine's backend for ``backend=``: ``"kvikio"`` is a route and uses the ``"auto"`` engine.

    Raises:
        TbaConfigError: ``"kvikio"`` was asked for where kvikio cannot run.
    """
    if backend == "kvikio":
        reason = kvikio_unavailable_reason()
        if reason is not None:
            raise TbaConfigError(f"backend 'kvikio' is not available: {reason}; use backend='auto'")
        return "auto"
    return backend


class Routes:
    """The routes of one offloader: the host route, and device routes made on first use.

    Args:
        backend: The offloader's backend name; ``"kvikio"`` forces the kvikio route for CUDA.
        engine: Host engine, for the host and staged routes.
        read_pool: Aligned read buffers of the host route.
        staging_bytes / block_bytes: Size of the staging pool and of one block (also the largest
            host request).
        device_ops: Ordering to use instead of the device's own (tests drive the staged route on
            CPU with an asynchronous fake).
        staged_devices: Device types that take the staged route. Default ``("cuda",)``.
    """

    def __init__(self, backend: object, engine: Engine, read_pool: BufferPool, staging_bytes: int, block_bytes: int,
                 device_ops: DeviceOps | None = None, staged_devices: tuple[str, ...] = ("cuda",)) -> None:
        self.backend = backend
        self.engine = engine
        self.staging_bytes = staging_bytes
        self.block_bytes = block_bytes
        self.device_ops = device_ops
        self.staged_devices = staged_devices
        self.host = HostRoute(engine, read_pool, block_bytes)
        self._routes: dict[torch.device, Route] = {}
        self.staging_pool: StagingPool | None = None
        cuda = cuda_api()
        if device_ops is None and cuda.device_type in staged_devices and cuda.is_available() and not self._kvikio():
            # Pinned and touched now, when the offloader opens, not inside the first pack mid-forward.
            self.staging_pool = StagingPool(staging_bytes, block_bytes)

    def _kvikio(self) -> bool:
        """Whether CUDA storages take the kvikio route."""
        return self.backend == "kvikio" or (self.backend == "auto" and gds_unavailable_reason() is None)

    def for_device(self, device: torch.device) -> Route:
        """The route for storages on ``device``."""
        if device.type not in self.staged_devices:
            return self.host
        route = self._routes.get(device)
        if route is None:
            route = self._routes[device] = self._make(device)
        return route

    def existing(self, device: torch.device) -> Route | None:
        """The route for storages on ``device`` if it exists already (None: :meth:`for_device` builds it).

        Safe on any thread; building a route is for the control thread (Note [Asynchronous exceptions]
        in ``tba/_control.py``).
        """
        return self._routes.get(device) if device.type in self.staged_devices else self.host

    def _make(self, device: torch.device) -> Route:
        on_cuda = device.type == cuda_api().device_type and cuda_api().is_available()
        ops = self.device_ops or (CudaOps(device) if on_cuda else HostOps())
        if on_cuda and self._kvikio():
            logger.info("tba: CUDA storages on %s go through kvikio", device)
            return KvikioRoute(ops)
        if self.staging_pool is None:
            self.staging_pool = StagingPool(self.staging_bytes, self.block_bytes)
        logger.info("tba: %s storages are staged through %d host blocks of %d bytes", device,
                    self.staging_pool.capacity_blocks, self.staging_pool.block_bytes)
        return StagedRoute(ops, self.engine, self.staging_pool)

    def stop(self) -> None:
        """Stop the device routes' own threads once their queued jobs have started their transfers.

        Call before closing the host engine; call :meth:`close` after it, so that completions
        still arriving from the engine can queue their device copies.
        """
        for route in self._routes.values():
            route.stop()

    def close(self) -> None:
        """Stop the device orderings' waiter threads after their queued callbacks. Idempotent.

        Note: [Closing after the device failed]
        A CUDA error that breaks the context (an illegal access anywhere in the process) makes every
        later CUDA call fail, ``cudaHostUnregister`` of the staging slab and a route's last
        synchronize included. The user has had that error already, from the call that met it; here
        it stopped the close halfway, with the spill file, the other routes and the waiter threads
        left open (the simulated broken context found it: Note [A broken context] in
        ``tba/device/sim/_faults.py``). So each route and the pool is closed whatever the others
        did, and a failure is logged as a warning, not raised over the user's own error.
        """
        routes, self._routes = list(self._routes.values()), {}
        closes = [route.close for route in routes] + ([self.staging_pool.close] if self.staging_pool is not None else [])
        for close in closes:
            try:
                close()
            except Exception as error:  # noqa: BLE001 - Note [Closing after the device failed]
                logger.warning("tba: closing a device route failed (%s); its CUDA resources may stay allocated "
                               "until the process ends", error)
