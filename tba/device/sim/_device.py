"""The simulated CUDA device: :func:`simulate` installs it behind :func:`tba.device.cuda_api`.

Device tensors are CPU tensors (``device_type == "cpu"``); memory tba allocates on the device
comes from the caching allocator (``_allocator.py``). Copies are queued by address with weak
references to both storages: when the copy runs, a storage that died meanwhile is a use after
free (reported, and the copy does not touch it), as a kernel reading memory the caching allocator
already handed to someone else. Every access is checked for ordering (``_checker.py``); the model's
own operators are seen by a dispatch mode as accesses on the current stream (``_compute.py``).

CUDA-graph capture: ``_capture.py``. Injected faults and a broken context: ``_faults.py`` (Notes [Injected CUDA
faults], [A broken context]).
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from tba.device._cuda import use_cuda_api
from tba.device.sim._allocator import CachingAllocator, PinnedHost, kept_for
from tba.device.sim._capture import GraphCapture
from tba.device.sim._checker import HOST, HappensBefore
from tba.device.sim._compute import ComputeAccesses
from tba.device.sim._config import SimConfig
from tba.device.sim._faults import FaultInjection
from tba.device.sim._streams import Scheduler, SimEvent, SimStream, Token

INTERNAL_THREADS = ("tba", "fake")
"""Names of the threads of tba, of the simulator and of the fake kvikio, which run no model operators."""


class SimulatedCuda(FaultInjection, GraphCapture):
    """The CUDA calls of :class:`tba.device.CudaApi` on a simulated device; see the module docstring."""

    device_type = "cpu"
    simulated = True

    def __init__(self, config: SimConfig | None = None) -> None:
        self.config = config or SimConfig()
        self.checker = HappensBefore()
        self.errors: list[str] = []
        self.busy_wait_syncs = 0
        self.captured_operations = 0
        self._lock = threading.Lock()
        self._local = threading.local()
        self._names = 0
        self.scheduler = Scheduler(self.config.seed, self.config.max_delay_s, self.config.lag_probability,
                                   self.config.max_lag_s)
        # Note: [The compute stream lags too]
        # A GPU runs the compute stream behind the host. With a synchronous compute stream, memory
        # freed on it was already "overwritten by the next kernel" when the host got it back, so a
        # writer outside stream order (kvikio) that skipped waiting for the allocation's point on
        # the stream could not be caught. The model's operators still run on the host, each after
        # what is queued before it on its stream (``_compute.py``); without ``track_compute`` no
        # dispatch mode sees them, and the compute stream stays synchronous.
        lagging = self.config.lagging_compute and self.config.track_compute
        self.default_stream = self._new_stream("compute", synchronous=not lagging)
        self.allocator = CachingAllocator(self, self.config.memory_bytes)
        self.pinned = PinnedHost()
        self._capture: SimStream | None = None
        self._captured_events: list[Token] = []
        self.entering_thread: int | None = None
        """The thread whose operators the dispatch mode sees (set by :func:`simulate` with ``track_compute``)."""
        self._faults: dict[str, list[Any]] = {}
        """Injected faults by call kind: ``[calls to let through, failures left (None: sticky), error]``."""
        self.faults_raised = 0
        self.broken: BaseException | None = None
        """The error of a broken context (Note [A broken context] in ``tba/device/sim/_faults.py``); None: it works."""
        self.checking_compute = True
        """Whether the model's operators are checked now (tests may sample steps: it costs ~0.4 ms per operator)."""

    # ------------------------------------------------------------- bookkeeping
    def fail(self, message: str) -> None:
        with self._lock:
            self.errors.append(message)

    def note_busy_wait(self) -> None:
        with self._lock:
            self.busy_wait_syncs += 1

    def problems(self) -> list[str]:
        """Races, uses after free and hangs seen so far (a storage that died since the last call counted)."""
        self.allocator.release_dead()  # Note [A device tensor's death takes no lock] in tba/device/sim/_allocator.py
        return self.checker.races + self.errors

    def _new_stream(self, role: str, synchronous: bool = False) -> SimStream:
        with self._lock:
            self._names += 1
            stream = SimStream(self, f"stream{self._names}-{role}", synchronous)
        if not synchronous:
            self.scheduler.add(stream)
        return stream

    # ------------------------------------------------------------- streams and events
    def _launch(self, stream: SimStream, op: Callable[[], None]) -> None:
        if self.broken is not None:
            return  # Note [A broken context] in tba/device/sim/_faults.py: nothing queued runs
        if stream.synchronous:
            op()
        else:
            self.scheduler.launch(stream, op)

    def record(self, stream: SimStream) -> Token:
        """A token that fires when ``stream`` reaches this point."""
        self.allocator.release_dead()  # before the token's clock: it covers the poison queued ahead of it
        self.checker.launch(stream.name)
        token = Token(self.scheduler, self.checker.snapshot(stream.name))
        token.stream = stream
        if self._captured(stream):
            token.captured = True
            self._captured_events.append(token)
            return token
        self._launch(stream, token.fire)
        return token

    def stream_wait(self, stream: SimStream, event: SimEvent) -> None:
        token = event.token
        if token is None:
            return
        if self._capture is not None:
            if stream is self._capture or stream.joined_capture or token.captured:
                self.captured_operations += 1
                if stream is self._capture and token.captured and token.stream is not stream:
                    token.stream.joined_capture = False
                elif stream is not self._capture:
                    stream.joined_capture = True
                return
        self.check_alive()
        self.allocator.release_dead()  # Note [A device tensor's death takes no lock] in tba/device/sim/_allocator.py
        self.checker.launch(stream.name)
        self.checker.merge(stream.name, token.clock)
        if stream.synchronous:
            self.wait_token(token, f"{stream.name} waiting for an event")
        else:
            self.scheduler.launch(stream, token)

    def launch_write(self, stream: SimStream, address: int, nbytes: int, what: str, op: Callable[[], None]) -> None:
        """Device work on ``stream`` that writes ``nbytes`` at ``address`` (the allocator's poison)."""
        if self.broken is not None:
            return  # Note [A broken context] in tba/device/sim/_faults.py: no kernel runs
        self.checker.launch(stream.name)
        self.checker.access(stream.name, address, nbytes, True, what)
        self._launch(stream, op)

    # ------------------------------------------------------------- the CudaApi calls
    def is_available(self) -> bool:
        return True

    def Stream(self, device: Any = None) -> SimStream:  # noqa: N802 - mirrors torch.cuda.Stream
        self.check_alive()
        return self._new_stream("async")

    def Event(self, blocking: bool = False) -> SimEvent:  # noqa: N802 - mirrors torch.cuda.Event
        self.check_alive()
        return SimEvent(self, blocking)

    def current_stream(self, device: Any = None) -> SimStream:
        stream = getattr(self._local, "stream", None)
        if stream is None and self.entering_thread is not None and threading.get_ident() != self.entering_thread:
            self._note_unseen_thread()
        return stream or self.default_stream

    def _note_unseen_thread(self) -> None:
        """Note: [Operators of another thread are not simulated]
        The dispatch mode that puts the model's operators on the compute stream (``_compute.py``) is the
        entering thread's: a step run in another thread ran its operators at once, ahead of the copies
        queued before them into tba's read buffers, and read the allocator's poison (NaN gradients)
        while :meth:`problems` stayed empty. Such a step is reported instead of passing for checked."""
        thread = threading.current_thread()
        if thread.name.startswith(INTERNAL_THREADS) or getattr(self._local, "unseen_noted", False):
            return
        self._local.unseen_noted = True
        self.fail(f"thread {thread.name!r} ran tba's device code, but only the thread that entered simulate() has its "
                  "operators ordered on the simulated compute stream; run the step on that thread (or track_compute=False)")

    @contextlib.contextmanager
    def stream(self, stream: SimStream | None) -> Iterator[None]:
        previous = getattr(self._local, "stream", None)
        if stream is not None:
            self._local.stream = stream
        try:
            yield
        finally:
            self._local.stream = previous

    def device(self, device: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def synchronize(self, device: Any = None) -> None:
        self.check_alive()
        if self._capture is not None:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing (cudaDeviceSynchronize)")
        for stream in list(self.scheduler._streams):
            stream.synchronize()

    def copy_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src)`` on the current stream, by address; both ``uint8`` and contiguous."""
        if dst.numel() != src.numel() or dst.dtype != torch.uint8 or src.dtype != torch.uint8 or not (
                dst.is_contiguous() and src.is_contiguous()):
            raise RuntimeError("the simulated device copies contiguous uint8 tensors of one size")
        self.maybe_fail("copy")
        stream = self.current_stream()
        if self._captured(stream):
            return
        nbytes, dst_at, src_at = dst.numel(), dst.data_ptr(), src.data_ptr()
        storages = (dst.untyped_storage(), src.untyped_storage())
        refs = tuple(StorageWeakRef(storage) for storage in storages)
        blocks = tuple(self.allocator.block_at(storage.data_ptr()) for storage in storages)
        for storage, ref, block in zip(storages, refs, blocks):  # Note [A freed model tensor is the next kernel's]
            if block is None:
                self.allocator.watch(ref, storage.data_ptr(), storage.nbytes())
        del storages
        self.allocator.release_dead()  # Note [A device tensor's death takes no lock] in tba/device/sim/_allocator.py
        self.checker.launch(stream.name)
        self.checker.access(stream.name, src_at, nbytes, False, f"copy on {stream.name}")
        self.checker.access(stream.name, dst_at, nbytes, True, f"copy on {stream.name}")

        def run() -> None:
            alive = [torch.UntypedStorage._new_with_weak_ptr(ref.cdata) for ref in refs]
            # Note [A freed block's pending copies] in tba/device/sim/_allocator.py
            if any(storage is None and not kept_for(block, stream) for storage, block in zip(alive, blocks)):
                self.fail(f"use after free: a copy on {stream.name} ran after its "
                          f"{'destination' if alive[0] is None else 'source'} was freed")
                return
            ctypes.memmove(dst_at, src_at, nbytes)
            del alive

        self._launch(stream, run)

    def empty(self, nbytes: int, device: Any = None) -> torch.Tensor:
        if self._capture is not None and self.current_stream() is not self._capture:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing (allocation "
                               "from another stream during capture)")
        self.check_alive()
        return self.allocator.empty(nbytes, self.current_stream())

    def record_stream(self, tensor: torch.Tensor, stream: SimStream) -> None:
        self.allocator.record_stream(tensor, stream)

    def host_empty(self, nbytes: int) -> torch.Tensor:
        self.maybe_fail("host_empty")
        return self.pinned.empty(nbytes)

    def pin(self, tensor: torch.Tensor) -> None:
        self.maybe_fail("pin")
        self.pinned.pin(tensor)

    def unpin(self, tensor: torch.Tensor) -> None:
        """Note: [Unpinning waits for nothing]
        ``cudaHostUnregister`` is not documented to wait for the DMA still moving bytes of the range, which turns
        pageable: every copy of it must be ordered before (tests/device/test_sim_model_tensor_free.py)."""
        self.check_alive()
        self.allocator.release_dead()
        self.pinned.unpin(tensor)
        self.checker.free(HOST, tensor.data_ptr(), tensor.numel() * tensor.element_size(),
                          "the unpinning of page-locked memory", of=("copy on ",))

    def memory_stats(self, device: Any = None) -> dict[str, int]:
        return {"allocated_bytes": self.allocator.allocated_bytes,
                "peak_allocated_bytes": self.allocator.peak_allocated_bytes,
                "reserved_bytes": self.allocator.reserved_bytes, "pinned_bytes": self.pinned.pinned_bytes}

    def host_access(self, address: int, nbytes: int, write: bool, what: str) -> None:
        """A host thread (the file engine) reads or writes device-visible memory."""
        self.checker.access(HOST, address, nbytes, write, what)

    def stall(self, held: bool = True) -> None:
        """Hold every asynchronous stream (``held=False`` lets them run again): side streams lagging without end."""
        self.scheduler.held = held
        self.scheduler.wake()

    # ------------------------------------------------------------- lifetime
    def close(self) -> None:
        self.scheduler.stop()


@contextlib.contextmanager
def simulate(config: SimConfig | None = None, **fields: Any) -> Iterator[SimulatedCuda]:
    """Run the block on a simulated CUDA device (``config`` or :class:`SimConfig` fields)."""
    config = config or SimConfig(**fields)
    sim = SimulatedCuda(config)
    mode = ComputeAccesses(sim) if config.track_compute else contextlib.nullcontext()
    if config.track_compute:
        sim.entering_thread = threading.get_ident()
    try:
        with use_cuda_api(sim), mode:
            yield sim
    finally:
        sim.close()
