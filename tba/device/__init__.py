"""Device routes: how a saved storage's bytes travel between its device and the spill file.

One protocol (:class:`Route`, ``_protocol.py``) with three routes: the host route for CPU storages
(``_host.py``), the staged route through a pinned staging pool for CUDA storages (``_staged_route.py``,
``_pinned_pool.py``) and the kvikio route (``_kvikio.py``). :class:`DeviceOps` (``_ops.py``) is the
ordering contract of device copies (streams and events); :class:`Routes` (``_router.py``) picks the
route of each device.
"""

from tba.device._kvikio import gds_unavailable_reason, kvikio_unavailable_reason
from tba.device._ops import CudaOps, DeviceOps, HostOps
from tba.device._protocol import Route
from tba.device._router import DEVICE_TYPES, Routes, host_engine_backend

__all__ = [
    "DEVICE_TYPES", "CudaOps", "DeviceOps", "HostOps", "Route", "Routes", "gds_unavailable_reason",
    "host_engine_backend", "kvikio_unavailable_reason",
]
