"""The activation peak of a profiled step, measured as a user (and ``tba.bench``) would measure it.

The adaptive policy's memory model counts saved bytes; what a step really adds to the process also
holds the transient buffers of compute (a layer's intermediate tensors, its gradients) and the
allocator's slack. The runner measures the real peak of each profiled step with a
:class:`StepPeak` and plans against the model plus the measured excess
(``Profile.memory_slack_bytes``) and a headroom for what a plan's I/O can add
(``Profile.memory_headroom_per_io_byte``), so that a budget holds for what is measured, not for what is
modelled.

* Host: the kernel's peak resident set counter ``VmHWM`` is reset (``/proc/self/clear_refs``,
  value 5) when the step starts and read when its backward ends; the peak is ``VmHWM`` minus the
  resident set at the start, plus the read buffers tba held idle at the start (resident before the
  step, so not in the difference, but activation memory all the same). Where ``clear_refs`` cannot
  be written, the step has no measurement and the model is used alone. Before the last profiled
  step the allocator's cached free memory is handed back (``tba/_free_memory.py``): under a
  caching malloc the resident set would otherwise not grow at all in a step that fits in memory
  freed by an earlier one. Only the last profiled step's peak is used: the first ones can hold
  one-off allocations (thread pools, buffers made on first use).
* CUDA: ``torch.cuda.max_memory_allocated`` after a reset of the peak, minus what was allocated
  at the start (weights, gradients, optimiser state).

The end of backward is caught with ``queue_callback`` from a gradient hook (the autograd engine
runs it once the whole backward pass has finished), so a measurement taken around the step by the
user reads the same peak.
"""

from __future__ import annotations

import torch

from tba._free_memory import release_free_memory
from tba._proc_status import STATUS, status_kib
from tba.runtime._compiling import compiling

_CLEAR_REFS = "/proc/self/clear_refs"
_RESET_PEAK = "5"


_STATUS = STATUS


def _status_bytes(field: str) -> int | None:
    try:
        kib = status_kib(field, _STATUS)  # Note [The status file is read as bytes] in tba/_proc_status.py
    except OSError:
        return None
    return None if kib is None else kib * 1024


class StepPeak:
    """Measures one step's activation peak (bytes): :meth:`start`, then :meth:`stop` at the end of backward."""

    def __init__(self) -> None:
        self.peak_bytes: int | None = None
        self._start: int | None = None
        self._held = 0
        self._cuda = False

    def start(self, held_bytes: int, cuda: bool, release: bool = False) -> None:
        """Reset the peak counter; ``held_bytes`` is memory tba already holds for activations (idle read
        buffers); with ``release``, the allocator's cached free memory goes back to the kernel first
        (``tba/_free_memory.py``), so that the peak is not hidden by memory freed in earlier steps."""
        self.peak_bytes = None
        self._held = held_bytes
        self._cuda = cuda and torch.cuda.is_available()
        if self._cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._start = torch.cuda.memory_allocated()
            return
        if release:
            release_free_memory()
        try:
            with open(_CLEAR_REFS, "w") as f:
                f.write(_RESET_PEAK)
        except OSError:
            self._start = None
            return
        self._start = _status_bytes("VmRSS")

    def stop(self) -> None:
        """Record the peak since :meth:`start` (once; later calls keep the first reading)."""
        if self._start is None or self.peak_bytes is not None:
            return
        if self._cuda:
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated()
        else:
            peak = _status_bytes("VmHWM")
            if peak is None:
                return
        self.peak_bytes = max(0, peak - self._start) + self._held

    def stop_after_backward(self, grad: torch.Tensor) -> None:
        """A gradient hook: :meth:`stop` once the backward pass it runs in has finished; traced by compiled autograd it
        does nothing (Note [Hooks traced into a whole-model graph do nothing] in ``tba/runtime/_layer_hooks.py``:
        traced, ``queue_callback`` failed the first profiled backward with torch's AssertionError), and the peak
        stops at the next entry."""
        if compiling():
            return
        torch.autograd.Variable._execution_engine.queue_callback(self.stop)
