"""The adaptive planner: from a profile and a goal to a per-layer keep / offload / recompute plan.

:func:`plan` is a pure function of a :class:`~tba.policy._profile.Profile`; costs come from the
model in :mod:`tba.policy._model`. Two goals:

* ``memory_budget_bytes=N``: the fastest placement whose predicted activation peak is at most
  ``N`` bytes. A budget is a contract: when no placement fits, planning raises
  :class:`~tba.errors.TbaConfigError` naming the least the model needs (the placement with the
  least predicted memory, transient buffers measured during profiling included);
* ``overhead_bound=x``: the placement with the least predicted activation peak whose predicted
  step time is at most ``(1 + x)`` times the fastest placement's (keep-all's, in this model).
  Without a goal, ``x`` is :data:`tba.defaults.ADAPTIVE_OVERHEAD_BOUND`.

The search space is every placement :func:`~tba.policy._plan.shapes` lists, such as ``O^a R^r K^k`` (``a + r + k = L``): offload
the first ``a`` layers (they have the most forward time ahead to hide their writes), recompute the
next ``r`` (their I/O could not hide and their memory is still over budget), keep the last ``k``
(backward needs them first, so keeping them costs no I/O). ``k = L - a, r = 0`` with the largest
``a`` whose writes are hidden is the TBA paper's placement. For every shape the prefetch window
``P`` is chosen too: with a memory budget, the largest window (at most the offloader's prefetch
budget, at least two of the largest storage) that fits; with an overhead bound, the smallest window
that meets the bound (binary search on MiB; predicted time never grows with ``P``), ties going to
the faster placement, then the one moving fewer bytes. When no placement reaches an overhead
bound, the fastest plan is returned with ``fits=False``, and a warning is logged. Among equally fast placements within a
memory budget the one moving the fewest bytes wins (I/O competes for memory bandwidth and CPU,
which the model leaves out), then the one with less memory.

:class:`Adaptive` is a policy like those of ``_plan.py`` (``policy.plan(profile) -> Plan``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import numbers
from collections.abc import Callable
from typing import Any

from tba._units import SizeError, parse_size
from tba.defaults import ADAPTIVE_OVERHEAD_BOUND, MIB
from tba.errors import TbaConfigError
from tba.policy._model import estimate, forward_write_caps
from tba.policy._placement import OFFLOAD, RECOMPUTE, RECOMPUTED
from tba.policy._plan import Plan, Policy, _io_bytes, _plan_of, min_window_bytes, shapes
from tba.policy._profile import Profile

logger = logging.getLogger("tba")

Candidate = tuple[Any, tuple[str, ...], int]
"""``(sort key, decisions, window bytes)``: a placement the search has costed."""


def allowed_shapes(profile: Profile) -> list[tuple[str, ...]]:
    """The placement shapes that recompute no layer the profile marks as not recomputable."""
    return [decisions for decisions in shapes(len(profile.layers))
            if all(layer.recomputable or decision not in RECOMPUTED for layer, decision in zip(profile.layers, decisions))]


def _lower(current: Candidate | None, candidate: Candidate) -> Candidate:
    """The candidate with the lower key (the current one on a tie)."""
    return candidate if current is None or candidate[0] < current[0] else current


Rank = Callable[[tuple[str, ...], int, int], tuple[Candidate, "Candidate | None"]]
"""Costs one placement shape, given the window range: its fallback candidate, and its candidate
when it meets the goal (else None)."""


def _search(profile: Profile, goal: str, rank: Rank, warning: Callable[[Plan], None]) -> Plan:
    """The lowest candidate over every placement shape that meets the goal; when none does, after
    ``warning(lowest fallback)``, that fallback, marked as not fitting."""
    low, high = min_window_bytes(profile), profile.max_window_bytes
    best: Candidate | None = None
    fallback: Candidate | None = None
    for decisions in allowed_shapes(profile):
        option, met = rank(decisions, low, high)
        fallback = _lower(fallback, option)
        if met is not None:
            best = _lower(best, met)
    if best is not None:
        return _plan_of(profile, best[1], best[2], goal)
    closest = _plan_of(profile, fallback[1], fallback[2], goal, fits=False)
    warning(closest)
    return closest


class Adaptive(Policy):
    """Keep, offload or recompute per layer to meet one goal; see the module docstring.

    Args:
        memory_budget_bytes: Use at most this many activation bytes (an int or a size such as ``"2G"``),
            as fast as possible.
        overhead_bound: Least memory with step time within ``(1 + overhead_bound)`` of the fastest
            placement. At most one of the two; neither: ``overhead_bound`` =
            :data:`~tba.defaults.ADAPTIVE_OVERHEAD_BOUND`.

    Raises:
        TbaConfigError: both goals, a negative one, or one that is not a number (a size, for the budget; a finite
            number, for the bound).
    """

    name = "adaptive"

    def __init__(self, *, memory_budget_bytes: int | None = None, overhead_bound: float | None = None) -> None:
        if memory_budget_bytes is not None and overhead_bound is not None:
            raise TbaConfigError("give one goal: memory_budget_bytes=N or overhead_bound=x, not both")
        if memory_budget_bytes is None and overhead_bound is None:
            overhead_bound = ADAPTIVE_OVERHEAD_BOUND
        if isinstance(memory_budget_bytes, str):
            try:
                memory_budget_bytes = parse_size(memory_budget_bytes)
            except SizeError as err:
                raise TbaConfigError(f"memory_budget_bytes: {err}") from None
        if memory_budget_bytes is not None and (isinstance(memory_budget_bytes, bool)
                                                or not isinstance(memory_budget_bytes, numbers.Integral)):
            raise TbaConfigError(f"memory_budget_bytes must be bytes (an int) or a size such as '2G', "
                                 f"got {type(memory_budget_bytes).__name__} {memory_budget_bytes!r}")
        if overhead_bound is not None and (isinstance(overhead_bound, bool) or not isinstance(overhead_bound, numbers.Real)):
            raise TbaConfigError(f"overhead_bound must be a number such as 0.1, got {type(overhead_bound).__name__} "
                                 f"{overhead_bound!r}")
        if overhead_bound is not None and not math.isfinite(overhead_bound):
            # NaN compares false with every step time: the least-memory placement "fit" whatever it cost.
            raise TbaConfigError(f"overhead_bound must be a finite number such as 0.1, got {overhead_bound!r}")
        if memory_budget_bytes is not None and memory_budget_bytes < 0:
            raise TbaConfigError(f"memory_budget_bytes must be >= 0, got {memory_budget_bytes}")
        if overhead_bound is not None and overhead_bound < 0:
            raise TbaConfigError(f"overhead_bound must be >= 0, got {overhead_bound}")
        self.memory_budget_bytes = memory_budget_bytes
        self.overhead_bound = overhead_bound

    def plan(self, profile: Profile) -> Plan:
        if self.memory_budget_bytes is not None:
            return self._fastest_within(profile.for_budget(), self.memory_budget_bytes)
        return self._smallest_within(profile, self.overhead_bound)

    def _fastest_within(self, profile: Profile, budget: int) -> Plan:
        def rank(decisions: tuple[str, ...], low: int, high: int) -> tuple[Candidate, Candidate | None]:
            window = self._largest_window(profile, decisions, budget, low, high)
            cost = estimate(profile, decisions, window if window is not None else low)
            least = (cost.memory_bytes, cost.step_s, decisions.count(RECOMPUTE), -decisions.count(OFFLOAD))
            if window is None:
                return (least, decisions, low), None
            key = (round(cost.step_s, 9), _io_bytes(profile, decisions), cost.memory_bytes, decisions.count(RECOMPUTE))
            return (least, decisions, window), (key, decisions, window)

        def refuse(least: Plan) -> None:
            slack = profile.memory_slack_bytes
            raise TbaConfigError(
                f"memory_budget={budget / MIB:.1f} MiB cannot be met: this model needs at least "
                f"{least.predicted_memory_bytes / MIB:.1f} MiB of activations (plan {least.code}"
                f"{f', {slack / MIB:.1f} MiB of it transient buffers measured while profiling' if slack else ''}); "
                "raise memory_budget, or lower the batch size or sequence length")

        chosen = _search(profile, f"memory_budget_bytes={budget}", rank, refuse)
        caps = forward_write_caps(profile, chosen.decisions, chosen.window_bytes, budget)
        return dataclasses.replace(chosen, write_caps_bytes=caps)

    @staticmethod
    def _largest_window(profile: Profile, decisions: tuple[str, ...], budget: int, low: int, high: int) -> int | None:
        """The largest window in ``[low, high]`` (MiB steps below ``high``) fitting ``budget``, else None."""
        if estimate(profile, decisions, high).memory_bytes <= budget:
            return high
        if OFFLOAD not in decisions or estimate(profile, decisions, low).memory_bytes > budget:
            return None
        lo, hi = low // MIB, high // MIB
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if mid * MIB < high and estimate(profile, decisions, mid * MIB).memory_bytes <= budget:
                lo = mid
            else:
                hi = mid - 1
        return max(lo * MIB, low)

    def _smallest_within(self, profile: Profile, bound: float) -> Plan:
        def rank(decisions: tuple[str, ...], low: int, high: int) -> tuple[Candidate, Candidate | None]:
            cost = estimate(profile, decisions, high)
            fastest = ((round(cost.step_s, 9), cost.memory_bytes), decisions, high)
            if cost.step_s > (1 + bound) * floor + 1e-9:
                return fastest, None
            window = self._smallest_window(profile, decisions, (1 + bound) * floor, low, high)
            cost = estimate(profile, decisions, window)
            key = (cost.memory_bytes, round(cost.step_s, 9), _io_bytes(profile, decisions), decisions.count(RECOMPUTE))
            return fastest, (key, decisions, window)

        floor = min(estimate(profile, decisions, profile.max_window_bytes).step_s
                    for decisions in allowed_shapes(profile))
        return _search(profile, f"overhead_bound={bound:g}", rank, lambda _: logger.warning(
            "tba: no placement is within overhead_bound=%g; using the fastest one", bound))

    @staticmethod
    def _smallest_window(profile: Profile, decisions: tuple[str, ...], limit_s: float, low: int, high: int) -> int:
        """The smallest window (MiB steps) in ``[low, high]`` whose predicted step time is within ``limit_s``."""
        if OFFLOAD not in decisions or estimate(profile, decisions, low).step_s <= limit_s + 1e-9:
            return low if OFFLOAD in decisions else high
        lo, hi = low // MIB + 1, -(-high // MIB)
        while lo < hi:
            mid = (lo + hi) // 2
            if estimate(profile, decisions, min(mid * MIB, high)).step_s <= limit_s + 1e-9:
                hi = mid
            else:
                lo = mid + 1
        return min(lo * MIB, high)


def plan(profile: Profile, *, memory_budget_bytes: int | None = None, overhead_bound: float | None = None) -> Plan:
    """The adaptive placement for ``profile`` (pure). See the module docstring for the model.

    Args:
        profile: Measured (:class:`~tba.policy._runner.PolicyRunner` builds one) or synthetic.
        memory_budget_bytes: Fastest placement using at most this many activation bytes.
        overhead_bound: Least-memory placement within ``(1 + overhead_bound)`` x the fastest
            placement's time. Neither: the default goal (module docstring).

    Raises:
        ValueError: both goals, or a negative one.
        TbaConfigError: no placement fits ``memory_budget_bytes``.
    """
    return Adaptive(memory_budget_bytes=memory_budget_bytes, overhead_bound=overhead_bound).plan(profile)
