"""The simulated device's caching allocator and page-locked host memory.

Device memory is one host arena. As in PyTorch's CUDA caching allocator, a block belongs to the
stream it was allocated on and goes back to that stream's free list when its last tensor dies; the
next allocation of that size on that stream gets it at once. Standing in for the next kernel, the
allocator then *poisons* the block on its stream (0xFF bytes): a copy on another stream that was
not ordered before the free reads or writes garbage, and the race checker sees the write. A block
used on other streams (``record_stream``) is held back until events recorded on those streams at
free time completed. Tensors are built over the arena without a reference to any tba tensor, and
their death is seen through a finalizer on the buffer they wrap, which takes no lock: the block is
given back at the next simulated CUDA call that queues work or allocates, on any thread, before that
call's own work, or when ``problems()`` or the memory statistics are read (Note [A device tensor's death
takes no lock]).

Pinned host memory: :meth:`PinnedHost.empty` behaves as torch's host caching allocator (each
request rounded up to a power of two); :meth:`PinnedHost.pin` page-locks exactly the bytes given
(``cudaHostRegister``). Both are counted.
"""

from __future__ import annotations

import ctypes
import queue
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from tba.io import aligned_empty, memory_view, round_up

BLOCK_ROUND_BYTES = 512
"""Device allocations are rounded up to this, as CUDA's caching allocator does."""
POISON_BYTE = 0xFF
"""What a freed block holds once the next kernel on its stream has run (NaN in floating types)."""


@dataclass
class _Block:
    offset: int
    nbytes: int
    stream: Any
    uses: set = field(default_factory=set)
    freed_for: tuple = ()
    """At its last free: the streams whose work queued before the free still gets the block (its own, and
    ``record_stream``'s)."""


def kept_for(block: _Block | None, stream: Any) -> bool:
    """Whether a copy queued on ``stream`` before ``block``'s storage died still gets the block.

    Note: [A freed block's pending copies]
    A storage that died while a copy was queued is a use after free unless CUDA's caching allocator
    keeps its block for that copy: the copy runs on the block's own stream (the next owner is queued
    there behind it), or its stream was marked with ``record_stream`` (the block is held until the
    stream passed the free). The simulator reported those too and dropped the copy, safe on a GPU
    (tests/device/test_sim_allocator_rules.py). Arena memory is never returned, so such a copy runs.
    Memory outside the arena (the model's tensors) has no block: a copy outliving it is reported.
    """
    return block is not None and any(stream is kept for kept in block.freed_for)


