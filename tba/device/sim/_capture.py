"""CUDA-graph capture on the simulated device (a base of :class:`~tba.device.sim._device.SimulatedCuda`).

:meth:`GraphCapture.graph_capture` is the capture of the current stream (``torch.cuda.graph``): events recorded in it
are captured (synchronising on them is an error), streams that wait on them join the capture, and the capture fails
if one of them never rejoins, as on a GPU. The device's ``record``, ``stream_wait``, ``empty`` and ``synchronize``
ask :meth:`GraphCapture._captured` and ``_capture`` what a call means while a capture runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tba.device.sim._streams import Scheduler, SimStream, Token


class GraphCapture:
    """The capture state and calls of :class:`~tba.device.sim._device.SimulatedCuda`, which sets every attribute."""

    _capture: SimStream | None
    _captured_events: list[Token]
    captured_operations: int
    scheduler: Scheduler

    def current_stream(self, device: Any = None) -> SimStream:
        raise NotImplementedError  # the device's

    def _captured(self, stream: SimStream) -> bool:
        if stream.joined_capture or (self._capture is not None and stream is self._capture):
            self.captured_operations += 1
            return True
        return False

    def is_current_stream_capturing(self) -> bool:
        return self._capture is not None and self.current_stream() is self._capture

    def _joined(self) -> list[SimStream]:
        return [s for s in self.scheduler._streams if s.joined_capture]

    @contextlib.contextmanager
    def graph_capture(self) -> Iterator[None]:
        """Capture the current stream (``torch.cuda.graph``); fails at the end if a joined stream never rejoined."""
        if self._capture is not None:
            raise RuntimeError("a capture is already under way")
        self._capture = self.current_stream()
        try:
            yield
        finally:
            self._capture = None
            unjoined = self._joined()
            for stream in unjoined:
                stream.joined_capture = False
            self._captured_events = []
        if unjoined:
            raise RuntimeError(f"CUDA error: capturing stream has unjoined work (cudaErrorStreamCaptureUnjoined): "
                               f"{', '.join(s.name for s in unjoined)} waited on the capture and never rejoined it")
