"""The offload context: saved-tensor hooks that move activations to a file and back.

``with offload_activations(...)`` installs :func:`torch.autograd.graph.saved_tensors_hooks`.
Autograd calls :meth:`Offloader.pack` for every tensor it saves during forward and
:meth:`Offloader.unpack` when backward needs it again. The data path:

1. ``pack`` decides whether the tensor stays in memory (parameters, buffers, small or non-plain
   tensors) or goes to disk. For the disk path it finds or creates the :class:`StorageEntry` of
   the tensor's storage (Note [Dedup by storage identity]), returns a :class:`SavedView`, and
   queues the storage's blocks for writing straight from its memory.
2. When the last block of a storage is written, tba drops its reference to the storage, so the
   memory is freed as soon as nothing else in the program uses it.
3. During backward each ``unpack`` moves the prefetch window (``tba/prefetch.py``) and queues reads
   of the storages that backward will need next; ``unpack`` itself is served from memory when the
   bytes are still resident (write in flight, prefetched, or kept) and waits for a read otherwise.
4. When the last view of a storage is released by autograd, its file extent is freed for reuse;
   when no storage is left and the context has exited, the file and engine are closed.

Backward usually runs after the ``with`` block exits; everything stays valid for as long as the
autograd graph holds the views.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from concurrent.futures import Future
from typing import Any, Sequence

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from tba.engine import Engine, Op, Request, make_engine, resolve_backend
from tba.engine.base import ALIGN_BYTES
from tba.entry import SavedView, State, StorageEntry
from tba.errors import TbaConfigError, TbaError, TbaReadError
from tba.layers import LayerTracker, resolve_layers, state_storage_keys
from tba.pool import BufferPool
from tba.prefetch import DEFAULT_PREFETCH_BUDGET_BYTES, DEFAULT_PREFETCH_DEPTH_LAYERS, PrefetchWindow
from tba.spill import SpillFile
from tba.stats import BusyClock, OffloadStats

logger = logging.getLogger("tba")

DEFAULT_MIN_OFFLOAD_BYTES = 64 << 10
DEFAULT_BLOCK_SIZE_BYTES = 1 << 20
DEFAULT_QUEUE_DEPTH = 32

# Note: [Dedup by storage identity]
# A storage is recognised by its StorageImpl address (`untyped_storage()._cdata`), the same for
# every view of it, and never by its data pointer: the allocator hands a freed data pointer to the
# next allocation of that size, and a key built on it would serve one tensor's bytes for another.
# The entry holds a weak reference to the StorageImpl (StorageWeakRef), which keeps that address
# from being reused for as long as the entry exists, so a key match always means the same storage.
# The tensor's version counter is recorded too: a storage modified in place after it was saved is
# a new snapshot and gets a new entry.


class Offloader:
    """Offloads saved activations to a file while active; see :func:`offload_activations`.

    An ``Offloader`` built directly can be entered once per training step: its spill file and
    engine stay open between steps, so the file space freed by one step's backward is reused by
    the next step's forward. Call :meth:`close` when training ends. ``offload_activations()``
    builds a one-shot offloader instead, which closes itself once backward has released
    everything.
    """

    def __init__(
        self,
        directory: str | None = None,
        *,
        backend: str | Engine = "auto",
        min_offload_bytes: int = DEFAULT_MIN_OFFLOAD_BYTES,
        layers: nn.Module | Sequence[nn.Module] | None = None,
        prefetch_depth_layers: int = DEFAULT_PREFETCH_DEPTH_LAYERS,
        prefetch_budget_bytes: int = DEFAULT_PREFETCH_BUDGET_BYTES,
        block_size_bytes: int = DEFAULT_BLOCK_SIZE_BYTES,
        queue_depth: int = DEFAULT_QUEUE_DEPTH,
        direct_io: bool | None = None,
        reusable: bool = True,
    ) -> None:
        for name, value in (("min_offload_bytes", min_offload_bytes), ("prefetch_budget_bytes", prefetch_budget_bytes),
                            ("prefetch_depth_layers", prefetch_depth_layers)):
            if value < 0:
                raise TbaConfigError(f"{name} must be >= 0, got {value}")
        if block_size_bytes <= 0 or block_size_bytes % ALIGN_BYTES:
            raise TbaConfigError(f"block_size_bytes must be a positive multiple of {ALIGN_BYTES}, got {block_size_bytes}")
        if not isinstance(backend, Engine):
            resolve_backend(backend)
        self.directory = directory
        self.backend = backend
        self.min_offload_bytes = min_offload_bytes
        self.block_size_bytes = block_size_bytes
        self.queue_depth = queue_depth
        self.direct_io = direct_io
        self.reusable = reusable
        self.layers = resolve_layers(layers)
        self._stats = OffloadStats()
        self._tracker = LayerTracker(self.layers)
        self._state_keys = state_storage_keys(self.layers)
        self._window = PrefetchWindow(prefetch_depth_layers, prefetch_budget_bytes)
        self._pool = BufferPool(prefetch_budget_bytes)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        self._lock = threading.RLock()
        self._writes_done = threading.Condition(self._lock)
        self._writing = 0
        self._by_storage: dict[int, StorageEntry] = {}
        self._next_seq = 0
        self._live_entries = 0
        self._write_clock = BusyClock()
        self._read_clock = BusyClock()
        self._warned_write_error = False
        self._state = "idle"
        self.spill: SpillFile | None = None
        self.engine: Engine | None = None

    @property
    def stats(self) -> OffloadStats:
        """Counters so far (see :class:`OffloadStats`); bandwidths include transfers still running."""
        self._stats.write_busy_s = self._write_clock.busy_s
        self._stats.read_busy_s = self._read_clock.busy_s
        return self._stats

    # ----------------------------------------------------------------- context
    def __enter__(self) -> "Offloader":
        if self._state != "idle":
            raise TbaError(f"this Offloader cannot be entered now (it is {self._state}); use a new one")
        if self.spill is None:
            self.spill = SpillFile(self.directory, direct=self.direct_io)
            try:
                self.engine = make_engine(self.backend, queue_depth=self.queue_depth)
            except BaseException:
                self.spill.close()
                raise
        self._window.reset_cursor()
        self._tracker.attach()
        self._hooks.__enter__()
        self._state = "active"
        return self

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: object) -> None:
        self._hooks.__exit__(exc_type, exc, tb)
        self._tracker.detach()
        if exc_type is not None:
            self._discard()
            return
        self._state = "idle" if self.reusable else "exited"
        self._prefetch(None)
        with self._lock:
            finished = self._live_entries == 0 and self._state == "exited"
        if finished:
            self.close()

    def flush(self) -> None:
        """Block until every write queued so far has completed (or failed over to memory)."""
        with self._writes_done:
            self._writes_done.wait_for(lambda: self._writing == 0)

    def close(self) -> None:
        """Wait for in-flight I/O, then close the engine and the spill file. Idempotent.

        Saved tensors that were not read back yet can no longer be unpacked afterwards.
        """
        with self._lock:
            engine, self.engine = self.engine, None
            if self._state != "discarded":
                self._state = "closed"
        if engine is not None and engine is not self.backend:
            engine.close()
        if self.spill is not None:
            self.spill.close()
        with self._lock:
            for entry in self._by_storage.values():
                self._release(entry)
            self._by_storage.clear()
            self._pool.clear()

    def _discard(self) -> None:
        """Forward failed: drop every saved byte now; later unpacks raise."""
        self._state = "discarded"
        self.close()

    # ----------------------------------------------------------------- pack
    def keep_reason(self, tensor: torch.Tensor) -> str | None:
        """Why ``tensor`` stays in memory, or None when it goes to disk."""
        if type(tensor) is not torch.Tensor:
            return "parameter" if isinstance(tensor, nn.Parameter) else "tensor subclass"
        if tensor.layout is not torch.strided or tensor.is_nested or tensor.is_quantized or tensor.is_meta:
            return "not a plain strided tensor"
        if tensor.is_conj() or tensor.is_neg():
            return "lazy conjugate or negative view"
        if tensor.device.type != "cpu":
            return f"{tensor.device.type} tensor"
        base = tensor._base if tensor._is_view() else tensor
        if base.is_leaf and base.requires_grad:
            return "parameter"
        storage = tensor.untyped_storage()
        if storage._cdata in self._state_keys:
            return "parameter or buffer"
        if storage.nbytes() == 0 or storage.nbytes() < self.min_offload_bytes:
            return "small"
        if storage.data_ptr() % 64:
            return "storage not 64-byte aligned"
        return None

    def pack(self, tensor: torch.Tensor) -> Any:
        """Saved-tensor pack hook: a :class:`SavedView` for the disk path, else the tensor itself."""
        reason = self.keep_reason(tensor)
        if reason is not None:
            with self._lock:
                self._stats.tensors_kept += 1
                if reason not in ("parameter", "parameter or buffer"):
                    self._stats.bytes_kept += tensor.numel() * tensor.element_size()
            return tensor
        storage = tensor.untyped_storage()
        with self._lock:
            entry = self._by_storage.get(storage._cdata)
            if entry is None or entry.version != tensor._version or entry.state is State.DEAD or entry.ref.expired():
                entry = self._start_write(tensor, storage)
            else:
                self._stats.bytes_deduplicated += entry.nbytes
            entry.handles += 1
            self._stats.tensors_offloaded += 1
        return SavedView(self, entry, tensor)

    def _start_write(self, tensor: torch.Tensor, storage: torch.UntypedStorage) -> StorageEntry:
        address = storage.data_ptr()
        entry = StorageEntry(
            seq=self._next_seq,
            layer=self._tracker.current,
            nbytes=storage.nbytes(),
            phase_bytes=address % ALIGN_BYTES,
            version=tensor._version,
            ref=StorageWeakRef(storage),
            data=torch.empty((0,), dtype=torch.uint8).set_(storage),
        )
        self._next_seq += 1
        self._live_entries += 1
        self._by_storage[storage._cdata] = entry
        self._window.add(entry)
        self._resident(entry.nbytes)
        entry.offset = self.spill.allocate(entry.extent_bytes)
        self._writing += 1
        start = address - entry.phase_bytes
        self._submit(entry, Op.WRITE, start, self._on_write_block)
        return entry

    def _submit(self, entry: StorageEntry, op: Op, address: int, callback: Any) -> None:
        requests = [
            Request(op, self.spill.fd, address + start, nbytes, entry.offset + start)
            for start, nbytes in entry.blocks(self.block_size_bytes)
        ]
        entry.io_pending = len(requests)
        clock = self._write_clock if op is Op.WRITE else self._read_clock
        clock.start(len(requests))
        for future in self.engine.submit_many(requests):
            future.add_done_callback(functools.partial(callback, entry))

    def _on_write_block(self, entry: StorageEntry, future: Future) -> None:
        self._write_clock.stop()
        with self._lock:
            if not self._block_done(entry, future):
                return
            self._writing -= 1
            self._writes_done.notify_all()
            if entry.state is State.DEAD:
                self._free_extent(entry)
            elif entry.io_error is not None:
                self._keep_after_write_error(entry)
            else:
                entry.state = State.ON_DISK
                self._stats.storages_written += 1
                self._stats.bytes_written += entry.nbytes
                if not entry.wanted:
                    self._release(entry)

    def _block_done(self, entry: StorageEntry, future: Future) -> bool:
        """Count one finished block; True when it was the entry's last one."""
        error = future.exception()
        if error is not None and entry.io_error is None:
            entry.io_error = error
        entry.io_pending -= 1
        return entry.io_pending == 0

    def _keep_after_write_error(self, entry: StorageEntry) -> None:
        error, entry.io_error = entry.io_error, None
        entry.state = State.KEPT
        self._free_extent(entry)
        self._stats.tensors_kept_on_error += 1
        self._stats.bytes_kept_on_error += entry.nbytes
        if not self._warned_write_error:
            self._warned_write_error = True
            logger.warning(
                "tba: writing activations to %s failed (%s); keeping them in memory instead and "
                "training goes on (stats.bytes_kept_on_error counts them). Free space there or "
                "pass another directory.",
                self.spill.directory,
                error,
            )

    # ----------------------------------------------------------------- unpack
    def unpack(self, packed: Any) -> torch.Tensor:
        """Saved-tensor unpack hook: the saved tensor, bit for bit."""
        if not isinstance(packed, SavedView):
            return packed
        entry = packed.entry
        if self._state == "discarded":
            raise TbaError(
                f"{entry.describe()} was discarded because the offload context exited with an "
                "exception; run forward again"
            )
        if self._state == "closed":
            raise TbaError(f"cannot unpack {entry.describe()}: the offloader was closed before backward")
        with self._lock:
            data, done = entry.data, entry.read_done
            if data is None and done is None:
                done = self._start_read(entry)
        self._prefetch(entry)
        if data is None:
            data = self._wait_read(entry, done)
        else:
            with self._lock:
                self._stats.unpacks_from_memory += 1
        tensor = packed.rebuild(data)
        with self._lock:
            self._note_unpacked(entry)
        return tensor

    def _start_read(self, entry: StorageEntry) -> Future:
        """Queue the reads of ``entry``; the returned future resolves to its bytes (``entry.data``)."""
        buffer = self._pool.take(entry.extent_bytes)
        done = entry.read_done = Future()
        self._submit(entry, Op.READ, buffer.data_ptr(), functools.partial(self._on_read_block, buffer=buffer))
        return done

    def _on_read_block(self, entry: StorageEntry, future: Future, *, buffer: torch.Tensor) -> None:
        self._read_clock.stop()
        with self._lock:
            if not self._block_done(entry, future):
                return
            done, entry.read_done = entry.read_done, None
            error, entry.io_error = entry.io_error, None
            if entry.state is State.DEAD:
                self._free_extent(entry)
                done.cancel()
                return
            if error is not None:
                done.set_exception(error)
                return
            entry.data = self._pool.lease(buffer, entry.phase_bytes, entry.nbytes)
            self._resident(entry.nbytes)
            self._stats.bytes_read += entry.nbytes
            done.set_result(entry.data)

    def _wait_read(self, entry: StorageEntry, done: Future) -> torch.Tensor:
        start = time.perf_counter()
        try:
            data = done.result()
        except OSError as err:
            raise TbaReadError(
                f"cannot read back {entry.describe()}: spill file in {self.spill.directory}, "
                f"offset {entry.offset}, {entry.extent_bytes} bytes: {err}"
            ) from err
        with self._lock:
            self._stats.unpacks_waited += 1
            self._stats.unpack_wait_s += time.perf_counter() - start
        return data

    def _note_unpacked(self, entry: StorageEntry) -> None:
        """After the last view of a storage is unpacked, its bytes are not needed in memory."""
        entry.unpacked += 1
        if entry.unpacked < entry.handles:
            return
        entry.unpacked = 0
        entry.consumed = True
        entry.wanted = False
        if entry.state is State.ON_DISK:
            self._release(entry)

    def _prefetch(self, entry: StorageEntry | None) -> None:
        with self._lock:
            if self.engine is None:
                return
            to_read, to_hold = self._window.select(entry)
            for held in to_hold:
                held.wanted = True
            for target in to_read:
                self._start_read(target)

    # ----------------------------------------------------------------- lifetime
    def drop_view(self, entry: StorageEntry) -> None:
        """Called when autograd frees a :class:`SavedView`; frees the storage's extent after its last view."""
        with self._lock:
            entry.handles -= 1
            if entry.handles > 0:
                return
            if self._by_storage.get(entry.ref.cdata) is entry:
                del self._by_storage[entry.ref.cdata]
            entry.state = State.DEAD
            self._release(entry)
            self._window.forget(entry)
            if entry.io_pending == 0:
                self._free_extent(entry)
            self._live_entries -= 1
            if self._live_entries == 0:
                self._pool.clear()
            finished = self._live_entries == 0 and self._state == "exited"
        if finished:
            self.close()

    def _free_extent(self, entry: StorageEntry) -> None:
        if entry.offset >= 0:
            self.spill.free(entry.offset)
            entry.offset = -1

    def _release(self, entry: StorageEntry) -> None:
        if entry.data is not None:
            entry.data = None
            self._resident(-entry.nbytes)

    def _resident(self, delta_bytes: int) -> None:
        stats = self._stats
        stats.resident_bytes += delta_bytes
        stats.peak_resident_bytes = max(stats.peak_resident_bytes, stats.resident_bytes)


