"""The measurements behind ``python -m tba capacity``: each strategy's search, then the speeds by turns.

``tba/cli/capacity.py`` describes the tool and holds its command line; this module runs it:
:func:`measure_capacity` searches every strategy (``tba/cli/_capacity_search.py``), each
measurement a child of one fork server, and then compares their speeds at keep-all's largest batch
in one process by turns (Note [Speeds are compared step by step] in ``tba/bench/interleaved.py``),
rewriting the JSON document after every measurement.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import sys
import time
from collections.abc import Callable
from typing import Any

from tba.allocator import launch_env
from tba.bench.interleaved import run_interleaved_isolated
from tba.bench.isolated import ForkServer, IsolatedRunError, fork_server, run_isolated
from tba.bench.models import PRESETS
from tba.cli._capacity_report import StrategyResult, budget_text, plot_png, summary
from tba.cli._capacity_search import MAX_BATCH, MeasureError, Point, Search, find_max_batch
from tba.cli._rok_points import same_losses
from tba.defaults import MIB

logger = logging.getLogger("tba")

STRATEGIES = (("keep", "keep-all", "keep"), ("recompute", "full recompute", "recompute"),
              ("offload", "offload-all", "tba"), ("offloaded_recompute", "offloaded recompute", "offloaded_recompute"),
              ("adaptive", "adaptive", "adaptive"))
"""(name in the JSON, label in the table, harness mode)."""

TOLERANCE = 0.02
"""The search stops once the smallest batch over the budget is within this fraction of the largest
that fits (always at one sample below 50): on this 2-core VM offload-all's peak at about 200
samples varied from 399 to 565 MiB between runs of neighbouring batches (the write backlog follows
the disk), so the last sample's verdict is noise, and each such run takes 15 s."""

NEEDS = re.compile(r"needs at least ([0-9.]+) MiB")
"""Finds the least memory in an adaptive plan's refusal (``TbaConfigError`` from
:mod:`tba.policy._adaptive`), which the search scales the refused batch by."""

ADAPTIVE_PROFILE_STEPS = 1
"""Steps the adaptive runs profile before planning (tba's default is 2): each one is a whole
offloading step, the longest kind at the largest batches."""

SPEED_ROUNDS = 3
"""Measured steps of each strategy in the run that compares their speeds at keep-all's largest batch
(after one warm-up step each), all in one process by turns (Note [Speeds are compared step by step]
in ``tba/bench/interleaved.py``)."""

@dataclasses.dataclass
class Settings:
    """What every measurement shares."""

    preset: str
    budget_bytes: int
    seq_len: int
    device: str = "cpu"
    allocator: str = "auto"
    steps: int = 1
    warmup: int = 0
    directory: str | None = None
    backend: str = "auto"
    threads: int | None = None
    max_batch: int = MAX_BATCH
    strategies: tuple[str, ...] = tuple(name for name, _, _ in STRATEGIES)


