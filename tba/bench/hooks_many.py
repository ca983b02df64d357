"""The large-count check of ``python -m tba bench-hooks --many``: backward over many storages on the disk.

``count`` storages of ``size_bytes`` are saved in one forward and written to the disk directory, then one
backward reads them all back; its time is compared with the same loop without tba. To hold ``count`` x 64 KiB
without three copies of it in memory, the leaves are :data:`LEAVES_IN_MANY` tensors reused in turn and each
output is reduced by ``sum()`` at once (so only the saved outputs, which tba moves to the file, hold memory).

Note: [The disk's floor under the many-storage ratio]
Backward must read back every byte forward wrote (a few hundred MiB of the last storages excepted, which the
prefetch window holds), so no host path, however cheap, takes it below the time the disk alone needs for those
bytes. On this project's VM the virtual disk reads 1 MiB ``O_DIRECT`` requests at 1.0-1.8 GB/s from one minute
to the next, and 100,000 x 64 KiB are 6.55 GB: 3.6-6.5 s, against a backward without tba of 2.4-3.1 s, so the
floor of the ratio moves between about 1.2x and 2.7x by itself. The check therefore measures the disk in the
same run: a nameless file of :data:`FLOOR_PROBE_BYTES` (or the bytes written, if fewer) in the same directory,
written once and read twice through the engine tba picks (:func:`tba.io.directory_bandwidth`, 1 MiB requests),
the faster read taken, and reports how long that rate needs for the bytes tba read back: the floor, as a ratio
to the loop without tba. A ratio above the floor is tba's host path (or reads it did not keep in flight); the
floor itself is the disk's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import time
from collections.abc import Callable

import torch

import tba
from tba import _control
from tba.bench.hooks import per_storage_us
from tba.bench.thread_cpu import by_name as cpu_by_name
from tba.bench.thread_cpu import snapshot as thread_cpu_snapshot
from tba.defaults import GIB
from tba.io import directory_bandwidth, make_engine, probe_direct_io

LEAVES_IN_MANY = 64
"""Distinct leaf tensors the many-storage loop cycles through."""

FLOOR_PROBE_BYTES = GIB
"""Most bytes of the disk probe behind the floor (Note [The disk's floor under the many-storage ratio])."""

FLOOR_PROBE_READS = 2
"""Read passes of the probe; the fastest is the floor's rate."""


@dataclasses.dataclass
class ManyResult:
    """Backward seconds of the many-storage loop with and without tba (best of ``repeats``), and the disk's floor."""

    count: int
    size_bytes: int
    directory: str
    base_backward_s: float
    tba_backward_s: float
    base_forward_s: float
    tba_forward_s: float
    thread_cpu_us: dict[str, float] = dataclasses.field(default_factory=dict)
    """CPU microseconds per storage of each thread over the steps with tba, forward and backward, a mean of
    ``repeats`` (``thread_cpu``; the loop without tba is not split)."""
    bytes_read: int = 0
    """Bytes tba read back from the file in the last step with tba."""
    disk_read_gbps: float = 0.0
    """The same directory's sequential read rate, measured in the same run (0.0: not measured)."""
    disk_direct: bool = True
    """The probe read with ``O_DIRECT`` (False: the directory's file system has none, the page cache served it)."""
    disk_error: str = ""
    """Why the disk was not measured (empty when it was)."""

    @property
    def backward_ratio(self) -> float:
        return self.tba_backward_s / self.base_backward_s

    @property
    def floor_s(self) -> float | None:
        """Seconds the disk alone needs to read :attr:`bytes_read` (None: not measured)."""
        return self.bytes_read / (self.disk_read_gbps * 1e9) if self.disk_read_gbps > 0 else None

    @property
    def floor_ratio(self) -> float | None:
        """:attr:`floor_s` over the backward without tba: no backward that reads these bytes goes below it."""
        floor_s = self.floor_s
        return None if floor_s is None else floor_s / self.base_backward_s

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "backward_ratio": self.backward_ratio, "floor_s": self.floor_s,
                "floor_ratio": self.floor_ratio}


def _many_step(leaves: list[torch.Tensor], count: int, directory: str | None) -> tuple[float, float, int]:
    """Forward and backward seconds of one step, and the bytes tba read back (0 without tba)."""
    for leaf in leaves:
        leaf.grad = None
    start = time.perf_counter()
    context = contextlib.nullcontext() if directory is None else tba.offload_activations(directory=directory)
    with context as offloader:
        sums = [torch.tanh(leaves[i % len(leaves)]).sum() for i in range(count)]
    middle = time.perf_counter()
    torch.autograd.backward(sums)
    del sums
    _control.settle()
    end = time.perf_counter()
    return middle - start, end - middle, 0 if offloader is None else offloader.stats.bytes_read


def disk_read_gbps(directory: str, size_bytes: int, direct: bool = True) -> float:
    """GB/s of the fastest of :data:`FLOOR_PROBE_READS` sequential reads of ``size_bytes`` in ``directory``."""
    with make_engine("auto") as engine:
        return directory_bandwidth(engine, directory, size_bytes, direct=direct, reads=FLOOR_PROBE_READS)[1] / 1e9


def measure_many(count: int, size_bytes: int, directory: str, repeats: int = 1,
                 progress: Callable[[str], None] | None = None, thread_cpu: bool = False) -> ManyResult:
    """Backward over ``count`` storages of ``size_bytes`` written to ``directory``, with and without tba, then
    the disk's floor (Note [The disk's floor under the many-storage ratio])."""
    leaves = [torch.randn(size_bytes // 4, requires_grad=True) for _ in range(LEAVES_IN_MANY)]
    best = {"base": [float("inf"), float("inf")], "tba": [float("inf"), float("inf")]}
    spent: dict[str, int] = {}
    bytes_read = 0
    gc.collect()
    for rep in range(repeats):
        for name, where in (("base", None), ("tba", directory)):
            if progress is not None:
                progress(f"many: {name} {rep + 1}/{repeats}")
            before = thread_cpu_snapshot() if thread_cpu and where is not None else None
            forward_s, backward_s, read = _many_step(leaves, count, where)
            if before is not None:
                for thread, ns in cpu_by_name(before, thread_cpu_snapshot()).items():
                    spent[thread] = spent.get(thread, 0) + ns
            if where is not None:
                bytes_read = read
            best[name][0] = min(best[name][0], forward_s)
            best[name][1] = min(best[name][1], backward_s)
            gc.collect()
    del leaves
    if progress is not None:
        progress("many: the disk's read rate")
    rate, error, direct = 0.0, "", probe_direct_io(directory) is None
    try:
        rate = disk_read_gbps(directory, min(FLOOR_PROBE_BYTES, count * size_bytes), direct)
    except OSError as err:
        error = f"{type(err).__name__}: {err}"
    per_storage = per_storage_us({thread: ns // repeats for thread, ns in spent.items()}, count)
    return ManyResult(count, size_bytes, directory, best["base"][1], best["tba"][1], best["base"][0], best["tba"][0],
                      per_storage, bytes_read, rate, direct, error)
