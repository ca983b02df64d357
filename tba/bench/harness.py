"""Measure training steps: median step time and activation peak, for one placement strategy.

Each strategy runs the same model, batch and seed:

* ``keep``: plain PyTorch, every activation stays in memory (the baseline);
* ``tba``: forward inside a reused :class:`tba.Offloader`;
* ``tba-verify``: the same with ``verify=True`` (a CRC-32C of every storage written and read);
* ``recompute``: every layer under non-reentrant ``torch.utils.checkpoint``;
* ``save_on_cpu``: ``torch.autograd.graph.save_on_cpu`` (on a CPU-only build this is a copy);
* ``adaptive``: a reused :class:`tba.Offloader` with ``policy="adaptive"`` and the goal given in
  ``offload_options`` (``memory_budget_bytes`` or ``overhead_bound``); its profiled steps come
  on top of the warm-up steps and are never measured.

Any model can be measured with :func:`run_steps` (``model(*batch)`` returns the loss);
:func:`run_mode` is the built-in GPT.

Activation peak on CPU is the peak resident set size during the step minus the resident set size
just before it (``tba/bench/meters.py``), plus the idle read buffers tba keeps between steps
(memory tba holds even though it is resident before the step starts). Gradients
stay allocated across steps (``zero_grad(set_to_none=False)``), so the peak is activations and
their transient gradients, not weight gradients. On CUDA the peak is
``torch.cuda.max_memory_allocated()`` during the step minus what was allocated just before it
(weights, gradients, optimiser state). A mode is best measured in a fresh process
(:func:`tba.bench.isolated.run_isolated`), so that one mode's freed memory does not hide the next one's peak.

``compile_mode="per-block"`` wraps each repeated block in ``torch.compile`` (inductor) before the
first step, so every mode measures the compiled model; compilation happens in the warm-up steps.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from typing import Any

import torch
from torch import nn

from tba.bench.meters import CudaPeak, PeakRSS
from tba.bench.models import GPTConfig, make_batch, make_gpt
from tba.runtime._compile import compile_blocks
from tba.runtime._layers import resolve_layers
from tba.runtime._offloader import Offloader
from tba.runtime._recompute import RecomputeLayers

MODES = ("keep", "tba", "recompute", "save_on_cpu")
COMPILE_MODES = ("none", "per-block")
ALL_MODES = (*MODES, "adaptive", "tba-verify")

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

    @property
    def median_step_s(self) -> float:
        return statistics.median(self.step_s)

    @property
    def median_peak_bytes(self) -> int:
        return int(statistics.median(self.activation_peak_bytes))


def run_mode(mode: str, config: GPTConfig, *, steps: int = 5, warmup: int = 1, directory: str | None = None,
             backend: str = "auto", seed: int = 0, offload_options: dict[str, Any] | None = None,
             device: str = "cpu", threads: int | None = None, compile_mode: str = "none") -> ModeResult:
    """Train ``steps + warmup`` steps of the built-in GPT under ``mode`` in this process."""
    model = make_gpt(config, seed=seed)
    return run_steps(mode, model, make_batch(config, seed=seed), steps=steps, warmup=warmup, directory=directory,
                     backend=backend, seed=seed, offload_options=offload_options, device=device, threads=threads,
                     compile_mode=compile_mode)


def run_steps(mode: str, model: nn.Module, batch: tuple, *, steps: int = 5, warmup: int = 1,
              directory: str | None = None, backend: str = "auto", seed: int = 0,
              offload_options: dict[str, Any] | None = None, device: str = "cpu",
              threads: int | None = None, compile_mode: str = "none") -> ModeResult:
    """Train ``model`` (``model(*batch)`` returns the loss) for ``steps + warmup`` steps under ``mode``.

    ``threads`` sets torch's intra-op threads for the run (None: torch's default); ``compile_mode``
    is ``"none"`` or ``"per-block"`` (each of the model's repeated blocks under ``torch.compile``).
    """
    if mode not in ALL_MODES:
        raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(ALL_MODES)}")
    if compile_mode not in COMPILE_MODES:
        raise ValueError(f"unknown compile mode {compile_mode!r}; choose one of {', '.join(COMPILE_MODES)}")
    if threads is not None:
        torch.set_num_threads(threads)
    model = model.to(device)
    if compile_mode == "per-block":
        compile_blocks(resolve_layers(model), model)
    batch = tuple(b.to(device) if isinstance(b, torch.Tensor) else b for b in batch)
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    offloader = None
    options = dict(offload_options or {})
    if mode == "adaptive":
        options["policy"] = "adaptive"
        warmup += options.get("profile_steps", 2)
    if mode == "tba-verify":
        options["verify"] = True
    if mode in ("tba", "adaptive", "tba-verify"):
        offloader = Offloader(directory, backend=backend, layers=model, **options)
    recompute = RecomputeLayers(resolve_layers(model)) if mode == "recompute" else contextlib.nullcontext()
    peak_meter = CudaPeak if torch.device(device).type == "cuda" else PeakRSS
    result = ModeResult(mode, [], [], [])
    with recompute:
        for step in range(warmup + steps):
            torch.manual_seed(seed + step)
            optimizer.zero_grad(set_to_none=False)
            held_before = offloader.pool_idle_bytes if offloader is not None and peak_meter is PeakRSS else 0
            with peak_meter() as peak:
                start = time.perf_counter()
                if mode == "save_on_cpu":
                    with torch.autograd.graph.save_on_cpu():
                        loss = model(*batch)
                elif offloader is not None:
                    with offloader:
                        loss = model(*batch)
                else:
                    loss = model(*batch)
                loss.backward()
                optimizer.step()
                elapsed = time.perf_counter() - start
            result.losses.append(loss.item())
            del loss
            if step >= warmup:
                result.step_s.append(elapsed)
                result.activation_peak_bytes.append(peak.delta_bytes + held_before)
    if offloader is not None:
        offloader.close()
        result.offload_stats = offloader.stats.as_dict()
        if offloader.plan is not None:
            result.plan = {**dataclasses.asdict(offloader.plan), "code": offloader.plan.code}
    return result