class _Lines:
    """Progress lines on stderr, each with the seconds since the start."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.start = time.perf_counter()

    def say(self, text: str) -> None:
        if self.enabled:
            print(f"[{time.perf_counter() - self.start:6.1f} s] {text}", file=sys.stderr, flush=True)


def measure_capacity(settings: Settings, *, json_path: str | None = None, png_path: str | None = None,
                     progress: bool = True) -> tuple[list[StrategyResult], dict[str, Any]]:
    """Run the search for every strategy; returns the results and the JSON document (also written to ``json_path``)."""
    _, malloc = launch_env(settings.allocator)
    lines = _Lines(progress)
    results = [StrategyResult(name, label if name != "adaptive" else f"adaptive {budget_text(settings.budget_bytes)}",
                              mode) for name, label, mode in STRATEGIES if name in settings.strategies]

    def save() -> dict[str, Any]:
        doc = _document(settings, malloc, results)
        if json_path is not None:
            _write_json(json_path, doc)
        return doc

    save()
    with fork_server(allocator=settings.allocator) as server:
        _search_all(settings, results, lines, server, save)
    doc = save()
    if png_path is not None:
        title = f"capacity within {budget_text(settings.budget_bytes)}: {settings.preset}, seq {settings.seq_len}, " \
                f"{settings.device}, {malloc.split(' (')[0]}"
        if not plot_png(results, png_path, seq_len=settings.seq_len, title=title):
            logger.warning("tba: matplotlib is not installed, so no %s; pip install 'tba-offload[plot]' to get it",
                           png_path)
    return results, doc


def _search_all(settings: Settings, results: list[StrategyResult], lines: _Lines, server: ForkServer,
                save: Callable[[], Any]) -> None:
    """Search every strategy in turn, each measurement a child of ``server``; ``save()`` after each."""
    keep_max: int | None = None
    for result in results:
        measure = _measurer(settings, result, lines, server)
        probes = (1, 2) if result.name == "keep" or not keep_max else (keep_max, 2 * keep_max)
        first_guess = None
        if result.name == "adaptive":
            probes, first_guess = _adaptive_start(results, keep_max)
        result.status = "running"

        def on_point(search: Search, result: StrategyResult = result) -> None:
            result.search = search
            save()

        result.search = find_max_batch(measure, settings.budget_bytes, probes=probes, max_batch=settings.max_batch,
                                       first_guess=first_guess, tolerance=TOLERANCE, on_point=on_point)
        if result.search.max_batch is None:
            result.status = "failed"
            lines.say(f"{result.label}: unavailable: {result.search.error}")
            save()
            continue
        if result.name == "keep":
            keep_max = result.search.max_batch
        if keep_max:
            result.keep_max_point = result.search.point(keep_max) or _extra_point(measure, keep_max)
            reference = results[0].keep_max_point if results[0].name == "keep" else None
            if result.keep_max_point.error is None and reference is not None and reference.error is None:
                result.same_loss_at_keep_max = same_losses(result.keep_max_point.losses, reference.losses)
        result.status = "ok"
        verdict = result.search.verdict
        note = "" if verdict == "yes" else " (not confirmed)" if verdict == "no" else f" ({verdict})"
        lines.say(f"{result.label}: largest batch {result.search.max_batch}{note}")
        save()
    if keep_max:
        _compare_speeds(settings, results, lines, server, keep_max)


def _compare_speeds(settings: Settings, results: list[StrategyResult], lines: _Lines, server: ForkServer,
                    keep_max: int) -> None:
    """Every strategy that ran, at keep-all's largest batch, one step of each in turn in one process:
    the speeds the table compares (Note [Speeds are compared step by step] in ``tba/bench/interleaved.py``).

    Losses must match keep-all's step for step. A strategy whose own run failed at that batch is
    left out (one failure would end the run for all). When this run fails, the table keeps each
    strategy's speed from its own process (``tokens_per_s_at_keep_max_own_process``).
    """
    done = [r for r in results if r.status == "ok" and (r.keep_max_point is None or r.keep_max_point.error is None)]
    if len(done) < 2:
        return
    options = {"adaptive": _adaptive_options(settings)}
    lines.say(f"speeds at batch {keep_max}: {', '.join(r.label for r in done)}, one step each in turn ...")
    try:
        runs = run_interleaved_isolated([r.mode for r in done], settings.preset, server=server,
                                        allocator=settings.allocator, rounds=SPEED_ROUNDS, warmup=1,
                                        config_overrides={"batch_size": keep_max, "seq_len": settings.seq_len},
                                        directory=settings.directory, backend=settings.backend, device=settings.device,
                                        threads=settings.threads, offload_options=options)
    except IsolatedRunError as err:
        logger.debug("%s", err.stderr)
        lines.say(f"speeds in one process failed ({err.reason}); the table shows each strategy's own run")
        return
    reference = runs.get("keep")
    for result in done:
        run = runs[result.mode]
        result.speed_point = Point(keep_max, step_s=run.median_step_s, losses=run.losses)
        if reference is not None and result.name != "keep":
            common = min(len(run.losses), len(reference.losses))
            same = same_losses(run.losses[:common], reference.losses[:common])
            result.same_loss_at_keep_max = same and result.same_loss_at_keep_max is not False
        lines.say(f"{result.label}: {run.median_step_s:.2f} s/step at batch {keep_max} (median of {SPEED_ROUNDS})")


def _adaptive_start(results: list[StrategyResult], keep_max: int | None) -> tuple[tuple[int, ...], int | None]:
    """Probes and first guess for the adaptive strategy.

    Its plan spends the budget at every batch, so its peaks draw no line to extrapolate. It can
    reach at most what its placements reach alone, so the search starts at the largest batch
    offload-all or offloaded recompute reached (measured before it), after keep-all's batch (whose
    speed the table compares); a refusal there says how much memory the plan needed, which scales
    the next guess.
    """
    reached = [r.max_batch for r in results if r.name in ("offload", "offloaded_recompute") and r.max_batch]
    probe = keep_max or 1
    return (probe,), (max(reached) if reached and max(reached) > probe else None)


def _adaptive_options(settings: Settings) -> dict[str, Any]:
    """The adaptive strategy's offloader options, in its search runs and in the run by turns alike."""
    return {"memory_budget_bytes": settings.budget_bytes, "profile_steps": ADAPTIVE_PROFILE_STEPS}


