"""Memory model: the predicted activation peak of a per-layer placement.

The notation is ``tba/policy/_model.py``'s, which adds this peak to its predicted step time.

Memory (activation bytes; storages saved outside the layers are left out, they are the same for
every plan). The peak is the larger of the start of backward::

    A = sum_{K} s_j + sum_{R} x_j + backlog + max(early reads, max_{O} w_i [no K, no R layer])

(early reads: the spilled layers within ``depth`` of the last layer, read when forward ends; a
reusable offloader keeps the read buffers of one backward for the next, up to the window, so the
largest offloaded working set ``w_i`` below is held through forward too, unless the plan keeps or
recomputes a layer: Note [Idle read buffers and kept layers])

and, during backward through layer ``i``, what layers below it still hold plus its working set::

    B_i = sum_{K, j<i} s_j + sum_{R, j<i} x_j + w_i
    w_i = s_i + r_i (K),  s_i + x_i + r_i (R: internals rebuilt, input held),
          v_i = min(max(P, m), o_i + o_{i-1} [i-1 offloaded]) (O: the prefetch window),
          s_i + v_i (S: internals rebuilt, input read back through the window)
    r_i = min(max(P, m), o_{i-1}) [i-1 offloaded]: read while layer i's backward runs

Note: [A recomputed top layer rebuilds on top of forward's leftovers]
Backward starts with the top layer. When that layer is recomputed, its internals ``s_{L-1}`` are
rebuilt while everything counted in ``A`` (kept layers, recomputed layers' inputs, and the write
backlog, which has had no time to drain) is still in memory, and so are the reads that backward's
start issued for the topmost spilled layers (up to the window): the peak is at least
``A - max_O w_i + s_{L-1} + early reads``. Without the first part the model put the plan ``OOR``
of the tiny ROK test model (3 layers of about 10 MiB, keep-all 32 MiB) at 24-27 MiB where it
measured up to 32.5 MiB: its two offloaded layers were still unwritten when layer 2 was rebuilt,
and the 90% budget's contract failed about one run in four. Without the early reads, ``ORR`` was
predicted at 26.3 MiB for a 28.8 MiB budget and measured 31.0 MiB in a CI run: layer 0's 8 MiB
window was read back while layer 2 was rebuilt.

Note: [Idle read buffers and kept layers]
A reusable offloader (and the runtime one-shot contexts share) keeps the read buffers of one
backward for the next, so that steady-state reads touch no fresh pages. Through forward they
are idle memory. When every layer spills, forward holds little else and the peak is in backward,
where those buffers are in use anyway. When the plan keeps (or recomputes) a layer, the peak is
at backward's start, on top of everything forward kept, and the idle buffers added a window's
worth to it: on the demo's ``small`` preset (tcmalloc, a 64 MiB window) ``OOKKKK`` peaked at
0.9x keep-all's activation memory. So before forward starts, a plan with a kept or recomputed layer
frees the idle buffers (``StepPlacement.release_idle_reads`` in ``tba/runtime/_runner.py``) and
backward allocates its reads again; this model leaves them out of ``A`` for such plans.

An ``R`` layer's input stays in memory from its forward to its backward (as under plain
checkpoint); an ``S`` layer's goes to the spill file, so between forward and backward the layer
holds nothing beyond the write backlog and the window. ``S`` costs the recomputation plus reading
``x_i``, which is hidden behind the backward of the layers above it like an offloaded layer's read.
The profile's ``memory_slack_bytes`` (measured peak minus this model's prediction for the
profiled steps: compute's transient buffers, gradients, allocator slack) is added to every
prediction, and its ``memory_headroom_per_io_byte`` times the plan's :func:`io_bytes` (what the
disk's speed moves at the peak: backlog and read buffers), so that a plan with no I/O is charged no
headroom for the disk (Note [Headroom scales with a plan's I/O] in ``tba/runtime/_profiling.py``).
"""

from __future__ import annotations

