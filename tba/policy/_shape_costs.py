"""What the search needs of every placement shape, without running the cost model on each.

The adaptive planner (``tba/policy/_adaptive.py``) considers every shape ``O^a R^r K^k`` and
``O^a S^r K^k`` of :func:`~tba.policy._plan.shapes`, about ``L^2`` of them, and
:func:`~tba.policy._model.estimate` walks all ``L`` layers, several times per shape while a window
is searched: planning took ``L^3`` steps (14-20 s for 96 layers). :class:`ShapeCosts` reads the
profile once into prefix sums, prefix maxima and range maxima, then answers per shape:

* :meth:`ShapeCosts.memory_bytes`: ``estimate(...).memory_bytes`` exactly, in a few steps (integer
  arithmetic on the same terms; a profile with non-integer sizes is sent to :func:`estimate`);
* ``tba/policy/_step_floor.py``: a lower bound of ``estimate(...).step_s`` at every window.

Note: [The search prunes on lower bounds]
Each goal ranks shapes by a key that starts with a quantity bounded from below cheaply: the step
time for a memory budget and for the overhead bound's fastest placement, the activation peak at
the smallest window for the overhead bound's least memory (the peak never shrinks with the window:
every window term is ``min(max(P, m), bytes)``). The search costs shapes with :func:`estimate` in
the order of that bound and stops at the first whose bound exceeds the best key found: no later
shape can win, so the chosen plan is the one of costing every shape, ties going to the earlier
shape of :func:`~tba.policy._plan.shapes` as before. The step bound: Note [A spilled layer's read
starts no earlier than D layers above it] in ``tba/policy/_step_floor.py``.
"""

from __future__ import annotations

import math

from tba.policy._model import estimate
from tba.policy._placement import KEEP, OFFLOAD, OFFLOADED_RECOMPUTE, RECOMPUTE
from tba.policy._profile import Profile

Shape = tuple[int, bool, int]
"""``(a, s, r)``: ``a`` layers offloaded, then ``r`` recomputed (with their input offloaded when ``s``), the rest kept."""


def shape_list(layer_count: int) -> list[Shape]:
    """:func:`~tba.policy._plan.shapes` as ``(a, s, r)``, in its order."""
    out = []
    for offload in range(layer_count + 1):
        for recompute in range(layer_count - offload + 1):
            out.append((offload, False, recompute))
            if recompute:
                out.append((offload, True, recompute))
    return sorted(out, key=lambda shape: (shape[0] + shape[2], shape[2] if shape[1] else 0, -shape[0]))


def decisions_of(shape: Shape, layer_count: int) -> tuple[str, ...]:
    offload, inputs, recompute = shape
    middle = OFFLOADED_RECOMPUTE if inputs else RECOMPUTE
    return (OFFLOAD,) * offload + (middle,) * recompute + (KEEP,) * (layer_count - offload - recompute)


class _RangeMax:
    """Maximum of ``values[lo:hi]`` in two look-ups (a sparse table)."""

    def __init__(self, values: list) -> None:
        self.rows = [list(values)]
        width = 1
        while 2 * width <= len(values):
            row = self.rows[-1]
            self.rows.append([max(row[i], row[i + width]) for i in range(len(row) - width)])
            width *= 2

    def __call__(self, lo: int, hi: int):
        level = (hi - lo).bit_length() - 1
        row = self.rows[level]
        return max(row[lo], row[hi - (1 << level)])


