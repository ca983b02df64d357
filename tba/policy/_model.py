"""Cost model: predicted step time and activation memory of a per-layer placement.

Each layer ``i`` (forward order, ``L`` layers) is kept (``K``), offloaded (``O``), recomputed
(``R``) or recomputed with its input offloaded (``S``): the placements of ``tba/policy/_placement.py``,
importable from here too. From a :class:`~tba.policy._profile.Profile`
the model uses ``f_i`` (forward seconds), ``b_i`` (backward seconds, measured or estimated as
``2 f_i``), ``s_i`` (distinct bytes saved), ``x_i`` (input bytes), write and read bandwidth ``W``
and ``R`` (bytes/s), the prefetch depth ``D`` and the largest storage ``m``; a plan also fixes the
prefetch window ``P`` (bytes).

Forward. Layer ``i`` runs from ``t_i = f_0 + ... + f_{i-1}``; forward ends at ``T_f = sum f``.
Writes never stall compute. A layer's spilled bytes ``o_i`` (``s_i`` when offloaded, ``x_i``
when ``S``: only its input is written) join one FIFO write queue when the layer starts and cannot
all be written before it ends::

    w_i = max(max(w_prev, t_i) + o_i / W, t_i + f_i)

The layer's write is *hidden* when ``w_i <= T_f``. What is not written by ``T_f`` (the *backlog*,
``sum clamp((w_i - T_f) W, 0, o_i)``) is still in memory when backward starts; the TBA rule
follows: once a layer's bytes cannot be written within the forward time ahead of them, offloading
it and the layers after it saves nothing at the peak.

Backward visits layers ``L-1 .. 0``; layer ``i`` computes for ``d_i = b_i`` (``b_i + f_i`` when
recomputed, ``R`` or ``S``). Reads form one FIFO queue at ``R``. ``O`` and ``S`` layers read back
their ``o_i`` bytes (below, "offloaded" means either and ``s`` their ``o``). An offloaded layer's
read is issued

* at the start of backward when it is within ``D`` layers of the top layer (tba prefetches the
  last layers when forward ends);
* while backward runs through layer ``i`` (of any placement: Note [Backward through kept layers]
  in ``tba/runtime/_prefetch.py``) for layers ``i-1 .. i-D``: at the start of layer ``i`` if the
  window holds both layers (``P >= s_i + s_{i-1}``, with ``s_i = 0`` unless ``i`` is offloaded),
  otherwise at ``start_i + d_i (1 - P / (s_i + s_{i-1}))`` (a smaller window reads later);
* otherwise when backward reaches it (on demand).

Reads stream within a layer, so offloaded layer ``i`` ends at ``max(start_i + d_i + e_i, read_end_i)``,
where ``e_i = (s_i / R) max(0, 1 - P / s_i) / 2`` is the read latency a window smaller than the
layer exposes (the window can run only ``P`` bytes ahead of backward; on average half of the rest
of the layer's read time waits; fitted to the ``small`` preset on a 2-core VM, where 4, 8, 16 and
32 MiB windows cost 17, 12, 6 and 0 ms per 36 MiB layer).
Step time ``T = T_f + C_b + max(0, T_b - C_b - e sum o_i) + c sum o_i + u`` with ``T_b`` the end
of layer 0's backward, ``C_b`` backward's compute (``sum d_i``: ``T_b - C_b`` is the read stall),
``e`` the profile's ``read_stall_credit_s_per_byte`` (what the modelled stall of the profiled
steps exceeded all their measured I/O time by, per spilled byte), ``c`` the
profile's ``io_overhead_s_per_byte``: what the profiled steps took beyond this model, per byte
they spilled (on few cores, tba's I/O threads take CPU from compute), and ``u`` its ``outside_s``:
the measured rest of the step (head, loss, optimiser, the loop), the same for every placement;
keep-all gives ``sum f + sum b + u``. Overheads are ratios of these whole-step times: the layers'
time alone would make offloading look dearer than a user's step shows it to be.

Memory: ``tba/policy/_memory.py``, whose activation peak :func:`estimate` returns with the time, plus
the profile's measured slack and its headroom per byte of the plan's I/O (:func:`memory_bytes`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from tba.policy._memory import activation_peak, io_bytes, read_at_start
from tba.policy._placement import (
    DECISIONS,
    KEEP,
    OFFLOAD,
    OFFLOADED_RECOMPUTE,
    RECOMPUTE,
    RECOMPUTED,
    SPILLED,
    Placement,
    check_decisions,
    spilled_bytes,
)
from tba.policy._profile import Profile

__all__ = [
    "DECISIONS", "KEEP", "OFFLOAD", "OFFLOADED_RECOMPUTE", "RECOMPUTE", "RECOMPUTED", "SPILLED", "Estimate", "Placement",
    "check_decisions", "estimate", "forward_write_caps", "spilled_bytes",
]


@dataclasses.dataclass(frozen=True)
class Estimate:
    """Predicted cost of one placement. Seconds and bytes."""

    step_s: float
    keep_step_s: float
    memory_bytes: int
    read_stall_s: float
    backlog_bytes: int
    hidden_writes: tuple[bool, ...]

    @property
    def overhead(self) -> float:
        """Predicted step time over keep-all's, minus 1 (0.1 means 10% slower)."""
        return self.step_s / self.keep_step_s - 1.0 if self.keep_step_s else 0.0


