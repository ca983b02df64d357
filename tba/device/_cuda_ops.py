"""CUDA streams and events behind :class:`~tba.device._ops.DeviceOps` (the ordering rules are in ``_ops.py``).

Completions are learned by *waiter* threads, one per stream tba copies on, that synchronise on each
copy's event in queue order and run its callback: off the training thread, which never waits here.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Sequence
from typing import Any

import torch

from tba import _sched
from tba.device._cuda import cuda_api
from tba.device._ops import DeviceOps, HostCopy
from tba.device._protocol import Callback

logger = logging.getLogger("tba")


class _Done:
    """An event that has completed (a marker in a waiter's queue)."""

    def synchronize(self) -> None:
        return None


_DONE = _Done()


class _Waiter:
    """One thread that synchronises on events in queue order and runs their callbacks.

    A callback that raises is logged and the thread goes on: every later copy must still complete,
    or no storage is released and ``flush()`` waits for ever.
    """

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, event: Any, callback: Callback) -> None:
        self._queue.put((event, callback))

    def _run(self) -> None:
        _sched.background()
        while True:
            item = self._queue.get()
            if item is None:
                return
            event, callback = item
            try:
                event.synchronize()
            except BaseException as error:
                outcome: BaseException | None = error
            else:
                outcome = None
            try:
                callback(outcome)
            except BaseException:
                logger.exception("tba: a device copy's completion callback failed")
            # Note [A worker keeps nothing of its last job] in tba/device/_staged_route.py.
            item = event = callback = outcome = None

    def drain(self) -> None:
        """Wait until the callbacks queued so far ran."""
        if self._thread.is_alive():
            done = threading.Event()
            self._queue.put((_DONE, lambda error: done.set()))
            done.wait()

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join()


