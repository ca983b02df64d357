"""One mode's training steps, taken one at a time: its model, optimiser, tba context and meters.

:class:`ModeRun` sets a mode up (``tba/bench/harness.py`` describes the modes and what is
measured) and :meth:`ModeRun.step` trains one step and records its time, peak, loss and the bytes
tba moved. :func:`tba.bench.harness.run_steps` is a loop over one run; ``tba/bench/interleaved.py``
steps several in turn in one process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from typing import Any

import torch
from torch import nn

from tba.bench.io_load import BackgroundIO
from tba.bench.meters import CudaPeak, PeakRSS, usage_bytes
from tba.defaults import MIB
from tba.policy import Placement, Plan
from tba.runtime import Offloader, RecomputeLayers, compile_blocks, idle_pool_bytes, offload_activations, resolve_layers, shutdown

MODES = ("keep", "tba", "recompute", "save_on_cpu")
COMPILE_MODES = ("none", "per-block")
USAGES = ("reusable", "bare")
ALL_MODES = (*MODES, "adaptive", "tba-verify", "offloaded_recompute", "keep_io")
OFFLOADED_RECOMPUTE_WINDOW_BYTES = 8 * MIB
"""Prefetch window of the ``offloaded_recompute`` mode: tba's smallest self-sized window."""

LEARNING_RATE = 1e-3


@dataclasses.dataclass
class ModeResult:
    """What one strategy measured; times in seconds, memory in bytes."""

    mode: str
    step_s: list[float]
    activation_peak_bytes: list[int]
    losses: list[float]
    offload_stats: dict[str, float] | None = None
    plan: dict[str, Any] | None = None
    reserved_bytes: int = 0
    """Most device memory the caching allocator reserved at the end of a step (CUDA)."""
    pinned_bytes: int = 0
    """Most page-locked host memory at the end of a step (CUDA)."""
    allocator: str | None = None
    """The malloc that served the process (:func:`tba.allocator.detect`), where recorded."""
    footprint_bytes: int = 0
    """Most memory above what the process held before its first step, over every step, warm-up included."""
    written_bytes: list[int] = dataclasses.field(default_factory=list)
    """Bytes tba wrote in each measured step (the ``step_s`` steps); empty without tba."""
    read_bytes: list[int] = dataclasses.field(default_factory=list)
    """Bytes tba read back in each measured step; empty without tba."""

    def io_rates(self) -> tuple[float, float] | None:
        """Median bytes per second tba wrote and read over the measured steps (the ``keep_io`` mode's load),
        None without tba."""
        if not self.written_bytes:
            return None
        return (statistics.median(b / s for b, s in zip(self.written_bytes, self.step_s)),
                statistics.median(b / s for b, s in zip(self.read_bytes, self.step_s)))

    @property
    def median_step_s(self) -> float:
        return statistics.median(self.step_s)

    @property
    def median_peak_bytes(self) -> int:
        return int(statistics.median(self.activation_peak_bytes))

    @property
    def max_peak_bytes(self) -> int:
        """The worst step's activation peak (the first step included when it was measured)."""
        return max(self.activation_peak_bytes)


def loss_of(output: Any) -> torch.Tensor:
    """The loss in a model's output: the tensor itself, or the ``loss`` of an output object or dict
    (Hugging Face models return a ``ModelOutput`` whose ``loss`` is set when labels are given)."""
    if isinstance(output, torch.Tensor):
        return output
    loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    raise TypeError(f"model(*batch) returned a {type(output).__name__} without a loss tensor; return the loss, "
                    "or an output whose .loss is set (for a Hugging Face model, pass labels in the batch)")