class ShapeCosts:
    """The exact predicted memory of one profile's placement shapes (module docstring); ``windows``: those asked
    for most, whose range maxima are built once (another window's take a pass over its recomputed layers)."""

    def __init__(self, profile: Profile, windows: tuple[int, ...] = ()) -> None:
        layers = profile.layers
        self.profile = profile
        self.count = n = len(layers)
        self.saved = s = [layer.saved_bytes for layer in layers]
        self.inputs = x = [layer.input_bytes for layer in layers]
        self.recomputable_before = [0]
        for layer in layers:
            self.recomputable_before.append(self.recomputable_before[-1] + (not layer.recomputable))
        self.exact = all(type(v) is int for v in (*s, *x, profile.max_storage_bytes))
        if not self.exact:
            return
        self.saved_sums, self.input_sums = [0], [0]
        for si, xi in zip(s, x):
            self.saved_sums.append(self.saved_sums[-1] + si)
            self.input_sums.append(self.input_sums[-1] + xi)
        self.pairs = bool(profile.prefetch_depth_layers)  # a layer's read window holds the spilled layer below's too
        pair_max, self.offload_pair_max = 0, [0]
        for i in range(n):
            pair_max = max(pair_max, s[i] + (s[i - 1] if i and self.pairs else 0))
            self.offload_pair_max.append(pair_max)
        self.input_pairs = [x[i] + (x[i - 1] if i and self.pairs else 0) for i in range(n)]
        self.input_pair_max = _RangeMax(self.input_pairs)
        self.recompute_peak = _RangeMax([self.input_sums[i + 1] + s[i] for i in range(n)])
        self._by_window = {cap: self._input_peaks(cap) for cap in {max(w, profile.max_storage_bytes) for w in windows}}
        self._backlogs(profile)

    def _backlogs(self, profile: Profile) -> None:
        """The model's write backlog at forward's end (``_model._forward``) of ``O^a`` and of the ``S^r`` after it."""
        write_bps, end_of_forward = profile.write_bytes_per_s, sum(layer.forward_s for layer in profile.layers)
        starts, layer_start = [], 0.0
        for layer in profile.layers:
            starts.append(layer_start)
            layer_start += layer.forward_s

        def unwritten(end: float, nbytes: int) -> int:
            return int(min(max((end - end_of_forward) * write_bps, 0.0), nbytes)) if end > end_of_forward else 0

        forward = [layer.forward_s for layer in profile.layers]
        self.offload_backlog, offload_ends, write_free = [0], [0.0], 0.0
        for i, nbytes in enumerate(self.saved):
            write_free = max(max(write_free, starts[i]) + nbytes / write_bps, starts[i] + forward[i])
            offload_ends.append(write_free)
            self.offload_backlog.append(self.offload_backlog[-1] + unwritten(write_free, nbytes))
        self.input_backlog = []
        for offload in range(self.count + 1):
            write_free, total, sums = offload_ends[offload], 0, [0]
            for i in range(offload, self.count):
                write_free = max(max(write_free, starts[i]) + self.inputs[i] / write_bps, starts[i] + forward[i])
                total += unwritten(write_free, self.inputs[i])
                sums.append(total)
            self.input_backlog.append(sums)

    def allowed(self, shape: Shape) -> bool:
        """Whether ``shape`` recomputes no layer the profile marks as not recomputable."""
        offload, _, recompute = shape
        return self.recomputable_before[offload + recompute] == self.recomputable_before[offload]

    def memory_bytes(self, shape: Shape, window_bytes: int) -> int:
        """``estimate(profile, decisions_of(shape), window_bytes).memory_bytes``, in a few steps (``_memory.py``)."""
        if not self.exact:
            return estimate(self.profile, decisions_of(shape, self.count), window_bytes).memory_bytes
        profile, n, s, x = self.profile, self.count, self.saved, self.inputs
        offload, inputs, recompute = shape
        end = offload + recompute
        cap = max(window_bytes, profile.max_storage_bytes)
        backlog = self.offload_backlog[offload] + (self.input_backlog[offload][recompute] if inputs else 0)
        recomputed_inputs = 0 if inputs else self.input_sums[end] - self.input_sums[offload]
        start = backlog + self.saved_sums[n] - self.saved_sums[end] + recomputed_inputs
        reads = min(cap, self.offload_pair_max[offload]) if offload else 0  # offloaded layers: nothing below is held
        peak = max(start, reads)
        if recompute:
            below = s[offload - 1] if offload and self.pairs else 0
            if inputs:  # S: internals rebuilt while its input (and the spilled layer below's) is read back
                first = min(cap, x[offload] + below)
                reads = max(reads, first)
                peak = max(peak, first + s[offload])
                if recompute > 1:
                    peaks = self._by_window.get(cap)
                    peak = max(peak, peaks(offload + 1, end) if peaks else max(self._input_peaks(cap, offload + 1, end)))
                    reads = max(reads, min(cap, self.input_pair_max(offload + 1, end)))
            else:  # R: internals rebuilt on top of the inputs of the recomputed layers below
                peak = max(peak, min(cap, below) + s[offload] + x[offload])
                if recompute > 1:
                    peak = max(peak, self.recompute_peak(offload + 1, end) - self.input_sums[offload])
        if end < n:  # the first kept layer also reads the spilled layer below it
            spilled_below = self.pairs and ((inputs and recompute) or (offload and not recompute))
            below = (x[end - 1] if recompute else s[end - 1]) if spilled_below else 0
            peak = max(peak, recomputed_inputs + min(cap, below) + s[end])
        early = self._early_reads(shape, cap)
        if end == n and recompute:
            # Note: [A recomputed top layer rebuilds on top of forward's leftovers]
            peak = max(peak, start + s[n - 1] + early)
        held = 0 if end < n or (recompute and not inputs) else reads
        peak = max(peak, start + max(held, early))
        headroom = profile.memory_headroom_per_io_byte * (backlog + max(reads, early))
        return peak + profile.memory_slack_bytes + math.ceil(headroom)

    def _early_reads(self, shape: Shape, cap: int) -> int:
        """``_memory._early_reads``: the spilled bytes within the prefetch depth of the top layer, up to the window."""
        depth = self.profile.prefetch_depth_layers
        if not depth:
            return 0
        offload, inputs, recompute = shape
        first = max(0, self.count - 1 - depth)
        total = self.saved_sums[offload] - self.saved_sums[first] if offload > first else 0
        if inputs and offload + recompute > max(offload, first):
            total += self.input_sums[offload + recompute] - self.input_sums[max(offload, first)]
        return min(cap, total) if total else 0

    def _input_peaks(self, cap: int, lo: int = 0, hi: int | None = None):
        """``min(cap, x_i + x_{i-1}) + s_i`` (an S layer's working set above the first) for ``lo <= i < hi``:
        range maxima of all of them (the windows given when built), or the list."""
        values = [min(cap, pair) + saved for pair, saved in zip(self.input_pairs[lo:hi], self.saved[lo:hi])]
        return _RangeMax(values) if hi is None else values
