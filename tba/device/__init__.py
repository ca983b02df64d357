"""Device routes: how a saved storage's bytes travel between its device and the spill file.

One protocol (:class:`Route`, ``_protocol.py``) with three routes: the host route for CPU storages
(``_host.py``), the staged route through a pinned staging pool for CUDA storages (``_staged_route.py``,
``_pinned_pool.py``) and the kvikio route (``_kvikio.py``). :class:`DeviceOps` (``_ops.py``) is the
ordering contract of device copies (streams and events); :class:`Routes` (``_router.py``) picks the
route of each device.
"""

from tba.device._cuda import CudaApi, cuda_api, is_device_tensor, use_cuda_api
from tba.device._cuda_ops import CudaOps
from tba.device._kvikio import gds_unavailable_reason, kvikio_unavailable_reason
from tba.device._ops import DeviceOps, HostOps
from tba.device._protocol import WRITE_NOT_NEEDED, Countdown, Route, WriteNotNeeded
from tba.device._router import DEVICE_TYPES, Routes, host_engine_backend

__all__ = [
    "DEVICE_TYPES", "Countdown", "CudaApi", "CudaOps", "DeviceOps", "HostOps", "Route", "Routes", "cuda_api",
    "gds_unavailable_reason", "host_engine_backend", "is_device_tensor", "kvikio_unavailable_reason",
    "use_cuda_api", "WRITE_NOT_NEEDED", "WriteNotNeeded",
]