from tba.policy._placement import (
    KEEP,
    OFFLOAD,
    RECOMPUTE,
    RECOMPUTED,
    SPILLED,
    holds_layers_through_forward,
    spilled_bytes,
)
from tba.policy._profile import Profile


def activation_peak(profile: Profile, decisions: tuple[str, ...], window_bytes: int, backlog: int) -> int:
    """Predicted activation peak of ``decisions`` (bytes), without the profile's slack; ``backlog``: bytes unwritten
    when forward ends."""
    layers = profile.layers
    below = 0
    start = backlog
    for layer, decision in zip(layers, decisions):
        if decision == KEEP:
            start += layer.saved_bytes
        elif decision == RECOMPUTE:
            start += layer.input_bytes
    peak = start
    for i, (layer, decision) in enumerate(zip(layers, decisions)):
        working = _read_window(profile, decisions, i, window_bytes)
        if decision != OFFLOAD:
            working += layer.saved_bytes + (layer.input_bytes if decision == RECOMPUTE else 0)
        peak = max(peak, below + working)
        below += layer.saved_bytes if decision == KEEP else layer.input_bytes if decision == RECOMPUTE else 0
    early = _early_reads(profile, decisions, window_bytes)
    top = len(layers) - 1
    if top >= 0 and decisions[top] in RECOMPUTED:
        # Note: [A recomputed top layer rebuilds on top of forward's leftovers]
        peak = max(peak, start + layers[top].saved_bytes + early)
    held = 0 if holds_layers_through_forward(decisions) else _idle_read_buffers(profile, decisions, window_bytes)
    return max(peak, start + max(held, early))


def io_bytes(profile: Profile, decisions: tuple[str, ...], window_bytes: int, backlog: int) -> int:
    """The part of ``decisions``' predicted peak that the disk's speed moves: the write backlog when forward
    ends plus the most read buffers the plan holds at once (backward's early reads, or a spilled layer's
    working set up to the window); 0 for a plan that spills nothing (Note [Headroom scales with a plan's I/O])."""
    reads = max((_read_window(profile, decisions, i, window_bytes) for i, d in enumerate(decisions)
                 if d in SPILLED or (i > 0 and decisions[i - 1] in SPILLED)), default=0)
    return backlog + max(reads, _early_reads(profile, decisions, window_bytes))


def _read_window(profile: Profile, decisions: tuple[str, ...], i: int, window_bytes: int) -> int:
    """Bytes read back while layer ``i``'s backward runs: its own spilled bytes (none when it is kept or recomputed)
    and the spilled layer below's, up to the window."""
    layers = profile.layers
    pair = spilled_bytes(layers[i], decisions[i])
    if i > 0 and decisions[i - 1] in SPILLED and profile.prefetch_depth_layers:
        pair += spilled_bytes(layers[i - 1], decisions[i - 1])
    return min(max(window_bytes, profile.max_storage_bytes), pair)


def read_at_start(decisions: tuple[str, ...], depth: int) -> list[int]:
    """The spilled layers read back while backward's first layer runs: those within ``depth`` layers below
    it (tba prefetches them when forward ends and as that layer's backward begins; Note [Backward through
    kept layers] in ``tba/runtime/_prefetch.py``)."""
    top = len(decisions) - 1
    return [i for i, d in enumerate(decisions) if d in SPILLED and i >= top - depth] if depth else []


def _early_reads(profile: Profile, decisions: tuple[str, ...], window_bytes: int) -> int:
    """Bytes of :func:`read_at_start`'s layers in memory while backward's first layer runs, up to the window."""
    total = sum(spilled_bytes(profile.layers[i], decisions[i])
                for i in read_at_start(decisions, profile.prefetch_depth_layers))
    return min(max(window_bytes, profile.max_storage_bytes), total) if total else 0


def _idle_read_buffers(profile: Profile, decisions: tuple[str, ...], window_bytes: int) -> int:
    """Read buffers kept from one backward for the next (the largest spilled working set)."""
    return max((_read_window(profile, decisions, i, window_bytes) for i, d in enumerate(decisions) if d in SPILLED),
               default=0)
