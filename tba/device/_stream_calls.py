"""The current CUDA stream, read and switched through torch's C bindings instead of its Python wrappers.

Note: [Stream calls cost microseconds in Python]
On H200 hosts (docs/gpu.md, "The fifth run") ``torch.cuda.current_stream(device)`` took 3.0 µs (7.4
without the device) and entering and leaving ``torch.cuda.stream(s)`` 10-16 µs; here they take 0.36
and 1.8 µs. The wrappers look up the device index, build a new ``Stream`` object on every call and, in
the context, read the current stream twice more. tba makes one such call per pack and per unpack
on the training thread, and three stream contexts per staged storage on its own threads, where
every microsecond of Python holds the GIL against the training thread (issue 25).

:func:`current_stream` asks ``torch._C._cuda_getCurrentStream`` and keeps one ``Stream`` object per
stream it has seen (a few: the compute streams and tba's side streams; the cache is emptied past
:data:`CACHED_STREAMS`). :class:`StreamContext` does what ``torch.cuda.stream(s)`` does: ``s``
becomes current on its own device, which becomes the thread's device, and both are restored on
exit. Where torch lacks a binding (a CPU build, or a later torch that renamed it) :func:`available`
is False and tba calls the wrappers (``tba/device/_cuda.py``).
"""

from __future__ import annotations

from typing import Any

import torch

CACHED_STREAMS = 64
"""Stream objects :func:`current_stream` keeps, one per (stream id, device index, device type)."""

_BINDINGS = ("_cuda_getCurrentStream", "_cuda_setStream", "_cuda_getDevice", "_cuda_setDevice")

_streams: dict[tuple[int, int, int], Any] = {}


def available() -> bool:
    """Whether this torch has every C binding used here."""
    return all(hasattr(torch._C, name) for name in _BINDINGS)


def device_index(device: torch.device | None) -> int:
    """``device``'s index, or the thread's current CUDA device for None or an index-less device."""
    if device is not None and device.index is not None:
        return device.index
    return torch._C._cuda_getDevice()


def current_stream(device: torch.device | None = None) -> Any:
    """The thread's current stream on ``device`` (as ``torch.cuda.current_stream(device)``)."""
    key = torch._C._cuda_getCurrentStream(device_index(device))
    stream = _streams.get(key)
    if stream is None:
        stream = torch.cuda.Stream(stream_id=key[0], device_index=key[1], device_type=key[2])
        if len(_streams) >= CACHED_STREAMS:
            _streams.clear()
        _streams[key] = stream
    return stream


class StreamContext:
    """``with StreamContext(s):`` makes ``s`` the current stream, as ``torch.cuda.stream(s)`` does.

    On entry ``s`` becomes current on its device and that device the thread's current device; on
    exit the stream that was current on ``s``'s device, and the device that was current, return.
    """

    __slots__ = ("stream", "_previous_stream", "_previous_device")

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self._previous_stream: tuple[int, int, int] | None = None
        self._previous_device = -1

    def __enter__(self) -> Any:
        stream = self.stream
        self._previous_device = torch._C._cuda_getDevice()
        self._previous_stream = torch._C._cuda_getCurrentStream(stream.device_index)
        torch._C._cuda_setStream(stream_id=stream.stream_id, device_index=stream.device_index,
                                 device_type=stream.device_type)
        return stream

    def __exit__(self, *exc_info: object) -> None:
        stream_id, index, device_type = self._previous_stream
        torch._C._cuda_setStream(stream_id=stream_id, device_index=index, device_type=device_type)
        if self._previous_device != index:
            torch._C._cuda_setDevice(self._previous_device)
