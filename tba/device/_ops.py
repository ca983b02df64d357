"""Ordering of device copies: streams, events, and who waits for what.

The staged route (``tba/device/_staged_route.py``) moves a device storage through host staging blocks. Its
ordering rules, which keep the compute stream free of synchronisation:

* pack records an event on the *current* stream: the producer of the tensor;
* each device-to-host copy runs on a dedicated *side* stream that first waits on that event;
* the device memory is released only after the copies (and the file writes) completed, which a
  waiter thread learns by synchronising on the copy's event (host-side, off the hot path);
* reads land in host blocks, then host-to-device copies run on a *prefetch* stream into memory
  allocated on the *compute* stream (the stream packs ran on), after the prefetch stream waited for
  an event recorded there at allocation; an event is recorded after the last copy;
* unpack makes the consuming (current) stream wait on that event. The tensor belongs to the compute
  stream's pool, so memory backward frees serves it and no ``record_stream`` is needed (only when
  another stream consumes it); the route holds it until its copies completed.

:class:`DeviceOps` is that contract. :class:`~tba.device._cuda_ops.CudaOps` implements it with torch streams and events;
:class:`HostOps` is the degenerate case for host tensors (copies are synchronous). Tests drive the
state machine with an asynchronous fake on CPU.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any

import torch

from tba.device._protocol import Callback

HostCopy = tuple[torch.Tensor, torch.Tensor, Any]
"""``(src, dst, after)``: one device-to-host copy of :meth:`DeviceOps.copy_to_host_many`."""


class DeviceOps(abc.ABC):
    """Asynchronous copies between device storages and host blocks, ordered by events."""

    @abc.abstractmethod
    def mark_ready(self) -> Any:
        """An event recorded on the current stream: everything queued so far (the producer) is before it."""

    @abc.abstractmethod
    def copy_to_host(self, src: torch.Tensor, dst: torch.Tensor, after: Any) -> Any:
        """Queue ``dst.copy_(src)`` behind event ``after``; returns the copy's completion event."""

    def copy_to_host_many(self, copies: Sequence[HostCopy]) -> tuple[Any, int, BaseException | None]:
        """Queue :meth:`copy_to_host` for each ``(src, dst, after)`` in order, until one raises.

        Returns an event that completes after every copy queued, how many were queued, and the error
        of the one that raised (None when all were). Copies run in queue order on one stream, so
        the last copy's event stands for all of them.
        """
        event = None
        for queued, (src, dst, after) in enumerate(copies):
            try:
                event = self.copy_to_host(src, dst, after)
            except BaseException as error:
                return event, queued, error
        return event, len(copies), None

    @abc.abstractmethod
    def empty(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """A ``uint8`` tensor of ``nbytes`` on ``device`` that :meth:`copy_to_device` may fill."""

    def empty_many(self, sizes: Sequence[int], device: torch.device) -> list[torch.Tensor]:
        """:meth:`empty` for each of ``sizes``."""
        return [self.empty(nbytes, device) for nbytes in sizes]

    def empty_for_host(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """As :meth:`empty`, for a writer outside stream order (kvikio): returns once it may write."""
        return self.empty(nbytes, device)

    @abc.abstractmethod
    def copy_to_device(self, src: torch.Tensor, dst: torch.Tensor) -> Any:
        """Queue ``dst.copy_(src)`` on the prefetch stream; returns its completion event."""

    def copy_to_device_many(self, copies: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> tuple[Any, int, BaseException | None]:
        """Queue :meth:`copy_to_device` for each ``(src, dst)`` in order, until one raises.

        Returns an event after every copy queued, how many were, and the error (None when all were).
        """
        event = None
        for queued, (src, dst) in enumerate(copies):
            try:
                event = self.copy_to_device(src, dst)
            except BaseException as error:
                return event, queued, error
        return event, len(copies), None

    @abc.abstractmethod
    def when_done(self, event: Any, callback: Callback) -> None:
        """Call ``callback(None)`` once ``event`` completed (``callback(error)`` if it failed), off the caller's thread."""

    @abc.abstractmethod
    def consume(self, event: Any, tensor: torch.Tensor) -> None:
        """Make the current stream wait on ``event`` before it uses ``tensor``."""

    def drain(self) -> None:
        """Wait until every completion queued so far was delivered (before the host engine closes)."""

    def close(self) -> None:
        """Stop helper threads. Idempotent."""


class HostOps(DeviceOps):
    """Host tensors: every copy completes before it returns, so events are None."""

    def mark_ready(self) -> None:
        return None

    def copy_to_host(self, src: torch.Tensor, dst: torch.Tensor, after: Any) -> None:
        dst.copy_(src)

    def empty(self, nbytes: int, device: torch.device) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def copy_to_device(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        dst.copy_(src)

    def when_done(self, event: Any, callback: Callback) -> None:
        callback(None)

    def consume(self, event: Any, tensor: torch.Tensor) -> None:
        return None
