"""The CUDA calls tba makes, behind one narrow seam so that a simulated device can stand in for them.

tba's CUDA code (``_ops.py``, ``_staged_route.py``, ``_pinned_pool.py``, ``_kvikio.py``, the
offloader's pack) never calls ``torch.cuda`` directly: it calls :func:`cuda_api`, which is
:class:`TorchCuda` (plain ``torch.cuda``) unless a simulated device was installed with
:func:`use_cuda_api` (``tba/device/sim/``). The seam is only these few calls: streams, events,
the current stream, asynchronous copies, allocation on the current stream, ``record_stream``,
page-locked host memory, capture status and host synchronisation. Everything above it runs
unchanged on a GPU and on the simulator.

Note: [Device type]
The simulator's "CUDA" tensors are CPU tensors that it tracks by address; :attr:`CudaApi.device_type`
says which tensors are device tensors (``"cuda"`` on a GPU, ``"cpu"`` under the simulator).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch

from tba.device import _stream_calls

_FAST_STREAMS = _stream_calls.available()
"""Whether :class:`TorchCuda` reads and switches streams through torch's C bindings (Note [Stream calls cost
microseconds in Python] in tba/device/_stream_calls.py)."""


class TorchCuda:
    """``torch.cuda`` as tba uses it."""

    device_type = "cuda"
    simulated = False

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def Stream(self, device: torch.device) -> Any:  # noqa: N802 - mirrors torch.cuda.Stream
        return torch.cuda.Stream(device)

    def Event(self, blocking: bool = False) -> Any:  # noqa: N802 - mirrors torch.cuda.Event
        return torch.cuda.Event(blocking=blocking)

    def current_stream(self, device: torch.device | None = None) -> Any:
        if _FAST_STREAMS and torch.cuda.is_initialized():
            return _stream_calls.current_stream(device)
        return torch.cuda.current_stream(device)

    def stream(self, stream: Any) -> Any:
        if _FAST_STREAMS and stream is not None and torch.cuda.is_initialized():  # torch's stream(None) does nothing
            return _stream_calls.StreamContext(stream)
        return torch.cuda.stream(stream)

    def device(self, device: torch.device) -> Any:
        return torch.cuda.device(device)

    def is_current_stream_capturing(self) -> bool:
        return torch.cuda.is_current_stream_capturing()

    def synchronize(self, device: torch.device | None = None) -> None:
        torch.cuda.synchronize(device)

    def copy_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src)`` queued on the current stream."""
        dst.copy_(src, non_blocking=True)

    def empty(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """``nbytes`` of ``uint8`` from the caching allocator, for the current stream."""
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        tensor.record_stream(stream)

    def host_empty(self, nbytes: int) -> torch.Tensor:
        """Page-locked host memory from torch's host caching allocator (rounds up to a power of two)."""
        return torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=True)

    registered_bytes = 0
    """Host bytes page-locked by :meth:`pin` and not yet unpinned."""

    def pin(self, tensor: torch.Tensor) -> None:
        """Page-lock exactly ``tensor``'s bytes (``cudaHostRegister``); undo with :meth:`unpin`."""
        nbytes = tensor.numel() * tensor.element_size()
        code = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), nbytes, 0)
        if int(code) != 0:
            _drain_last_error()
            raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed with CUDA error {int(code)}")
        with _lock:
            TorchCuda.registered_bytes += nbytes

    def unpin(self, tensor: torch.Tensor) -> None:
        torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr())
        with _lock:
            TorchCuda.registered_bytes -= tensor.numel() * tensor.element_size()

    def memory_stats(self, device: torch.device | None = None) -> dict[str, int]:
        """Allocated, peak allocated and reserved device bytes, and page-locked host bytes."""
        host = torch.cuda.host_memory_stats() if hasattr(torch.cuda, "host_memory_stats") else {}
        return {"allocated_bytes": torch.cuda.memory_allocated(device),
                "peak_allocated_bytes": torch.cuda.max_memory_allocated(device),
                "reserved_bytes": torch.cuda.memory_reserved(device),
                "pinned_bytes": int(host.get("reserved_bytes.current", 0)) + self.registered_bytes}


CudaApi = TorchCuda
"""The interface; a simulated device implements the same methods."""

_TORCH = TorchCuda()
_lock = threading.Lock()
_current: Any = _TORCH


def cuda_api() -> Any:
    """The CUDA implementation in use: ``torch.cuda``, or the simulated device installed by :func:`use_cuda_api`."""
    return _current


def is_device_tensor(tensor: torch.Tensor, device_type: str | None = None) -> bool:
    """Whether ``tensor`` lives on the (possibly simulated) CUDA device.

    ``device_type`` is ``tensor.device.type`` when the caller has it already (each ``tensor.device``
    builds a new object: the pack hook reads it once per saved tensor).
    """
    api = _current
    return (device_type or tensor.device.type) == api.device_type and (api.simulated or tensor.is_cuda)


@contextlib.contextmanager
def use_cuda_api(api: Any) -> Iterator[Any]:
    """Install ``api`` (a simulated device) as :func:`cuda_api` for the block; restores the previous one."""
    global _current
    with _lock:
        previous, _current = _current, api
    try:
        yield api
    finally:
        with _lock:
            _current = previous


def _drain_last_error() -> None:
    """Clear the error a failed runtime call left as this thread's last CUDA error.

    Note: [A failed page-lock leaves CUDA's last error set]
    ``cudaHostRegister`` is called through ``torch.cuda.cudart()``, which returns its error code
    and leaves the runtime's per-thread last error set (torch's own checked calls clear it; this
    binding does not, and offers no ``cudaGetLastError``). torch reads that error after every kernel
    launch (``C10_CUDA_KERNEL_LAUNCH_CHECK``), so the next kernel of this thread, the user's forward,
    failed with the page-lock's "out of memory" after tba had already warned and staged through
    pageable memory instead (a review found it; the simulated device has no last error). One tiny
    kernel launched here reads the error and clears it; an error it raises is that one, or one of a
    context already broken, which the next kernel reports again.
    """
    try:
        torch.empty(1, dtype=torch.uint8, device="cuda").fill_(0)
        torch.cuda.synchronize()
    except RuntimeError:
        pass
