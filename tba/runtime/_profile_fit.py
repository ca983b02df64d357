"""The I/O terms of a profile fitted to the profiled steps: the forward write bandwidth that reproduces their
backlog (:func:`forward_write_bps`), and the time offloading added beyond compute (:func:`io_time`).

Both serve :meth:`tba.runtime._profiling.Samples.profile`, whose docstring gives the Notes they follow.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from tba.policy import OFFLOAD, Estimate, Profile, estimate

_BISECTIONS = 40
"""Halvings, then bisection steps, of the search for the write bandwidth forward saw (2^-40: exact enough)."""


def forward_write_bps(profile: Profile, backlog_bytes: int) -> float:
    """The write bandwidth (bytes/s) at which the model leaves at least ``backlog_bytes`` of offload-all
    unwritten when forward ends, at most ``profile``'s (the measured one): a geometric bisection.

    An infinite measured bandwidth (no write finished while profiling) starts from one at which each
    layer's bytes are written within the shortest layer's forward. The model's backlog is whole
    bytes per layer, so it may fall short of a measured backlog of everything by one byte a layer.
    """
    offload_all = (OFFLOAD,) * len(profile.layers)
    total = sum(layer.saved_bytes for layer in profile.layers)
    target = min(backlog_bytes, total) - len(profile.layers)

    def backlog(write_bps: float) -> int:
        return estimate(dataclasses.replace(profile, write_bytes_per_s=write_bps), offload_all).backlog_bytes

    high = profile.write_bytes_per_s
    if not math.isfinite(high):
        shortest = min((layer.forward_s for layer in profile.layers if layer.forward_s > 0), default=1.0)
        high = max(total, 1) / shortest
    if target <= 0 or backlog(high) >= target:
        return high
    low = high
    for _ in range(_BISECTIONS):
        low /= 2
        if backlog(low) >= target:
            break
    for _ in range(_BISECTIONS):
        middle = math.sqrt(low * high)
        low, high = (middle, high) if backlog(middle) >= target else (low, middle)
    return low


def io_time(profile: Profile, samples: list[dict[str, Any]], profiled: Estimate,
             cpu: bool) -> tuple[float, float]:
    """``(io_overhead_s_per_byte, read_stall_credit_s_per_byte)`` from the profiled (offload-all)
    steps and the model's prediction for them, ``profiled``.

    On the CPU, the I/O time of a step is its span's wall-clock less the training thread's CPU
    seconds over it, plus the run-queue wait of the other compute threads (Note [I/O time is
    measured within one step], Note [A preempted partner costs the training thread CPU time] in
    ``tba/runtime/_preempted.py``); the shortest over the steps is
    first the model's read stall (what the stall alone exceeds it by is the credit), the rest is
    per spilled byte. Elsewhere, or without CPU spans: the shortest span beyond ``profiled``'s step
    time, per spilled byte. Never below zero; ``(0, 0)`` when no step was timed whole."""
    spilled = sum(layer.saved_bytes for layer in profile.layers)  # what offload-all writes
    if not spilled:
        return 0.0, 0.0
    if cpu:
        # Note [A preempted partner costs the training thread CPU time] in tba/runtime/_preempted.py
        gaps = [s["span_s"] - s["span_cpu_s"] + (s.get("span_preempted_s") or 0.0) for s in samples
                if s.get("span_s") is not None and s.get("span_cpu_s") is not None]
        if gaps:
            measured = max(0.0, min(gaps))
            stall = profiled.read_stall_s
            return max(0.0, measured - stall) / spilled, max(0.0, stall - measured) / spilled
    spans = [s["span_s"] for s in samples if s.get("span_s") is not None]
    if not spans:
        return 0.0, 0.0
    return max(0.0, min(spans) - profiled.step_s) / spilled, 0.0