class ModeRun:
    """One mode's model, optimiser and tba context, stepped by :meth:`step` (:func:`run_steps` is its loop).

    Several runs in one process can be stepped in turn (``tba/bench/interleaved.py``); each keeps
    its own model, so a recomputed model or an offloader never touches another mode's steps.
    ``warmup`` is the caller's; :attr:`warmup` adds an adaptive run's profiled steps.
    """

    def __init__(self, mode: str, model: nn.Module, batch: tuple, *, directory: str | None = None,
                 backend: str = "auto", seed: int = 0, offload_options: dict[str, Any] | None = None,
                 device: str = "cpu", threads: int | None = None, compile_mode: str = "none",
                 usage: str = "reusable", prime_batch: tuple | None = None, warmup: int = 0,
                 io_rates: tuple[float, float] | None = None) -> None:
        if usage not in USAGES:
            raise ValueError(f"unknown usage {usage!r}; choose one of {', '.join(USAGES)}")
        if mode not in ALL_MODES:
            raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(ALL_MODES)}")
        if compile_mode not in COMPILE_MODES:
            raise ValueError(f"unknown compile mode {compile_mode!r}; choose one of {', '.join(COMPILE_MODES)}")
        if threads is not None:
            torch.set_num_threads(threads)
        self.mode, self.device, self.seed, self.directory = mode, device, seed, directory
        self.model = model = model.to(device)
        if compile_mode == "per-block":
            compile_blocks(resolve_layers(model), model)
        self.batch = tuple(b.to(device) if isinstance(b, torch.Tensor) else b for b in batch)
        self.optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
        for param in model.parameters():
            if param.requires_grad and param.grad is None:
                param.grad = torch.zeros_like(param)
        if prime_batch is not None:
            loss_of(model(*(b.to(device) if isinstance(b, torch.Tensor) else b for b in prime_batch))).backward()
        self.baseline_bytes = usage_bytes(device)
        self.bare = mode in ("tba", "tba-verify") and usage == "bare"
        self.bare_options = {"verify": True} if mode == "tba-verify" else {}
        self.bare_stats: list[Offloader] = []
        self._measured_contexts: list[Offloader] = []
        """The one-shot contexts of the measured steps, whose bytes :meth:`finish` reads."""
        self.offloader: Offloader | None = None
        options = dict(offload_options or {})
        self.warmup = warmup
        if mode == "adaptive":
            options["policy"] = "adaptive"
            self.warmup += options.get("profile_steps", 2)
        if mode in ("tba", "tba-verify") and not self.bare:
            options.setdefault("policy", "offload")
        if mode == "tba-verify":
            options["verify"] = True
        if mode == "offloaded_recompute":
            window = options.get("prefetch_budget_bytes") or OFFLOADED_RECOMPUTE_WINDOW_BYTES
            options["policy"] = Plan((Placement.OFFLOADED_RECOMPUTE,) * len(resolve_layers(model)), window_bytes=window)
        if mode in ("adaptive", "offloaded_recompute") or (mode in ("tba", "tba-verify") and not self.bare):
            self.offloader = Offloader(directory, backend=backend, layers=model, **options)
        self._exits = contextlib.ExitStack()
        if mode == "recompute":
            self._exits.enter_context(RecomputeLayers(resolve_layers(model)))
        if mode == "keep_io":
            if io_rates is None:
                raise ValueError("mode keep_io needs io_rates: (bytes written, bytes read) per second")
            self._exits.enter_context(BackgroundIO(directory, *io_rates))
        self.on_cuda = torch.device(device).type == "cuda"
        self.result = ModeResult(mode, [], [], [])
        self._memory_peaks: list[int] = []
        self._moved = (0, 0)
        """Bytes the reused offloader had written and read after the previous step."""

    def step(self, index: int, *, release: bool = False, measured: bool = True, memory_only: bool = False) -> None:
        """Train step ``index`` (it seeds the RNG); ``measured``: record its time and peak (``memory_only``: its
        peak alone, after the allocator's free memory was handed back when ``release``)."""
        model, batch, offloader, result = self.model, self.batch, self.offloader, self.result
        torch.manual_seed(self.seed + index)
        self.optimizer.zero_grad(set_to_none=False)
        held_before = offloader.pool_idle_bytes if offloader is not None else idle_pool_bytes() if self.bare else 0
        held_before = 0 if self.on_cuda else held_before
        with CudaPeak() if self.on_cuda else PeakRSS(release=release) as peak:
            start = time.perf_counter()
            if self.mode == "save_on_cpu":
                with torch.autograd.graph.save_on_cpu(pin_memory=self.on_cuda):
                    loss = model(*batch)
            elif offloader is not None:
                with offloader:
                    loss = model(*batch)
            elif self.bare:
                with offload_activations(directory=self.directory, **self.bare_options) as context:
                    loss = model(*batch)
                self.bare_stats.append(context)
            else:
                loss = model(*batch)
            loss = loss_of(loss)
            loss.backward()
            self.optimizer.step()
            # The device finishes the step before the clock is read (CUDA work is asynchronous).
            peak.synchronize()
            elapsed = time.perf_counter() - start
        result.losses.append(loss.item())
        result.reserved_bytes = max(result.reserved_bytes, peak.reserved_bytes)
        result.pinned_bytes = max(result.pinned_bytes, peak.pinned_bytes)
        result.footprint_bytes = max(result.footprint_bytes, peak.peak_bytes - self.baseline_bytes)
        del loss
        moved = self._step_bytes()
        if memory_only:
            self._memory_peaks.append(peak.delta_bytes + held_before)
        elif measured:
            result.step_s.append(elapsed)
            result.activation_peak_bytes.append(peak.delta_bytes + held_before)
            if moved is not None:
                result.written_bytes.append(moved[0])
                result.read_bytes.append(moved[1])
            elif self.bare_stats:
                self._measured_contexts.append(self.bare_stats[-1])

    def _step_bytes(self) -> tuple[int, int] | None:
        """Bytes tba wrote and read in the step just taken (read after it: outside its clock), None without tba."""
        if self.offloader is not None:  # counts since it was built: the step's are the growth
            # A write still in flight (its storage died before it ended) counts when it ends: waited for here,
            # outside the clock, it counts in its own step's bytes, not the next one's (or none: the last).
            self.offloader.flush()
            stats = self.offloader.stats
            before, self._moved = self._moved, (stats.bytes_written, stats.bytes_read)
            return self._moved[0] - before[0], self._moved[1] - before[1]
        return None  # a one-shot context counts its step alone, read at finish (its last writes may still be in flight)

    def unwrap(self) -> None:
        """Undo the recompute wrapping of the model's layers and stop an I/O load (idempotent)."""
        self._exits.close()

    def abandon(self) -> None:
        """After a failure elsewhere: :meth:`unwrap`, and close the offloader, whatever it raises."""
        self.unwrap()
        if self.offloader is not None:
            with contextlib.suppress(Exception):
                self.offloader.close()

    def finish(self) -> None:
        """Close the offloader and undo the recompute wrapping; fills the result's stats and plan."""
        result = self.result
        self.unwrap()
        if self._memory_peaks:
            result.activation_peak_bytes = self._memory_peaks
        if self.bare_stats:
            shutdown()  # the shared runtime closes once its writes ended: every context's counts are final
            result.written_bytes = [context.stats.bytes_written for context in self._measured_contexts]
            result.read_bytes = [context.stats.bytes_read for context in self._measured_contexts]
            result.offload_stats = _summed_stats([context.stats.as_dict() for context in self.bare_stats])
            plan = self.bare_stats[-1].plan
            result.plan = {**dataclasses.asdict(plan), "code": plan.code} if plan is not None else None
        if self.offloader is not None:
            self.offloader.close()
            result.offload_stats = self.offloader.stats.as_dict()
            if self.offloader.plan is not None:
                result.plan = {**dataclasses.asdict(self.offloader.plan), "code": self.offloader.plan.code}


def _summed_stats(per_step: list[dict[str, Any]]) -> dict[str, Any]:
    """Counters of one-shot contexts added up over steps (per-reason counts too); peaks and bandwidths are the
    worst / mean; text fields (the allocator) are the last step's."""
    out: dict[str, Any] = {}
    for key, first in per_step[0].items():
        if isinstance(first, dict):
            merged: dict[str, Any] = {}
            for step in per_step:
                for name, count in step[key].items():
                    merged[name] = merged.get(name, 0) + count
            out[key] = merged
        elif isinstance(first, str):
            out[key] = per_step[-1][key]
        else:
            out[key] = sum(step[key] for step in per_step)
    for key in ("peak_resident_bytes", "resident_bytes", "staging_blocks_in_use"):
        out[key] = max(step[key] for step in per_step)
    for key in ("write_gbps", "read_gbps"):
        out[key] = statistics.mean(step[key] for step in per_step)
    return out
