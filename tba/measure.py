"""Measure training steps: median step time and activation peak, for one placement strategy.

Each strategy runs the same model, batch and seed:

* ``keep``: plain PyTorch, every activation stays in memory (the baseline);
* ``tba``: forward inside a reused :class:`tba.Offloader`;
* ``recompute``: every layer under non-reentrant ``torch.utils.checkpoint``;
* ``save_on_cpu``: ``torch.autograd.graph.save_on_cpu`` (on a CPU-only build this is a copy);
* ``adaptive``: a reused :class:`tba.Offloader` with ``policy="adaptive"`` and the goal given in
  ``offload_options`` (``memory_budget_bytes`` or ``overhead_bound``); its profiled steps come
  on top of the warm-up steps and are never measured.

Any model can be measured with :func:`run_steps`; :func:`run_mode` is the built-in GPT. In a fresh
process a user's model is named by ``"module:function"`` or ``"path/to/file.py:function"``
factories (``model_factory`` returns the module, ``batch_factory`` a tuple of arguments with
``model(*batch)`` returning the loss).

Activation peak on CPU is the peak resident set size during the step minus the resident set size
just before it, plus the idle read buffers tba keeps between steps (memory tba holds even though
it is resident before the step starts). The kernel's peak counter (``VmHWM``) is reset before each step through
``/proc/self/clear_refs``; where that is not allowed a 1 ms sampling thread stands in. Gradients
stay allocated across steps (``zero_grad(set_to_none=False)``), so the peak is activations and
their transient gradients, not weight gradients. On CUDA the peak is
``torch.cuda.max_memory_allocated()`` during the step minus what was allocated just before it
(weights, gradients, optimiser state). A mode is best measured in a fresh process
(:func:`run_isolated`), so that one mode's freed memory does not hide the next one's peak.

``compile_mode="per-block"`` wraps each repeated block in ``torch.compile`` (inductor) before the
first step, so every mode measures the compiled model; compilation happens in the warm-up steps.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from typing import Any, Callable

import torch
from torch import nn

from tba.compile import compile_blocks
from tba.layers import resolve_layers
from tba.models import PRESETS, GPTConfig, make_batch, make_gpt
from tba.offloader import Offloader
from tba.recompute import RecomputeLayers

MODES = ("keep", "tba", "recompute", "save_on_cpu")
COMPILE_MODES = ("none", "per-block")
ALL_MODES = (*MODES, "adaptive")

# Note: [Why measured processes fix glibc's mmap threshold]
# glibc raises its mmap threshold (up to 32 MiB) each time a large block is freed, after which
# tensors of that size come from the heap and freed memory stays in the process. RSS then stops
# reflecting live memory: a mode that frees activations early looks no better than one that keeps
# them. A fixed threshold puts every tensor of 128 KiB or more in its own mapping, returned to the
# kernel on free, for every mode alike.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}
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


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


class PeakRSS:
    """Peak resident set size over a ``with`` block, minus the size at its start (bytes)."""

    def __init__(self) -> None:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self._kernel_peak = True
        except OSError:
            self._kernel_peak = False
        self.delta_bytes = 0

    def __enter__(self) -> "PeakRSS":
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

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        peak = _status_kib("VmHWM") if self._kernel_peak else self._sampled
        self.delta_bytes = max(0, peak - self._start) * 1024


class CudaPeak:
    """Peak CUDA memory allocated over a ``with`` block, minus what was allocated at its start (bytes)."""

    def __enter__(self) -> "CudaPeak":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        self._start = torch.cuda.memory_allocated()
        return self

    def __exit__(self, *exc: object) -> None:
        torch.cuda.synchronize()
        self.delta_bytes = max(0, torch.cuda.max_memory_allocated() - self._start)


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
    if mode in ("tba", "adaptive"):
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


def factory_spec(factory: Callable[..., Any] | str) -> str:
    """``"module:qualname"`` (or ``"file.py:qualname"`` for a script's own functions) naming ``factory``."""
    if isinstance(factory, str):
        return factory
    module = factory.__module__
    if module == "__main__":
        module = os.path.abspath(sys.modules["__main__"].__file__)
    if "<" in factory.__qualname__:
        raise ValueError(f"{factory.__qualname__} cannot be imported in a fresh process; define it at module level")
    return f"{module}:{factory.__qualname__}"


def load_factory(spec: str) -> Callable[..., Any]:
    """The function named by :func:`factory_spec`."""
    module_name, _, name = spec.rpartition(":")
    if module_name.endswith(".py"):
        loader = importlib.util.spec_from_file_location("tba_user_factories", module_name)
        module = importlib.util.module_from_spec(loader)
        loader.loader.exec_module(module)
    else:
        module = importlib.import_module(module_name)
    target: Any = module
    for part in name.split("."):
        target = getattr(target, part)
    return target


def run_isolated(mode: str, preset: str | None, **kwargs: Any) -> ModeResult:
    """:func:`run_mode` in a fresh Python process; keyword arguments as for :func:`run_mode`.

    With ``preset=None``, pass ``model_factory`` and ``batch_factory`` (callables defined at
    module level, or their :func:`factory_spec` strings) to measure any model with :func:`run_steps`.
    """
    for key in ("model_factory", "batch_factory"):
        if key in kwargs:
            kwargs[key] = factory_spec(kwargs[key])
    request = json.dumps({"mode": mode, "preset": preset, **kwargs})
    proc = subprocess.run([sys.executable, "-m", "tba.measure", request], capture_output=True, text=True,
                          env=dict(os.environ, **MALLOC_ENV))
    if proc.returncode != 0:
        raise RuntimeError(f"mode {mode} failed:\n{proc.stderr[-4000:]}")
    return ModeResult(**json.loads(proc.stdout.strip().splitlines()[-1]))


def _worker(request_json: str) -> None:
    request = json.loads(request_json)
    preset = request.pop("preset")
    if preset is None:
        model = load_factory(request.pop("model_factory"))()
        batch = load_factory(request.pop("batch_factory"))()
        result = run_steps(request.pop("mode"), model, tuple(batch), **request)
        print(json.dumps(dataclasses.asdict(result)))
        return
    config = PRESETS[preset]
    if "config_overrides" in request:
        config = dataclasses.replace(config, **request.pop("config_overrides"))
    result = run_mode(request.pop("mode"), config, **request)
    print(json.dumps(dataclasses.asdict(result)))


if __name__ == "__main__":
    _worker(sys.argv[1])
