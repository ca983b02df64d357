"""Several modes' step times measured in turn, in one process: how ``capacity`` compares speeds.

Note: [Speeds are compared step by step]
On a virtual machine the host decides how fast the guest runs, and it changes its mind: on this
2-core VM keep-all on the ``deep`` preset at 13 samples took 0.55-0.59 s per step in three
processes and 0.71-0.73 s in two others, one of which moved from the first speed to the second in
the middle of its run; the process's CPU time moved with it (1.12 against 1.41 CPU-seconds per
step), so the same instructions ran slower. Comparing two strategies each measured in its own
process then compares two draws of the host's state: ``capacity`` found offload-all's tokens/s at
keep-all's largest batch from 0.84x to 1.42x full recompute's in four runs of the same code. Here
every mode has its own model, optimiser and context in one process, and the modes take turns one
step at a time, so a ratio compares steps that ran under the same host state. In one such process
those steps came to keep-all 0.70 s, offload-all 0.89 s, full recompute 1.08 s.

Only speeds and losses come from here. Peaks do not: one mode's freed memory would hide the next
one's (``tba/bench/harness.py``), which is why ``capacity``'s searches run each measurement in a
process of its own. Every mode's step ``k`` seeds the RNG alike and follows the same ``k``
optimiser steps, so exact modes give identical losses step for step.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Sequence
from typing import Any

from tba.allocator import detect
from tba.bench._forkserver import ForkServer
from tba.bench.isolated import check_allocator, run_request
from tba.bench.mode_run import ModeResult, ModeRun
from tba.bench.models import PRESETS, GPTConfig, make_batch, make_gpt

TARGET = "tba.bench.interleaved:_worker"
"""What a fork server runs for :func:`run_interleaved_isolated`."""


def run_interleaved(modes: Sequence[str], config: GPTConfig, *, rounds: int = 3, warmup: int = 1,
                    directory: str | None = None, backend: str = "auto", seed: int = 0, device: str = "cpu",
                    threads: int | None = None, offload_options: dict[str, dict[str, Any]] | None = None,
                    usage: str = "reusable", compile_mode: str = "none") -> dict[str, ModeResult]:
    """Train the built-in GPT under each of ``modes`` in this process, one step of each in turn.

    Each mode takes ``warmup`` unmeasured steps (an adaptive mode also its profiled ones), then
    ``rounds`` measured ones; ``offload_options`` maps a mode to its options; ``usage`` and
    ``compile_mode`` are as for :func:`tba.bench.harness.run_steps`. Returns each mode's
    step times and losses (warm-up steps' losses included); its peaks mean nothing here.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    if len(set(modes)) != len(modes):
        raise ValueError(f"each mode once: got {list(modes)}")
    runs: dict[str, ModeRun] = {}
    try:
        for mode in modes:
            runs[mode] = ModeRun(mode, make_gpt(config, seed=seed), make_batch(config, seed=seed), directory=directory,
                                 backend=backend, seed=seed, offload_options=(offload_options or {}).get(mode),
                                 device=device, threads=threads, warmup=warmup, usage=usage,
                                 compile_mode=compile_mode)
        # A mode with more warm-up steps (an adaptive one profiles) starts that many turns earlier,
        # so that every mode's measured steps share their turns; each counts its own steps.
        longest = max(run.warmup for run in runs.values())
        for turn in range(longest + rounds):
            for run in runs.values():
                step = turn - (longest - run.warmup)
                if step >= 0:
                    run.step(step, measured=step >= run.warmup)
    except BaseException:
        for run in runs.values():
            run.abandon()
        raise
    for run in runs.values():
        run.finish()
    return {mode: run.result for mode, run in runs.items()}


def run_interleaved_isolated(modes: Sequence[str], preset: str, *, allocator: str = "system",
                             malloc_env: bool = True, server: ForkServer | None = None,
                             config_overrides: dict[str, Any] | None = None, **kwargs: Any) -> dict[str, ModeResult]:
    """:func:`run_interleaved` in a fresh process (forked from ``server`` when given, as
    :func:`tba.bench.isolated.run_isolated` does); raises
    :class:`~tba.bench.isolated.IsolatedRunError` when it fails."""
    request = json.dumps({"modes": list(modes), "preset": preset, "config_overrides": config_overrides or {}, **kwargs})
    last_line, stderr = run_request(request, "+".join(modes), module="tba.bench.interleaved", target=TARGET,
                                    server=server, allocator=allocator, malloc_env=malloc_env)
    results = {mode: ModeResult(**fields) for mode, fields in json.loads(last_line).items()}
    for result in results.values():
        check_allocator(result, allocator, malloc_env, stderr)
    return results


def _worker(request_json: str) -> None:
    request = json.loads(request_json)
    config = dataclasses.replace(PRESETS[request.pop("preset")], **request.pop("config_overrides"))
    results = run_interleaved(request.pop("modes"), config, **request)
    for result in results.values():
        result.allocator = detect().name
    print(json.dumps({mode: dataclasses.asdict(result) for mode, result in results.items()}))


if __name__ == "__main__":
    _worker(sys.argv[1])
