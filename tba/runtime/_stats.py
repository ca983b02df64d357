"""Counters an offload context keeps, readable at any time as ``offloader.stats``.

Byte counters are exact. Bandwidths divide bytes by the wall-clock time during which at least one
transfer of that direction was in flight, so idle gaps between layers do not dilute them.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

from tba.defaults import MIB


@dataclasses.dataclass
class OffloadStats:
    """What an offload context did.

    Attributes:
        tensors_offloaded: Saved tensors served from a storage on the offload path (dedup hits
            included).
        storages_written: Distinct storages written to the spill file.
        tensors_kept: Saved tensors kept in memory (parameters, buffers, small or non-strided
            tensors, CUDA tensors until the CUDA route exists).
        bytes_kept: Bytes of the kept tensors that are not parameters or buffers.
        bytes_written / bytes_read: Payload bytes moved to and from the spill file.
        bytes_deduplicated: Bytes not written again because their storage was already saved.
        tensors_kept_on_error / bytes_kept_on_error: Storages whose write failed (for example
            a full disk) and which stayed in memory instead.
        writes_skipped / bytes_write_skipped: Storages whose queued write never started because
            the storage had died, backward had already used it from memory, or the prefetch window
            held it in memory for backward (Note [A write nobody needs is not started] in
            ``tba/device/_protocol.py``); a live one stayed in memory for its remaining views.
        unpacks_from_memory: Unpacks served without a read (write still in flight, prefetched
            copy resident, kept, or the storage still held by the program).
        unpacks_from_live_storage: Of those, unpacks of written storages the program still held,
            served from their own memory instead of read back (Note [A storage the program still
            holds is not read back] in ``tba/runtime/_reads.py``).
        unpacks_waited: Unpacks that had to wait for a read to finish.
        unpack_wait_s: Total seconds backward waited on reads.
        resident_bytes / peak_resident_bytes: Bytes of offload-path storages tba held in memory
            now / at the worst moment.
        write_busy_s / read_busy_s: Seconds during which writes / reads were in flight.
        read_buffers_allocated / read_buffers_reused: Host read buffers allocated fresh / taken
            again from the read pool.
        staging_blocks_in_use: Pinned staging blocks not returned to their pool (0 when idle).
        bytes_verified: Bytes read back whose checksum was checked (``verify=True``).
        kept_by_reason / bytes_kept_by_reason: ``tensors_kept`` and ``bytes_kept`` split by
            :class:`tba.KeepReason` value (``"small"``, ``"layer kept by policy"``, ...).
        allocator: The malloc serving this process (``"glibc"``, ``"jemalloc"``, ``"tcmalloc"``,
            ``"mimalloc"``, ...; :func:`tba.allocator.detect`). Under glibc, freed activations' pages are
            handed back to the kernel and fault in again every step; see docs/cpu-memory.md.
    """

    tensors_offloaded: int = 0
    storages_written: int = 0
    tensors_kept: int = 0
    bytes_kept: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    bytes_deduplicated: int = 0
    tensors_kept_on_error: int = 0
    bytes_kept_on_error: int = 0
    writes_skipped: int = 0
    bytes_write_skipped: int = 0
    unpacks_from_memory: int = 0
    unpacks_from_live_storage: int = 0
    unpacks_waited: int = 0
    unpack_wait_s: float = 0.0
    resident_bytes: int = 0
    peak_resident_bytes: int = 0
    write_busy_s: float = 0.0
    read_busy_s: float = 0.0
    read_buffers_allocated: int = 0
    read_buffers_reused: int = 0
    bytes_verified: int = 0
    staging_blocks_in_use: int = 0
    kept_by_reason: dict[str, int] = dataclasses.field(default_factory=dict)
    bytes_kept_by_reason: dict[str, int] = dataclasses.field(default_factory=dict)
    allocator: str = ""

    def count_kept(self, reason: str, nbytes: int) -> None:
        """One more tensor kept in memory for ``reason``, holding ``nbytes`` of activations (0 for state)."""
        key = str(reason)
        self.tensors_kept += 1
        self.bytes_kept += nbytes
        self.kept_by_reason[key] = self.kept_by_reason.get(key, 0) + 1
        self.bytes_kept_by_reason[key] = self.bytes_kept_by_reason.get(key, 0) + nbytes

    @property
    def write_gbps(self) -> float:
        """Write bandwidth in GB/s (1e9 bytes per second) while writes were in flight."""
        return self.bytes_written / self.write_busy_s / 1e9 if self.write_busy_s else 0.0

    @property
    def read_gbps(self) -> float:
        """Read bandwidth in GB/s while reads were in flight."""
        return self.bytes_read / self.read_busy_s / 1e9 if self.read_busy_s else 0.0

    def since(self, earlier: OffloadStats) -> OffloadStats:
        """The counters accumulated after ``earlier`` (a copy taken before); the gauges
        ``resident_bytes``, ``peak_resident_bytes`` and ``staging_blocks_in_use``, and ``allocator``,
        are this object's."""
        gauges = ("resident_bytes", "peak_resident_bytes", "staging_blocks_in_use", "allocator")
        out = OffloadStats()
        for field in dataclasses.fields(self):
            mine, theirs = getattr(self, field.name), getattr(earlier, field.name)
            if field.name in gauges:
                value = mine
            elif isinstance(mine, dict):
                value = {k: v - theirs.get(k, 0) for k, v in mine.items() if v != theirs.get(k, 0)}
            else:
                value = mine - theirs
            setattr(out, field.name, value)
        return out

    def as_dict(self) -> dict[str, Any]:
        """All counters plus the two bandwidths, for logging or JSON."""
        out = dataclasses.asdict(self)
        out["write_gbps"] = self.write_gbps
        out["read_gbps"] = self.read_gbps
        return out

    def __str__(self) -> str:
        return (
            f"written {self.bytes_written / MIB:.1f} MiB ({self.write_gbps:.2f} GB/s), "
            f"read {self.bytes_read / MIB:.1f} MiB ({self.read_gbps:.2f} GB/s), "
            f"dedup {self.bytes_deduplicated / MIB:.1f} MiB, "
            f"offloaded {self.tensors_offloaded} / kept {self.tensors_kept} tensors, "
            f"peak resident {self.peak_resident_bytes / MIB:.1f} MiB, malloc {self.allocator or 'unknown'}"
        )


class BusyClock:
    """Accumulates the wall-clock time during which at least one transfer is in flight."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._inflight = 0
        self._since = 0.0
        self.busy_s = 0.0

    def start(self, count: int = 1) -> None:
        with self._lock:
            if self._inflight == 0:
                self._since = time.perf_counter()
            self._inflight += count

    def stop(self, count: int = 1) -> None:
        with self._lock:
            self._inflight -= count
            if self._inflight == 0:
                self.busy_s += time.perf_counter() - self._since

    def forget_after_fork(self) -> None:
        """In a forked child: the parent's transfers in flight never end here (Note [A forked child's
        clocks count none of the parent's transfers] in ``tba/runtime/_store_lifetime.py``)."""
        self._lock = threading.Lock()
        self._inflight = 0