def _forward(profile: Profile, decisions: tuple[str, ...]) -> tuple[float, int, tuple[bool, ...]]:
    """Forward end time, write backlog at that time, and which offloaded writes are hidden."""
    forward_end = sum(layer.forward_s for layer in profile.layers)
    write_free = 0.0
    layer_start = 0.0
    ends: list[float | None] = []
    for layer, decision in zip(profile.layers, decisions):
        if decision in SPILLED:
            write_free = max(max(write_free, layer_start) + spilled_bytes(layer, decision) / profile.write_bytes_per_s,
                             layer_start + layer.forward_s)
            ends.append(write_free)
        else:
            ends.append(None)
        layer_start += layer.forward_s
    backlog = 0
    for layer, decision, end in zip(profile.layers, decisions, ends):
        if end is not None and end > forward_end:
            unwritten = (end - forward_end) * profile.write_bytes_per_s
            backlog += int(min(max(unwritten, 0.0), spilled_bytes(layer, decision)))
    hidden = tuple(end is not None and end <= forward_end + 1e-12 for end in ends)
    return forward_end, backlog, hidden


def _backward(profile: Profile, decisions: tuple[str, ...], window_bytes: int) -> float:
    """Seconds from the start of backward to the end of layer 0's backward."""
    layers = profile.layers
    depth = profile.prefetch_depth_layers
    spill = [spilled_bytes(layer, d) for layer, d in zip(layers, decisions)]
    issue: dict[int, float] = dict.fromkeys(read_at_start(decisions, depth), 0.0)
    read_free = 0.0
    read_end: dict[int, float] = {}
    now = 0.0
    for i in range(len(layers) - 1, -1, -1):
        layer, decision = layers[i], decisions[i]
        duration = layer.backward_s + (layer.forward_s if decision in RECOMPUTED else 0.0)
        if decision in SPILLED:
            issue.setdefault(i, now)
            if i not in read_end:
                read_free = max(read_free, issue[i]) + spill[i] / profile.read_bytes_per_s
                read_end[i] = read_free
        for j in range(i - 1, max(i - depth, 0) - 1, -1):
            if decisions[j] not in SPILLED or j in issue:
                continue
            pair = spill[i] + spill[j]
            delay = 0.0 if window_bytes >= pair else duration * (1.0 - window_bytes / pair)
            issue[j] = now + delay
            read_free = max(read_free, issue[j]) + spill[j] / profile.read_bytes_per_s
            read_end[j] = read_free
        if decision not in SPILLED:
            now += duration
            continue
        exposed = 0.0
        if spill[i] > window_bytes:
            exposed = (spill[i] - window_bytes) / profile.read_bytes_per_s / 2
        now = max(now + duration + exposed, read_end[i])
    return now