class CachingAllocator:
    """Per-stream free lists over one arena of ``capacity_bytes``."""

    def __init__(self, sim: Any, capacity_bytes: int) -> None:
        self.sim = sim
        self._arena = aligned_empty(capacity_bytes)
        self._base = self._arena.data_ptr()
        self._capacity = capacity_bytes
        self._top = 0
        self._lock = threading.RLock()
        self._free: dict[tuple[int, int], list[_Block]] = {}
        self._held: list[tuple[_Block, list[Any]]] = []
        self._by_address: dict[int, _Block] = {}
        self._dead: queue.SimpleQueue = queue.SimpleQueue()
        """Blocks whose storage died, not yet given back (Note [A device tensor's death takes no lock])."""
        self.allocations_by_stream: dict[str, int] = {}
        self.reserved_by_stream: dict[str, int] = {}
        self._watched: dict[int, tuple[Any, int, int]] = {}
        """Storages outside the arena that a copy touched, by storage: (weak reference, address, bytes)
        (Note [A freed model tensor is the next kernel's])."""
        self._used_on: dict[int, set[Any]] = {}
        """Streams marked with ``record_stream`` on a watched storage, by address."""
        self.record_stream_calls = 0
        self._allocated_bytes = 0
        self.peak_allocated_bytes = 0

    @property
    def reserved_bytes(self) -> int:
        return self._top

    @property
    def allocated_bytes(self) -> int:
        self.release_dead()
        return self._allocated_bytes

    def empty(self, nbytes: int, stream: Any) -> torch.Tensor:
        """``nbytes`` of ``uint8`` device memory for ``stream``."""
        size = round_up(max(nbytes, 1), BLOCK_ROUND_BYTES)
        with self._lock:
            self.release_dead()
            self._collect()
            free = self._free.get((id(stream), size))
            if free:
                block = free.pop()
            else:
                if self._top + size > self._capacity:
                    raise torch.OutOfMemoryError(f"simulated CUDA out of memory: {size} bytes asked, "
                                                 f"{self._capacity - self._top} of {self._capacity} left")
                block = _Block(self._top, size, stream)
                self._top += size
                self.reserved_by_stream[stream.name] = self.reserved_by_stream.get(stream.name, 0) + size
            self.allocations_by_stream[stream.name] = self.allocations_by_stream.get(stream.name, 0) + 1
            self._by_address[self._base + block.offset] = block
            self._allocated_bytes += size
            self.peak_allocated_bytes = max(self.peak_allocated_bytes, self._allocated_bytes)
        view = memory_view(self._base + block.offset, max(nbytes, 1))
        tensor = torch.frombuffer(view, dtype=torch.uint8)[:nbytes]
        weakref.finalize(view, self._died, block)
        return tensor

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        with self._lock:
            self.record_stream_calls += 1
            address = tensor.untyped_storage().data_ptr()
            block = self._by_address.get(address)
            if block is not None and stream is not block.stream:
                block.uses.add(stream)
            if block is None and any(watched[1] == address for watched in self._watched.values()):
                self._used_on.setdefault(address, set()).add(stream)  # Note [A freed model tensor is the next kernel's]

    def block_at(self, address: int) -> _Block | None:
        """The live block whose storage starts at ``address`` (None: not the arena's)."""
        with self._lock:
            return self._by_address.get(address)

    def _died(self, block: _Block) -> None:
        """The finalizer of a block's storage: it takes no lock (Note [A device tensor's death takes no lock]).

        Note: [A device tensor's death takes no lock]
        A storage dies wherever its last reference goes, and the cycle collector frees one in a cycle
        (a traceback's frames holding a read buffer) on whatever thread it runs, inside whatever locks
        that thread holds: the scheduler's among them, while it picks the next operation. This
        finalizer took the allocator's lock to give the block back and launch the poison, which takes
        the scheduler's lock; a thread holding the allocator's lock (an allocation, itself launching a
        poison) then waited for the scheduler's lock: a deadlock (a CI run hung until pytest's timeout
        in tests/device/test_sim_faults.py, whose failed backward leaves read buffers in traceback
        cycles). CUDA's allocator frees on the host thread, in C++, under a lock of its own alone. So
        the finalizer only notes which streams' work still gets the block (``freed_for``, read by
        queued copies) and queues the block; the next simulated CUDA call that queues work (a copy, an
        event's record or wait, a synchronize) or allocates, on any thread, gives it back
        (:meth:`release_dead`) before the race checker sees that call and before its own work is
        queued, as the real free would have been: an event recorded then carries the poison in its
        clock (a host that synchronized with it may write the block's next allocation), and
        ``problems()`` gives back first too (a race with the poison is not missed for want of a call).
        """
        block.freed_for = (block.stream, *block.uses)
        self._dead.put(block)

    def watch(self, ref: Any, address: int, nbytes: int) -> None:
        """Check the death of a storage outside the arena that a copy touches (Note [A freed model tensor is the
        next kernel's])."""
        with self._lock:
            old = self._watched.get(ref.cdata)
            if old is not None and old[0].expired():
                self._free_watched(*old)  # a new storage at the same place: the old one's death first
            self._watched[ref.cdata] = (ref, address, nbytes)

    def _free_watched(self, ref: Any, address: int, nbytes: int) -> None:
        """Note: [A freed model tensor is the next kernel's]
        The model's tensors are not the arena's: on a GPU their blocks come from the caching allocator
        too, and the next kernel on the producer's stream may overwrite one as soon as its last
        reference dies. A copy on another stream not ordered before that death (the host synchronized
        with it, or the stream waited for it) races with that kernel, even if in wall-clock time it
        already ran; the simulator reported it only when the copy had not run yet (a use after free),
        so whether a test saw the race depended on the scheduler's delays. Each storage outside the
        arena that a copy touched is watched; its death, seen at the next simulated call (Note [A
        device tensor's death takes no lock]), is a free to the stream that last wrote its bytes (the
        host, for memory page-locked by ``pin``), ordered after what the host has seen: every copy
        or kvikio transfer of another participant must be ordered before it, as before an arena
        block's poison (the model's own accesses are the model's business, and the last writer is
        only a guess at the stream the block would go back to); what a ``record_stream`` stream had
        queued at the death is ordered before it, as CUDA's allocator holds the block for that. The
        bytes then count as fresh: here the host's allocator, not the stream's, hands them out next,
        to any stream (tests/device/test_sim_model_tensor_free.py)."""
        streams = {stream.name for stream in self.sim.scheduler._streams} | {self.sim.default_stream.name}
        host = self.sim.pinned.holds(address)
        who = "host" if host else self.sim.checker.last_writer(address, nbytes, streams) or "host"
        if who != "host":
            self.sim.checker.launch(who)
        for stream in self._used_on.pop(address, ()):  # held until what is queued there now ran
            self.sim.checker.merge(who, self.sim.checker.snapshot(stream.name))
        self.sim.checker.free(who, address, nbytes, "the free of a storage a copy touched", of=("copy on ", "kvikio "))

    def _poll_watched(self) -> None:
        if not self._watched or self.sim.broken is not None:
            return
        with self._lock:
            dead = [key for key, (ref, _, _) in self._watched.items() if ref.expired()]
            for key in dead:
                self._free_watched(*self._watched.pop(key))

    def release_dead(self) -> None:
        """Give back the blocks whose storage died (Note [A device tensor's death takes no lock])."""
        self._poll_watched()
        if self._dead.empty():
            return
        with self._lock:
            while True:
                try:
                    block = self._dead.get_nowait()
                except queue.Empty:
                    return
                self._by_address.pop(self._base + block.offset, None)
                self._allocated_bytes -= block.nbytes
                if block.uses:
                    self._held.append((block, [self.sim.record(stream) for stream in block.uses]))
                    block.uses = set()
                else:
                    self._recycle(block)

    def _collect(self) -> None:
        """Blocks held for ``record_stream`` uses whose events completed go back to their free list."""
        still = []
        for block, tokens in self._held:
            if all(token.fired.is_set() for token in tokens):
                for token in tokens:
                    self.sim.checker.merge("host", token.clock)
                self._recycle(block)
            else:
                still.append((block, tokens))
        self._held = still

    def _recycle(self, block: _Block) -> None:
        address = self._base + block.offset
        self.sim.launch_write(block.stream, address, block.nbytes, "the next kernel on a freed block",
                              lambda: ctypes.memset(address, POISON_BYTE, block.nbytes))
        self._free.setdefault((id(block.stream), block.nbytes), []).append(block)


