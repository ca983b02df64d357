"""Memory meters: the activation peak of a block of code, as a user would measure it.

On CPU, :class:`PeakRSS` takes the peak resident set size during the block minus the size just
before it. The kernel's peak counter (``VmHWM``) is reset before each block through
``/proc/self/clear_refs``; where that is not allowed a 1 ms sampling thread stands in. On CUDA,
:class:`CudaPeak` takes ``torch.cuda.max_memory_allocated()`` during the block minus what was
allocated just before it (weights, gradients, optimiser state). Both also keep the absolute
peak (``peak_bytes``), so that a run can report its peak above what it held before its first step
(:func:`usage_bytes`), which a caching malloc's retained memory cannot hide.
"""

from __future__ import annotations

import threading

import torch

from tba._free_memory import release_free_memory
from tba._proc_status import STATUS, status_kib
from tba.device import cuda_api

# Note: [Why measured processes fix glibc's mmap threshold]
# glibc raises its mmap threshold (up to 32 MiB) each time a large block is freed, after which
# tensors of that size come from the heap and freed memory stays in the process. RSS then stops
# reflecting live memory: a mode that frees activations early looks no better than one that keeps
# them. A fixed threshold puts every tensor of 128 KiB or more in its own mapping, returned to the
# kernel on free, for every mode alike.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}


_STATUS = STATUS


def _status_kib(field: str) -> int:
    kib = status_kib(field, _STATUS)  # Note [The status file is read as bytes] in tba/_proc_status.py
    if kib is None:
        raise RuntimeError(f"{field} not in {_STATUS}")
    return kib


def usage_bytes(device: str = "cpu") -> int:
    """What the process holds now: resident set size on CPU, CUDA memory allocated on ``cuda``."""
    if torch.device(device).type == "cuda":
        return cuda_api().memory_stats()["allocated_bytes"]
    return _status_kib("VmRSS") * 1024


class PeakRSS:
    """Peak resident set size over a ``with`` block, minus the size at its start (bytes).

    With ``release``, the allocator's cached free memory is handed back to the kernel first
    (``tba/_free_memory.py``): otherwise a block that fits in memory freed earlier reads 0.
    """

    def __init__(self, release: bool = False) -> None:
        self.release = release
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self._kernel_peak = True
        except OSError:
            self._kernel_peak = False
        self.delta_bytes = 0
        self.peak_bytes = 0

    def __enter__(self) -> PeakRSS:
        if self.release:
            release_free_memory()
        if self._kernel_peak:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        self._start = _status_kib("VmRSS")
        self._sampled = self._start
        self._stop = threading.Event()
        if not self._kernel_peak:
            self._sampler = threading.Thread(target=self._sample, daemon=True)
            self._sampler.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self._sampled = max(self._sampled, _status_kib("VmRSS"))

    reserved_bytes = 0
    pinned_bytes = 0

    def synchronize(self) -> None:
        """Host work is synchronous; on the simulated CUDA device, wait for its streams."""
        if cuda_api().simulated:
            cuda_api().synchronize()

    def __exit__(self, *exc: object) -> None:
        if cuda_api().simulated:
            self.pinned_bytes = cuda_api().memory_stats()["pinned_bytes"]
        self._stop.set()
        peak = _status_kib("VmHWM") if self._kernel_peak else self._sampled
        self.delta_bytes = max(0, peak - self._start) * 1024
        self.peak_bytes = max(peak, self._start) * 1024


class CudaPeak:
    """Peak CUDA memory allocated over a ``with`` block, minus what was allocated at its start (bytes).

    Also records the device memory the caching allocator reserved and the page-locked host bytes at
    the end (``reserved_bytes``, ``pinned_bytes``). Call :meth:`synchronize` before reading a clock:
    CUDA work is asynchronous, a clock read without it measures launch time.
    """

    reserved_bytes = 0
    pinned_bytes = 0

    def __enter__(self) -> CudaPeak:
        cuda = cuda_api()
        cuda.synchronize()
        if not cuda.simulated:
            torch.cuda.reset_peak_memory_stats()
        self._start = cuda.memory_stats()["allocated_bytes"]
        return self

    def synchronize(self) -> None:
        cuda_api().synchronize()

    def __exit__(self, *exc: object) -> None:
        cuda = cuda_api()
        cuda.synchronize()
        stats = cuda.memory_stats()
        self.delta_bytes = max(0, stats["peak_allocated_bytes"] - self._start)
        self.peak_bytes = max(stats["peak_allocated_bytes"], self._start)
        self.reserved_bytes = stats["reserved_bytes"]
        self.pinned_bytes = stats["pinned_bytes"]
