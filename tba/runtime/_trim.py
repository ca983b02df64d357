"""Give the memory of offloaded activations back to the kernel, so that freeing it early shows.

tba frees an activation's memory as soon as its write completes, in the middle of forward. With
glibc's default (adaptive) mmap threshold, tensors of a few MiB live in the heap, and a freed one
leaves a hole there that glibc neither returns to the kernel nor, in practice, reuses: the small
long-lived objects forward creates meanwhile (autograd nodes, tensor headers, tba's own entries)
are carved out of the hole, and the next tensor of the same size no longer fits. The heap grows
at its top for every activation, and the process's resident memory ends up where keeping every
activation would have put it. (A fixed ``MALLOC_MMAP_THRESHOLD_`` avoids this, but users do not
run with one.)

So the pages of a written storage that tba alone holds are handed back to the kernel
(:func:`discard_pages`, ``MADV_DONTNEED``) before tba drops it: the hole then holds no memory.
:class:`HeapTrimmer` can also count the bytes tba releases and, every
:func:`heap_trim_every_bytes` (``$TBA_HEAP_TRIM_EVERY_BYTES``, else
:data:`tba.defaults.HEAP_TRIM_EVERY_BYTES`), wake a background thread that calls glibc's
``malloc_trim(0)``, which hands every free page inside the heap back to the kernel; it is off by
default (Note [The heap trim is off]). Where the C library has no ``malloc_trim`` (musl, macOS) it
does nothing.

Note: [The heap trim is off]
The trim came first; the per-storage discard came later and does the same for tba's own storages,
at the moment each is freed. With both, the trim mostly handed back pages that the next
allocations then faulted in again, the program's own as much as tba's: 3.7 minor faults per
64 KiB storage in forward on ``bench-hooks``' loop (2000 storages, glibc), none without it; and
offload-all's worst-step peak was the same with and without it (``bench`` GPT 914 / 917 and
986 / 975 MiB, ``deep`` 367 / 365 and 379 / 376 MiB, trimming every 256 MiB against never, two
rounds alternating, glibc, a fresh process each). Storages below
:data:`tba.defaults.DISCARD_MIN_BYTES` are not discarded either (Note [Small storages keep their
pages]): glibc reuses their blocks for the next tensors of their size, which a forward of repeated
layers allocates in the same order.

Note: [Only glibc's malloc needs pages handed back]
Both workarounds exist for glibc's malloc (Note [Why tba cares which malloc serves the process] in
``tba/allocator.py``). Under a caching allocator (jemalloc, tcmalloc, mimalloc) a freed activation's
block is reused for the next one, so tba discards no pages and trims nothing: a discarded page would
only be faulted in again by the next activation placed there (see docs/cpu-memory.md for the
measurement). :func:`note_host_offload`, called at each CPU offload, names the allocator once per
process and, under glibc, logs one warning naming the fix and its cost.

Note: [Small storages keep their pages]
Handing pages back costs twice per page: ``madvise`` zaps them (with a TLB shootdown on every core
the process ran on), and the next allocation placed there faults them in again on the training
thread. For a storage of a few pages the call's fixed cost comes on top, and what it frees is
small. On ``python -m tba bench-hooks`` (glibc, 2000 storages of 64 KiB on ``/dev/shm``) the
discards took 22 µs per storage on the I/O thread and the refaults were a fifth of the training
thread's samples under ``perf``; without them the training thread's forward CPU fell from
121-135 to 95-97 µs per storage, three runs each, alternating. So only storages of at least
:data:`tba.defaults.DISCARD_MIN_BYTES` (256 KiB) are discarded; a smaller one is only freed, and
glibc reuses its block for the next tensor of its size (what it does not reuse stays resident: the
heap trim that would return it is off, Note [The heap trim is off]). The ``deep`` preset's 512 KiB
activations stay above the line: skipping those (a 1 MiB line) raised its bare activation peak from
0.77-0.81x to 0.82-0.87x of keep-all under glibc.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from tba import _sched, defaults
from tba._fork_lock import ForkSafeLock
from tba._units import SizeError, parse_size
from tba.allocator import LIBC_SONAME, detect
from tba.runtime._entry import storage_bytes

logger = logging.getLogger("tba")

GLIBC_WARNING = (
    "tba: this process allocates with glibc's malloc, which keeps freed activations' memory in its heap, so tba "
    "hands pages back to the kernel and they fault in again every step (measured on an 8-layer GPT: activation "
    "peak %s of keep-all at %s its step time, against %s at %s under tcmalloc). Run under a caching allocator: "
    "`python -m tba run script.py ...` (or LD_PRELOAD=libtcmalloc_minimal.so.4; see docs/cpu-memory.md)"
)
GLIBC_COST = ("0.57-0.64x", "1.15-1.33x", "0.20-0.25x", "0.99-1.13x")
"""Figures the glibc warning quotes: tba's peak and step time against keep-all under glibc, then under
tcmalloc (``tools/bench_e2e.py --preset bench --usage bare --allocator system|tcmalloc --steps 4``, the
bare adaptive context, 2026-11-26: three glibc runs, two tcmalloc; docs/cpu-memory.md). Under glibc the
plan keeps more layers: re-faulting the pages handed back makes offloading cost more there."""

_hand_back: bool | None = None
_noted = False
_note_lock = ForkSafeLock()


def hands_back_pages() -> bool:
    """Whether tba hands freed activation pages back to the kernel: not under a caching allocator.

    See Note [Only glibc's malloc needs pages handed back]; an unknown allocator is treated like glibc.
    """
    global _hand_back
    if _hand_back is None:
        _hand_back = not detect().caching
    return _hand_back


def note_host_offload() -> None:
    """Called at each CPU offload: the first one per process detects the allocator and, under glibc, warns once."""
    global _noted
    if _noted:
        return
    with _note_lock:
        if _noted:
            return
        _noted = True
    allocator = detect()
    logger.debug("tba: malloc serving this process: %s (%s)", allocator, allocator.path or "the C library")
    if allocator.name == "glibc":
        logger.warning(GLIBC_WARNING, *GLIBC_COST)


MADV_DONTNEED = 4
PAGE_BYTES = 4096


def _load_madvise():
    # glibc by its soname: ctypes.util.find_library("c") ran `ldconfig -p` twice per import (a fork of a process
    # holding torch). Without glibc (musl) neither call is used: no pages handed back, no heap trim.
    try:
        libc = ctypes.CDLL(LIBC_SONAME, use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


_madvise = _load_madvise()


def discard_pages(address: int, nbytes: int) -> int:
    """Hand the whole pages inside ``[address, address + nbytes)`` back to the kernel; returns bytes given.

    Only for memory about to be freed that nothing will read again: the pages read as zeros after.
    """
    start = -(-address // PAGE_BYTES) * PAGE_BYTES
    end = (address + nbytes) // PAGE_BYTES * PAGE_BYTES
    if _madvise is None or end - start < PAGE_BYTES or not hands_back_pages():
        return 0
    if _madvise(start, end - start, MADV_DONTNEED) != 0:
        return 0
    return end - start


def owns_its_memory(holder: torch.Tensor) -> bool:
    """Whether the memory of ``holder``'s storage is torch's own: freed by its allocator, seen by nobody else.

    Note: [Whose pages tba may discard]
    ``madvise(MADV_DONTNEED)`` makes private pages read as zeros. Torch's reference count only sees
    torch's owners, so the proof that nobody else reads the memory must come from how it was made:
    a storage with an allocator (``resizable()``) got its memory from torch's CPU allocator and
    gives it back through it; memory wrapped from outside (``torch.from_numpy``, DLPack,
    ``frombuffer``, ``from_file``, a C++ ``from_blob``) has a foreign deleter and is never resizable.
    Shared memory (``share_memory_()``, file mappings) is seen by other processes, and pinned memory
    is cached by its allocator: neither is touched either. Anything else is only dropped, never discarded.
    ``holder`` is any tensor on the storage: ``Tensor.is_pinned`` is one C call, where
    ``UntypedStorage.is_pinned`` builds a tensor first (several microseconds per saved tensor).
    """
    storage = holder.untyped_storage()
    if holder.device.type != "cpu" or not storage.resizable():
        return False
    try:
        return not storage.is_shared() and not holder.is_pinned()
    except RuntimeError:
        return False


def _sole_use_count() -> int:
    """``torch._C._storage_Use_Count`` of a storage held by one tensor only, read through a StorageWeakRef.

    Measured once rather than assumed: the count it reports includes references of torch's own
    that differ between versions.
    """
    tensor = torch.ones(1, device="cpu")  # a host storage whatever the program's default device
    ref = StorageWeakRef(tensor.untyped_storage())
    holder = storage_bytes(tensor.untyped_storage())  # as the store holds a storage
    del tensor
    count = torch._C._storage_Use_Count(ref.cdata)
    del holder
    return count


_SOLE_USE_COUNT = _sole_use_count()


def sole_owner(cdata: int) -> bool:
    """Whether exactly one tensor (tba's own) still refers to the storage behind the weak reference ``cdata``."""
    return torch._C._storage_Use_Count(cdata) == _SOLE_USE_COUNT


def _load_malloc_trim():
    try:
        libc = ctypes.CDLL(LIBC_SONAME)
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


HEAP_TRIM_ENV = "TBA_HEAP_TRIM_EVERY_BYTES"
"""Environment variable that turns the heap trim on for the process: bytes released between two trims, a
size string (``256M``) or a plain number; 0 or unset: :data:`tba.defaults.HEAP_TRIM_EVERY_BYTES` (off)."""


def heap_trim_every_bytes() -> int:
    """Bytes released between two heap trims of the process's trimmer (0: never), read from the environment now.

    ``$TBA_HEAP_TRIM_EVERY_BYTES`` when set, else :data:`tba.defaults.HEAP_TRIM_EVERY_BYTES`. A value that is
    not a size logs one warning and leaves the default (it is read at import and on tba's control thread at each
    entry, where raising would reach no caller), as ``$TBA_THREAD_POLICY`` does (``tba/_sched.py``).
    """
    global _warned_env
    text = os.environ.get(HEAP_TRIM_ENV, "").strip()
    if not text:
        return defaults.HEAP_TRIM_EVERY_BYTES
    try:
        return parse_size(text)
    except SizeError as err:
        if not _warned_env:
            _warned_env = True
            logger.warning("tba: %s: %s; the heap trim stays at its default (%d: off)", HEAP_TRIM_ENV, err,
                           defaults.HEAP_TRIM_EVERY_BYTES)
        return defaults.HEAP_TRIM_EVERY_BYTES


_warned_env = False


class HeapTrimmer:
    """Calls ``malloc_trim(0)`` on a background thread after every ``every_bytes`` released.

    Args:
        every_bytes: Bytes released between two trims; 0 disables trimming. None (the process's
            trimmer): :func:`heap_trim_every_bytes`, read again by each :meth:`refresh`.

    Note: [The trim interval is read once per with block]
    The process's trimmer read ``$TBA_HEAP_TRIM_EVERY_BYTES`` at every release: 1.7 of the 2.4 µs that
    :meth:`note_released` cost under glibc, twice per offloaded storage (its write, its read back), on
    tba's I/O thread. Each offloader's entry calls :meth:`refresh` instead, so a variable changed between
    two steps still takes effect at the next one.
    """

    def __init__(self, every_bytes: int | None = None) -> None:
        self.every_bytes = every_bytes
        self._setting = heap_trim_every_bytes() if every_bytes is None else every_bytes
        self.trims = 0
        """``malloc_trim`` calls made so far."""
        self._trim = _load_malloc_trim()
        self._pending_bytes = 0
        self._lock = ForkSafeLock()  # taken on tba's I/O threads: Note [A lock held at a fork] in tba/_fork_lock.py
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()

    @property
    def available(self) -> bool:
        """Whether this C library can trim its heap."""
        return self._trim is not None

    def refresh(self) -> None:
        """Read :func:`heap_trim_every_bytes` again (the process's trimmer; one with ``every_bytes`` keeps it)."""
        if self.every_bytes is None:
            self._setting = heap_trim_every_bytes()

    def note_released(self, nbytes: int) -> None:
        """``nbytes`` of memory were just released; trims once enough has accumulated."""
        every_bytes = self._setting
        if every_bytes <= 0 or self._trim is None or not hands_back_pages():  # off first: no call while off
            return
        with self._lock:
            self._pending_bytes += nbytes
            if self._pending_bytes < every_bytes:
                return
            self._pending_bytes = 0
            if self._thread is None or self._pid != os.getpid():
                self._pid = os.getpid()
                self._wake = threading.Event()
                self._thread = threading.Thread(target=self._run, name="tba-heap-trim", daemon=True)
                self._thread.start()
        self._wake.set()

    def _run(self) -> None:
        _sched.background()
        wake = self._wake
        while True:
            wake.wait()
            wake.clear()
            self._trim(0)
            self.trims += 1


trimmer = HeapTrimmer()
"""The process's trimmer, shared by every offloader."""
