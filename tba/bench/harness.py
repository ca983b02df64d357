"""Measure training steps: median step time and activation peak, for one placement strategy.

Each strategy runs the same model, batch and seed:

* ``keep``: plain PyTorch, every activation stays in memory (the baseline);
* ``tba``: forward inside a reused :class:`tba.Offloader` told the model's layers, offloading
  every layer unless ``offload_options`` names another ``policy`` (``usage="reusable"``), or
  inside a bare ``with tba.offload_activations(directory=d):`` per step with nothing else passed
  (``usage="bare"``: the adaptive default), as a new user would write it;
* ``tba-verify``: ``tba`` with ``verify=True`` (a CRC-32C of every storage written and read);
* ``recompute``: every layer under non-reentrant ``torch.utils.checkpoint``;
* ``offloaded_recompute``: a reused :class:`tba.Offloader` pinned to a plan recomputing every layer
  with its input offloaded (``Placement.OFFLOADED_RECOMPUTE``), window ``prefetch_budget_bytes``
  from ``offload_options`` or :data:`OFFLOADED_RECOMPUTE_WINDOW_BYTES`;
* ``save_on_cpu``: ``torch.autograd.graph.save_on_cpu`` (on a CPU-only build this is a copy);
* ``keep_io``: keep-all while another process writes and reads ``io_rates`` (bytes per second) in
  ``directory``, the traffic a tba run moved (``tba/bench/io_load.py``, Note [What the traffic
  alone costs]);
* ``adaptive``: a reused :class:`tba.Offloader` with ``policy="adaptive"`` and the goal given in
  ``offload_options`` (``memory_budget_bytes`` or ``overhead_bound``); its profiled steps come
  on top of the warm-up steps and are never measured.

Any model can be measured with :func:`run_steps` (``model(*batch)`` returns the loss);
:func:`run_mode` is the built-in GPT.

Activation peak on CPU is the peak resident set size during the step minus the resident set size
just before it (``tba/bench/meters.py``), plus the idle read buffers tba keeps between steps
(memory tba holds even though it is resident before the step starts; with ``usage="bare"``,
those of the idle shared runtime). Gradients are allocated (zeros) before the first step and stay
allocated across steps (``zero_grad(set_to_none=False)``), so the peak of every step, the first
included, is activations and their transient gradients, not weight gradients. On CUDA the peak is
``torch.cuda.max_memory_allocated()`` during the step minus what was allocated just before it
(weights, gradients, optimiser state). ``footprint_bytes`` is the run's peak above what the process
held before its first step (after weights, gradients and batch, before tba's offloader), over every
step, warm-up included: under a caching malloc a step's own delta misses the memory the previous
step freed into the malloc's cache, the footprint does not. A mode is best measured in a fresh process
(:func:`tba.bench.isolated.run_isolated`), so that one mode's freed memory does not hide the next one's peak.

``compile_mode="per-block"`` wraps each repeated block in ``torch.compile`` (inductor) before the
first step, so every mode measures the compiled model; compilation happens in the warm-up steps.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn

from tba.bench.mode_run import (
    ALL_MODES,
    COMPILE_MODES,
    LEARNING_RATE,
    MODES,
    OFFLOADED_RECOMPUTE_WINDOW_BYTES,
    USAGES,
    ModeResult,
    ModeRun,
    loss_of,
)
from tba.bench.models import GPTConfig, make_batch, make_gpt

__all__ = ["ALL_MODES", "COMPILE_MODES", "LEARNING_RATE", "MODES", "OFFLOADED_RECOMPUTE_WINDOW_BYTES", "PRIME_SEQ_LEN",
           "USAGES", "ModeResult", "ModeRun", "loss_of", "run_mode", "run_steps"]

PRIME_SEQ_LEN = 8
"""Tokens in the one-sample batch :func:`run_mode` primes with (``prime=True``)."""


def run_mode(mode: str, config: GPTConfig, *, steps: int = 5, warmup: int = 1, directory: str | None = None,
             backend: str = "auto", seed: int = 0, offload_options: dict[str, Any] | None = None,
             device: str = "cpu", threads: int | None = None, compile_mode: str = "none",
             usage: str = "reusable", memory_steps: int = 0, prime: bool = False,
             io_rates: tuple[float, float] | None = None) -> ModeResult:
    """Train ``steps + warmup`` steps of the built-in GPT under ``mode`` in this process.

    ``prime``: first run one plain forward and backward on a batch of one short sequence
    (:data:`PRIME_SEQ_LEN` tokens), before the footprint's baseline is taken (see :func:`run_steps`).
    """
    model = make_gpt(config, seed=seed)
    small = make_batch(dataclasses.replace(config, batch_size=1, seq_len=min(PRIME_SEQ_LEN, config.seq_len)), seed=seed)
    return run_steps(mode, model, make_batch(config, seed=seed), steps=steps, warmup=warmup, directory=directory,
                     backend=backend, seed=seed, offload_options=offload_options, device=device, threads=threads,
                     compile_mode=compile_mode, usage=usage, memory_steps=memory_steps,
                     prime_batch=small if prime else None, io_rates=io_rates)


def run_steps(mode: str, model: nn.Module, batch: tuple, *, steps: int = 5, warmup: int = 1,
              directory: str | None = None, backend: str = "auto", seed: int = 0,
              offload_options: dict[str, Any] | None = None, device: str = "cpu",
              threads: int | None = None, compile_mode: str = "none", usage: str = "reusable",
              memory_steps: int = 0, prime_batch: tuple | None = None,
              io_rates: tuple[float, float] | None = None) -> ModeResult:
    """Train ``model`` (``model(*batch)`` returns the loss) for ``warmup + steps + memory_steps`` steps under ``mode``.

    With ``memory_steps``, the activation peaks come from that many steps after the timed ones, each
    started with the allocator's free memory handed back (``tba/_free_memory.py``), and not from the
    timed steps: under a caching malloc a timed step that fits in memory freed by an earlier one
    shows no growth of the resident set, while a step after a release pays page faults.

    ``threads`` sets torch's intra-op threads for the run (None: torch's default); ``compile_mode``
    is ``"none"`` or ``"per-block"`` (each of the model's repeated blocks under ``torch.compile``);
    ``usage`` is how ``mode="tba"`` enters tba (``"reusable"`` or ``"bare"``, see above).
    ``prime_batch``: a small batch run once forward and backward, plainly, before the footprint's
    baseline is taken, so that what any first step pays once (library code paged in, thread pools
    started) is not counted as activation memory; gradients are zeroed at every step and each step
    seeds the RNG, so losses are unchanged.
    """
    run = ModeRun(mode, model, batch, directory=directory, backend=backend, seed=seed,
                  offload_options=offload_options, device=device, threads=threads, compile_mode=compile_mode,
                  usage=usage, prime_batch=prime_batch, warmup=warmup, io_rates=io_rates)
    try:
        for step in range(run.warmup + steps + memory_steps):
            run.step(step, release=step >= run.warmup + steps, measured=step >= run.warmup,
                     memory_only=step >= run.warmup + steps)
    except BaseException:
        run.unwrap()
        raise
    run.finish()
    return run.result