def forward_write_caps(profile: Profile, decisions: Sequence[str], window_bytes: int, budget_bytes: int) -> tuple[int, ...]:
    """Per layer, the most offloaded bytes forward may have in flight to the disk while that layer runs.

    Note: [A budget holds back forward's writes]
    The model hides a layer's write behind the forward of the layers after it, at the write
    bandwidth of the profile (for a budget, the rate at which the profiled forward drained its
    writes: ``Profile.for_budget``). A disk that is slower in a later step (another process
    writing, a loaded machine) leaves those bytes in memory longer, on top of the layers kept
    after them: on the ROK test model the plan ``OKK`` for a 28.8 MiB budget, predicted at 28.0,
    measured 33.9 MiB in one CI run. So under a budget the offloader holds forward back (each
    saved tensor waits) while more bytes are being written than the model's own write queue holds
    at the end of that layer, plus one largest storage (just saved, not yet written) and the
    budget's margin over the plan's predicted peak. On a disk as fast as profiled the caps do not
    bind; on a slower one the step takes longer and the peak stays within the budget.
    """
    decisions = check_decisions(decisions, len(profile.layers))
    margin = max(0, budget_bytes - estimate(profile, decisions, window_bytes).memory_bytes)
    allowance = profile.max_storage_bytes + margin
    write_bps = profile.write_bytes_per_s
    queue: list[tuple[float, int]] = []
    write_free = layer_start = 0.0
    caps = []
    for layer, decision in zip(profile.layers, decisions):
        if decision in SPILLED:
            nbytes = spilled_bytes(layer, decision)
            write_free = max(max(write_free, layer_start) + nbytes / write_bps, layer_start + layer.forward_s)
            queue.append((write_free, nbytes))
        layer_start += layer.forward_s
        # Only writes still running count (``end > layer_start``): at an infinite bandwidth (no write
        # finished while profiling) the others would make 0 x inf.
        queued = sum(int(min((end - layer_start) * write_bps, nbytes)) for end, nbytes in queue if end > layer_start)
        caps.append(queued + allowance)
    return tuple(caps)


def memory_bytes(profile: Profile, decisions: tuple[str, ...], window_bytes: int, backlog: int) -> int:
    """The predicted activation peak with the profile's calibration: the model's peak, the measured slack,
    and the headroom for what the plan's I/O can add (Note [Headroom scales with a plan's I/O] in
    ``tba/runtime/_profiling.py``)."""
    headroom = profile.memory_headroom_per_io_byte * io_bytes(profile, decisions, window_bytes, backlog)
    return activation_peak(profile, decisions, window_bytes, backlog) + profile.memory_slack_bytes + math.ceil(headroom)


def estimate(profile: Profile, decisions: Sequence[str], window_bytes: int | None = None,
             backlog_bytes: int | None = None) -> Estimate:
    """Predicted step time and activation peak of ``decisions`` under ``profile``.

    Args:
        profile: The measured or synthetic profile.
        decisions: One of ``"keep"``, ``"offload"``, ``"recompute"``, ``"offloaded_recompute"`` per layer.
        window_bytes: Prefetch window in bytes; None means ``profile.max_window_bytes``.
        backlog_bytes: The write backlog at the end of forward as measured, instead of the model's
            (the profile's calibration: Note [Slack is calibrated on the measured backlog] in
            ``tba/runtime/_profiling.py``); None: the model's.
    """
    decisions = check_decisions(decisions, len(profile.layers))
    window = profile.max_window_bytes if window_bytes is None else window_bytes
    forward_end, backlog, hidden = _forward(profile, decisions)
    if backlog_bytes is not None:
        backlog = backlog_bytes
    backward = _backward(profile, decisions, window)
    compute = sum(layer.backward_s + (layer.forward_s if d in RECOMPUTED else 0.0)
                  for layer, d in zip(profile.layers, decisions))
    keep_step = sum(layer.forward_s + layer.backward_s for layer in profile.layers) + profile.outside_s
    spilled = sum(spilled_bytes(layer, d) for layer, d in zip(profile.layers, decisions))
    stall = max(0.0, backward - compute - profile.read_stall_credit_s_per_byte * spilled)
    return Estimate(
        step_s=forward_end + compute + stall + profile.io_overhead_s_per_byte * spilled + profile.outside_s,
        keep_step_s=keep_step,
        memory_bytes=memory_bytes(profile, decisions, window, backlog),
        read_stall_s=stall,
        backlog_bytes=backlog,
        hidden_writes=hidden,
    )