class PinnedHost:
    """Page-locked host memory, counted."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.pinned_bytes = 0
        self.peak_pinned_bytes = 0
        self._registered: dict[int, int] = {}

    def _add(self, nbytes: int) -> None:
        with self._lock:
            self.pinned_bytes += nbytes
            self.peak_pinned_bytes = max(self.peak_pinned_bytes, self.pinned_bytes)

    def empty(self, nbytes: int) -> torch.Tensor:
        """As torch's host caching allocator: the request rounded up to a power of two, kept for ever."""
        rounded = 1 << max(nbytes - 1, 0).bit_length()
        self._add(rounded)
        return aligned_empty(rounded)[:nbytes]

    def holds(self, address: int) -> bool:
        """Whether ``address`` is in host memory page-locked by :meth:`pin` now."""
        with self._lock:
            return any(start <= address < start + nbytes for start, nbytes in self._registered.items())

    def pin(self, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        with self._lock:
            if tensor.data_ptr() in self._registered:
                raise RuntimeError("CUDA error: part or all of the requested memory range is already mapped "
                                   "(cudaErrorHostMemoryAlreadyRegistered)")
            self._registered[tensor.data_ptr()] = nbytes
        self._add(nbytes)

    def unpin(self, tensor: torch.Tensor) -> None:
        with self._lock:
            nbytes = self._registered.pop(tensor.data_ptr(), None)
            if nbytes is None:
                raise RuntimeError("CUDA error: pointer does not correspond to a registered memory region "
                                   "(cudaErrorHostMemoryNotRegistered)")
            self.pinned_bytes -= nbytes