def offload_activations(directory: str | None = None, **options: Any) -> Offloader:
    """Offload the activations autograd saves inside the ``with`` block to files in ``directory``.

    Args:
        directory: Where the spill file lives. None (default) means ``$TBA_DIR``, else the system
            temp directory. Created if missing.
        backend: ``"auto"`` (default), ``"io_uring"``, ``"threads"``, or an :class:`Engine`.
        min_offload_bytes: Storages smaller than this stay in memory. Default 64 KiB.
        layers: The model's repeated blocks (a list of modules), or a module to search for them;
            used to tag storages for prefetch, and their parameters and buffers are never written.
        prefetch_depth_layers: Layers below the current one read ahead in backward. Default 1.
        prefetch_budget_bytes: Bound on bytes read ahead or held for backward. Default 512 MiB.
        block_size_bytes: Size of one I/O request, a multiple of 4096. Default 1 MiB.
        queue_depth: Requests in flight at once. Default 32.
        direct_io: True requires O_DIRECT, False disables it, None (default) uses it when the file
            system supports it and warns once otherwise.

    The returned offloader is one-shot: it closes its file once backward has released every
    saved tensor. To reuse one file across steps, build :class:`Offloader` once and enter it
    every step.

    Returns:
        The :class:`Offloader`; use it as a context manager and read ``.stats`` after backward.

    Raises:
        TbaConfigError: at the ``with`` line, for an unknown backend, a negative budget, or a
            directory that cannot be created or written.
    """
    return Offloader(directory, reusable=False, **options)