class CudaOps(DeviceOps):
    """CUDA streams and events for one device (through :func:`~tba.device._cuda.cuda_api`).

    Every event is created with ``blocking=True``: the waiter threads (and the kvikio worker)
    synchronise on them, and a default event's ``synchronize()`` spins a CPU core until it fires.

    Args:
        device: The CUDA device of the tensors this handles.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = cuda_api()
        self.side_stream = self.cuda.Stream(device)
        self.prefetch_stream = self.cuda.Stream(device)
        self.compute_stream = self.cuda.current_stream(device)
        self._waiters = {"side": _Waiter("tba-d2h-wait"), "prefetch": _Waiter("tba-h2d-wait")}
        self._closed = False
        self._read_streams: list[Any] = []
        """Every stream a read-back buffer was allocated on (Note [A read buffer's own stream])."""

    def mark_ready(self) -> Any:
        self.compute_stream = current = self.cuda.current_stream(self.device)
        event = self.cuda.Event(blocking=True)
        event.record(current)
        return event

    # Note: [A stream context selects its device]
    # Every copy, allocation and record here runs inside ``cuda.stream(s)`` with a stream of
    # ``self.device``: ``torch.cuda.stream`` makes ``s`` current on its own device (it switches the
    # thread's device when ``s`` lives elsewhere and restores it after), and events are recorded
    # on an explicit stream. The ``cuda.device(self.device)`` entered around each of them as well
    # was redundant: three more Python calls and two device exchanges in torch per copy, on the
    # stager and the engine's completion thread (issue 25, docs/gpu.md "The fourth run").

    def copy_to_host(self, src: torch.Tensor, dst: torch.Tensor, after: Any) -> Any:
        cuda = self.cuda
        with cuda.stream(self.side_stream):  # Note [A stream context selects its device]
            self.side_stream.wait_event(after)
            cuda.copy_(dst, src)
            return self._event_after_copies(self.side_stream)

    # Note: [An event that cannot be recorded after queued copies]
    # The caller of a copy learns when its memory is free again only from the event recorded after
    # the copy. When creating or recording that event raises (``cudaErrorMemoryAllocation``, or a
    # context broken meanwhile), the copies queued before it may still be pending: the caller then
    # hears an error and gives back the staging block and the sources (the store drops a dead
    # storage, and the caching allocator hands it to the next kernel) while the stream still reads
    # and writes them. On the simulated device: the next kernel on a freed block not ordered after
    # the side stream's copy, and a copy that ran after its source was freed
    # (tests/device/test_sim_faults.py). So the stream is synchronised before the error goes up: the
    # copies have run, or the context is broken and runs nothing more, and the memory is free.

    def _event_after_copies(self, stream: Any) -> Any:
        """A blocking event recorded on ``stream`` after the copies just queued (Note [An event that cannot be
        recorded after queued copies])."""
        cuda = self.cuda
        try:
            done = cuda.Event(blocking=True)
            done.record(stream)
        except BaseException:
            try:
                stream.synchronize()
            except BaseException:  # the context is broken: the queued copies will not run either
                logger.exception("tba: cannot wait for copies queued before a failed event record")
            raise
        return done

    def copy_to_host_many(self, copies: Sequence[HostCopy]) -> tuple[Any, int, BaseException | None]:
        return self._queue_copies(self.side_stream, copies)

    def _queue_copies(self, stream: Any, copies: Sequence[HostCopy]) -> tuple[Any, int, BaseException | None]:
        """Queue each ``dst.copy_(src)`` on ``stream``, behind its ``after`` event when one is given, until one
        raises; one stream context and one event after those queued for the lot (Note [Storages queued together
        share a block] in tba/device/_block_groups.py)."""
        cuda = self.cuda
        queued, error = 0, None
        with cuda.stream(stream):  # Note [A stream context selects its device]
            for src, dst, after in copies:
                try:
                    if after is not None:
                        stream.wait_event(after)
                    cuda.copy_(dst, src)
                except BaseException as copy_error:
                    error = copy_error
                    break
                queued += 1
            if not queued:
                return None, 0, error
            done = self._event_after_copies(stream)
        return done, queued, error

    # Note: [Read-back memory belongs to the compute stream]
    # Allocated on the prefetch stream, read-back tensors lived in a pool that memory freed by
    # backward on the compute stream could never serve: under pressure the allocator freed cached
    # blocks (a device-wide sync) mid-backward, and the record_stream of every unpack delayed reuse.
    # Allocated on the compute stream, the block's previous users ran there: the prefetch stream
    # waits for an event recorded on the compute stream after the allocation before copying in.

    def _allocate(self, nbytes: int, device: torch.device) -> tuple[torch.Tensor, Any]:
        cuda = self.cuda
        stream = self.compute_stream
        with cuda.stream(stream):
            tensor = cuda.empty(nbytes, device)
            allocated = cuda.Event(blocking=True)
            allocated.record(stream)
        if not any(known == stream for known in self._read_streams):
            self._read_streams.append(stream)
        return tensor, allocated

    def empty(self, nbytes: int, device: torch.device) -> torch.Tensor:
        tensor, allocated = self._allocate(nbytes, device)
        self.prefetch_stream.wait_event(allocated)
        return tensor

    def empty_many(self, sizes: Sequence[int], device: torch.device) -> list[torch.Tensor]:
        # One stream context, event and wait for the lot (Note [Storages queued together share a block]).
        cuda = self.cuda
        stream = self.compute_stream
        with cuda.stream(stream):
            tensors = [cuda.empty(nbytes, device) for nbytes in sizes]
            allocated = cuda.Event(blocking=True)
            allocated.record(stream)
        if not any(known == stream for known in self._read_streams):
            self._read_streams.append(stream)
        self.prefetch_stream.wait_event(allocated)
        return tensors

    def empty_for_host(self, nbytes: int, device: torch.device) -> torch.Tensor:
        tensor, allocated = self._allocate(nbytes, device)
        allocated.synchronize()
        return tensor

    def copy_to_device(self, src: torch.Tensor, dst: torch.Tensor) -> Any:
        cuda = self.cuda
        with cuda.stream(self.prefetch_stream):
            cuda.copy_(dst, src)
            done = self._event_after_copies(self.prefetch_stream)
        done._tba_stream = "prefetch"
        return done

    def copy_to_device_many(self, copies: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> tuple[Any, int, BaseException | None]:
        done, queued, error = self._queue_copies(self.prefetch_stream, [(src, dst, None) for src, dst in copies])
        if done is not None:
            done._tba_stream = "prefetch"
        return done, queued, error

    def when_done(self, event: Any, callback: Callback) -> None:
        self._waiters[getattr(event, "_tba_stream", "side")].put(event, callback)

    # Note: [A read buffer's own stream]
    # ``compute_stream`` follows the stream of the latest pack, so it can change between a read's
    # allocation and its unpack: a forward under ``torch.cuda.stream(s)`` whose loss is computed on
    # the default stream ends with a default-stream pack, the reads prefetched then are allocated on
    # the default stream, and a second forward under ``s`` (gradient accumulation) moves
    # ``compute_stream`` back to ``s`` before backward unpacks them on ``s``. Comparing the consumer
    # with ``compute_stream`` then skipped the ``record_stream``, and a buffer freed after backward
    # went back to the default stream's pool while ``s`` still read it (the simulated device's race
    # checker: the next kernel on the freed block not ordered after ``aten::mm`` on ``s``). The
    # consumer is now compared with every stream a read buffer was allocated on: ``record_stream``
    # is skipped only when all of them (and the producers' stream) are the consumer itself. Torch
    # ignores a ``record_stream`` on the allocation stream, so a needless one costs only its call.

    def consume(self, event: Any, tensor: torch.Tensor) -> None:
        current = self.cuda.current_stream(self.device)
        if event is not None:
            current.wait_event(event)
        if current != self.compute_stream or any(stream != current for stream in self._read_streams):
            self.cuda.record_stream(tensor, current)

    def drain(self) -> None:
        for waiter in self._waiters.values():
            waiter.drain()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            for waiter in self._waiters.values():
                waiter.stop()
