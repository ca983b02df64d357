"""A lower bound of a placement shape's predicted step time, in a few steps per shape.

The adaptive search (Note [The search prunes on lower bounds] in ``tba/policy/_shape_costs.py``)
costs a shape with :func:`~tba.policy._model.estimate` only when :meth:`StepFloor.step_s` says it
could win. The bound is the model's step time (``_model.py``: ``T_f + C_b + stall + c sum o + u``)
from prefix sums over the layers, with the read stall bounded from below (the Note), lowered by
:data:`FLOOR_MARGIN` of itself: the sums run in another order than the model's, and that margin is
far more than the rounding of adding up a million layers (about ``1e-10``).

Note: [A spilled layer's read starts no earlier than D layers above it]
In the model's backward (``_model._backward``) a spilled layer ``j``'s read is issued at the start
of backward (within ``D`` layers of the top), while layer ``j + D`` runs (a prefetch), or when
backward reaches ``j``: never before layer ``min(j + D, L - 1)`` starts, which is after the
compute of every layer above it. Reads are one FIFO queue at ``R``, and a spilled layer ends no
earlier than its read. So for every spilled ``j`` backward lasts at least
``sum_{i > j + D} d_i + sum_{j' <= j} o_{j'} / R``: the compute above the first moment any of the
layers ``<= j`` can be read, then all of their reads. Less backward's compute ``sum d_i``, the
largest of these over ``j`` bounds the model's stall from below: on a shape whose offloaded layers
read slower than their backward runs, it is their excess read time, which an overhead bound
rejects.
"""

from __future__ import annotations

import math

from tba.policy._profile import Profile

FLOOR_MARGIN = 1e-9
"""Fraction of a step bound (plus the profile's compute and read seconds) it is lowered by, for rounding."""


class StepFloor:
    """Lower bounds of :func:`~tba.policy._model.estimate`'s ``step_s`` of ``(a, s, r)`` shapes, at any window."""

    def __init__(self, profile: Profile) -> None:
        layers = profile.layers
        self.profile = profile
        self.count = n = len(layers)
        self.saved = [layer.saved_bytes for layer in layers]
        self.inputs = [layer.input_bytes for layer in layers]
        self.forward_end = sum(layer.forward_s for layer in layers)
        self.depth = depth = int(profile.prefetch_depth_layers)
        read_bps = profile.read_bytes_per_s
        self.plain, self.recomputed, self.saved_read, self.input_read = ([0.0] for _ in range(4))
        for i in range(n):
            self.plain.append(self.plain[-1] + layers[i].backward_s)
            self.recomputed.append(self.recomputed[-1] + layers[i].backward_s + layers[i].forward_s)
            self.saved_read.append(self.saved_read[-1] + self.saved[i] / read_bps)
            self.input_read.append(self.input_read[-1] + self.inputs[i] / read_bps)
        self.spilled, self.inputs_spilled = [0], [0]
        for saved, nbytes in zip(self.saved, self.inputs):
            self.spilled.append(self.spilled[-1] + saved)
            self.inputs_spilled.append(self.inputs_spilled[-1] + nbytes)
        self.scale = self.recomputed[-1] + self.saved_read[-1] + self.input_read[-1]  # seconds the bounds' sums add up
        # Offloaded j (all below offloaded, none above j + D recomputed): reads to j less compute to j + D.
        offloaded, self.offloaded_best = [], [-float("inf")]
        for j in range(max(0, n - depth - 1)):
            offloaded.append(self.saved_read[j + 1] - self.plain[j + depth + 1])
            self.offloaded_best.append(max(self.offloaded_best[-1], offloaded[-1]))
        # S layer j (S up to j + D): its part of the same, the rest depending on where the S run starts.
        self.input_excess = [self.input_read[j + 1] - self.recomputed[j + depth + 1] for j in range(max(0, n - depth - 1))]
        self.input_rows = [self.input_excess]
        width = 1
        while 2 * width <= len(self.input_excess):
            row = self.input_rows[-1]
            self.input_rows.append([max(row[i], row[i + width]) for i in range(len(row) - width)])
            width *= 2

    def _input_best(self, lo: int, hi: int) -> float:
        level = (hi - lo).bit_length() - 1
        row = self.input_rows[level]
        return max(row[lo], row[hi - (1 << level)])

    def step_s(self, shape: tuple[int, bool, int]) -> float:
        """At most ``estimate(profile, decisions_of(shape)).step_s``, at every window."""
        offload, inputs, recompute = shape
        profile, end = self.profile, offload + recompute
        compute = self._compute_to(self.count, offload, end)
        spilled = self.spilled[offload] + (self.inputs_spilled[end] - self.inputs_spilled[offload] if inputs else 0)
        # The model's C + max(0, B - C - e o) is max(C, B - e o), and B >= C + excess.
        stall = max(0.0, self._read_excess(offload, end if inputs else offload, end) - profile.read_stall_credit_s_per_byte
                    * spilled)
        step = self.forward_end + compute + stall + profile.io_overhead_s_per_byte * spilled + profile.outside_s
        floor = step - FLOOR_MARGIN * (step + self.scale)
        # inf - inf: times beyond floats (Note [A profile the model cannot price] lets 1e308 s through) bound nothing.
        return floor if floor == floor else -math.inf

    def _compute_to(self, i: int, offload: int, end: int) -> float:
        """Backward's compute of layers ``< i`` for the shape recomputing layers ``offload .. end - 1``."""
        if i <= offload:
            return self.plain[i]
        if i <= end:
            return self.plain[offload] + self.recomputed[i] - self.recomputed[offload]
        return self.plain[offload] + self.recomputed[end] - self.recomputed[offload] + self.plain[i] - self.plain[end]

    def _read_to(self, j: int, offload: int) -> float:
        """Read seconds of spilled layers ``<= j`` (offloaded below ``offload``, S from there)."""
        if j < offload:
            return self.saved_read[j + 1]
        return self.saved_read[offload] + self.input_read[j + 1] - self.input_read[offload]

    def _read_excess(self, offload: int, spilled_end: int, end: int) -> float:
        """The largest ``reads to j - compute to j + D`` over spilled ``j < spilled_end`` (Note [A spilled layer's read
        starts no earlier than D layers above it]); -inf when nothing spills."""
        if not spilled_end:
            return -float("inf")
        n, depth = self.count, self.depth
        free = n - depth - 1  # j below this: layer j + D + 1 exists
        best = self._read_to(spilled_end - 1, offload) - self._compute_to(min(spilled_end + depth, n), offload, end)
        whole = max(0, min(offload - depth, free))  # j + D + 1 <= offload: nothing recomputed up to there
        best = max(best, self.offloaded_best[whole])
        edge = range(whole, min(offload, free))
        if spilled_end > offload:
            runs = max(offload, min(spilled_end - depth, free))  # j + D + 1 <= end: S layers only up to there
            if runs > offload:
                shift = self.saved_read[offload] - self.input_read[offload] - self.plain[offload] + self.recomputed[offload]
                best = max(best, shift + self._input_best(offload, runs))
            edge = [*edge, *range(runs, min(spilled_end, free))]
        for j in edge:
            best = max(best, self._read_to(j, offload) - self._compute_to(j + depth + 1, offload, end))
        return best
