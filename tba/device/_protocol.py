"""The route protocol: how the bytes of one storage travel between its memory and the spill file.

Every saved storage takes exactly one route, chosen by its device (``tba/device/_router.py``):

* :class:`~tba.device._host.HostRoute` for host (CPU) storages: straight from the storage's own
  memory to the file through the host engine, reads into pooled aligned buffers;
* :class:`~tba.device._staged_route.StagedRoute` for CUDA storages: device -> pinned staging block ->
  file, with copies on side streams;
* :class:`~tba.device._kvikio.KvikioRoute` for CUDA storages with kvikio: ``kvikio.CuFile``.

The store (``tba/runtime/_store.py``) only ever talks to this protocol: one write and one read
call per storage, and one completion callback for each, whatever the number of blocks or copies
underneath. A route reports a read's bytes together with a device event (None for host memory)
that the consumer must wait on before it uses them (:meth:`Route.consume`).
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Callable
from typing import Any

import torch

Callback = Callable[[BaseException | None], None]
"""``on_done(error)``: a transfer finished, ``error`` None when every byte moved."""
ReadCallback = Callable[[BaseException | None, Any, Any], None]
"""``on_done(error, data, event)``: a read finished; ``data`` is a ``uint8`` tensor of the storage's
bytes and ``event`` what a consumer must wait on (None for host memory)."""


class WriteNotNeeded(Exception):
    """What ``on_done`` hears when a queued write was skipped because ``wanted()`` said no.

    Note: [A write nobody needs is not started]
    A device route queues writes behind its staging pool or kvikio's threads, and a disk slower
    than forward leaves many queued when backward starts. Backward unpacks those storages from
    memory (their bytes are still resident) and then nothing needs them on disk: writing them only
    kept the step waiting for the disk (an offload-all profile step on a 1.9 GB/s disk took 78x
    keep-all's on an H100). A route asks the store once, before a write's first copy, whether the
    write still serves anything; if not, the storage simply stays in memory for its remaining views.
    It serves nothing once the storage is dead or every view of it was unpacked, nor while the
    prefetch window holds it in memory for backward (the last storages of forward, which backward
    needs first). Host storages' writes wait in tba's own queue and are asked the same
    (Note [Writes wait in tba's queue, not the engine's] in ``tba/runtime/_host_io.py``).
    """


WRITE_NOT_NEEDED = WriteNotNeeded("write skipped: backward already used the storage from memory")


def pieces(nbytes: int, piece_bytes: int) -> list[tuple[int, int]]:
    """``(start, length)`` pairs covering ``[0, nbytes)`` in pieces of at most ``piece_bytes``."""
    return [(start, min(piece_bytes, nbytes - start)) for start in range(0, nbytes, piece_bytes)]


class Countdown:
    """Calls ``on_done(first_error)`` after ``count`` calls to :meth:`done`, from any thread."""

    __slots__ = ("_lock", "_remaining", "_error", "_on_done")

    def __init__(self, count: int, on_done: Callback) -> None:
        self._lock = threading.Lock()
        self._remaining = count
        self._error: BaseException | None = None
        self._on_done = on_done

    def done(self, error: BaseException | None) -> None:
        with self._lock:
            if error is not None and self._error is None:
                self._error = error
            self._remaining -= 1
            finished = self._remaining == 0
        if finished:
            self._on_done(self._error)


class Route(abc.ABC):
    """Moves storages of one device to and from the spill file."""

    def phase_bytes(self, address: int) -> int:
        """Where the storage at ``address`` starts inside its first file block (see ``tba/runtime/_entry.py``)."""
        return 0

    def mark_ready(self) -> Any:
        """A mark of everything queued so far on the current stream: the storage's producer is before it.

        The pack hook calls it on the training thread, right after the producer was queued, and
        hands the mark to :meth:`write` on the control thread later (Note [A device save is deferred
        too] in ``tba/runtime/_hooks.py``). None where copies need no ordering (host memory).
        """
        return None

    @abc.abstractmethod
    def write(self, data: torch.Tensor, phase_bytes: int, fd: int, offset: int, on_done: Callback,
              ready: Any, wanted: Callable[[], bool] | None = None) -> None:
        """Write the ``uint8`` tensor ``data`` (a whole storage) to ``fd`` at ``offset + phase_bytes``.

        ``data`` stays referenced by the caller until ``on_done`` runs. ``ready`` is what
        :meth:`mark_ready` returned when the storage was produced; the copy starts after it. A route
        that queues writes asks ``wanted()`` before the first copy and, when it returns False,
        skips the write with ``on_done(WRITE_NOT_NEEDED)`` (Note [A write nobody needs is not started]).
        """

    @abc.abstractmethod
    def read(self, device: torch.device, nbytes: int, phase_bytes: int, fd: int, offset: int,
             on_done: ReadCallback) -> None:
        """Read ``nbytes`` written by :meth:`write` at ``offset`` into new memory on ``device``."""

    def consume(self, event: Any, tensor: torch.Tensor) -> None:
        """Make the current stream wait on a read's ``event`` before it uses ``tensor``."""

    def stop(self) -> None:
        """Stop the route's own threads once their queued jobs have started their transfers."""

    def close(self) -> None:
        """Stop helper threads that deliver completions (after the host engine closed). Idempotent."""