def _measurer(settings: Settings, result: StrategyResult, lines: _Lines, server: ForkServer | None = None):
    """``measure(batch)`` for ``result``'s strategy."""
    options = _adaptive_options(settings) if result.name == "adaptive" else None

    def measure(batch: int) -> Point:
        lines.say(f"{result.label}: batch {batch} ...")
        try:
            run = run_isolated(result.mode, settings.preset, steps=settings.steps, warmup=settings.warmup,
                               directory=settings.directory, backend=settings.backend, device=settings.device,
                               threads=settings.threads, allocator=settings.allocator, offload_options=options,
                               prime=True, config_overrides={"batch_size": batch, "seq_len": settings.seq_len},
                               server=server)
        except IsolatedRunError as err:
            logger.debug("%s", err.stderr)
            lines.say(f"{result.label}: batch {batch} failed: {err.reason}")
            needs = NEEDS.search(err.reason)
            raise MeasureError(err.reason, needed_bytes=round(float(needs.group(1)) * MIB) if needs else None) from None
        fits = "fits" if run.footprint_bytes <= settings.budget_bytes else "over"
        lines.say(f"{result.label}: batch {batch}: peak {run.footprint_bytes / MIB:.1f} MiB ({fits}), "
                  f"{run.median_step_s:.2f} s/step")
        return Point(batch, peak_bytes=run.footprint_bytes, step_s=run.median_step_s, losses=run.losses)

    return measure


def _extra_point(measure, batch: int) -> Point:
    try:
        return measure(batch)
    except MeasureError as err:
        return Point(batch, error=str(err))


def _document(settings: Settings, malloc: str, results: list[StrategyResult]) -> dict[str, Any]:
    config = dataclasses.replace(PRESETS[settings.preset], seq_len=settings.seq_len)
    keep = results[0].search if results[0].name == "keep" else None
    return {
        "tool": "capacity", "preset": settings.preset, "device": settings.device,
        "model": {k: v for k, v in dataclasses.asdict(config).items() if k != "batch_size"},
        "seq_len": settings.seq_len, "budget_bytes": settings.budget_bytes, "allocator": malloc,
        "steps": settings.steps, "warmup": settings.warmup, "threads": settings.threads,
        "peak": "most memory above what the process held before its first step, over every step",
        "keep_max_batch": keep.max_batch if isinstance(keep, Search) else None,
        "complete": all(r.status in ("ok", "failed") for r in results),
        "strategies": {r.name: r.as_dict(settings.seq_len) for r in results},
        **summary(results, settings.seq_len),
    }


def _write_json(path: str, doc: dict[str, Any]) -> None:
    """Replace ``path`` in one step, so that a run killed while writing leaves the previous version.

    The file written first is this process's own (its pid in the name: two runs in one directory once
    shared ``capacity.json.partial``, and the second's ``os.replace`` failed with FileNotFoundError) and
    is removed when the write is interrupted (Ctrl-C, SIGTERM, a full disk) instead of left behind.
    """
    partial = f"{path}.{os.getpid()}.partial"
    try:
        with open(partial, "w") as f:
            json.dump(doc, f, indent=2)
        os.replace(partial, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(partial)
        raise
