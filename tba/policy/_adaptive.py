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

The plan is the one costing every shape with :func:`~tba.policy._model.estimate` would choose, but
only the shapes whose cheap lower bounds could still win are costed (Note [The search prunes on
lower bounds] in ``tba/policy/_shape_costs.py``): a few dozen model runs instead of several per
shape, so planning 96 layers takes about 0.1-0.3 s instead of 10-30 s (``python tools/bench_planner.py``).

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
from tba.policy._placement import OFFLOAD, RECOMPUTE
from tba.policy._plan import Plan, Policy, _io_bytes, _plan_of, min_window_bytes
from tba.policy._profile import Profile
from tba.policy._shape_costs import ShapeCosts, decisions_of, shape_list
from tba.policy._step_floor import StepFloor

logger = logging.getLogger("tba")


Best = tuple[Any, int, tuple[str, ...], int]
"""``(sort key, index in shapes order, decisions, window bytes)``: the best placement costed so far."""


def budget_text(budget: int) -> str:
    """A budget in a refusal: MiB to one decimal, or bytes where that would read 0.0 MiB (``memory_budget="1K"``)."""
    if round(budget / MIB, 1) > 0:
        return f"{budget / MIB:.1f} MiB"
    return f"{budget} byte{'' if budget == 1 else 's'}"


def _better(best: Best | None, key: Any, index: int, decisions: tuple[str, ...], window: int) -> Best:
    """The lower of ``best`` and the new candidate; on equal keys the earlier shape, as when every shape is costed in order."""
    return (key, index, decisions, window) if best is None or (key, index) < best[:2] else best


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

    def __init__(self, *, memory_budget_bytes: int | str | None = None, overhead_bound: float | None = None) -> None:
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
        low, high = min_window_bytes(profile), profile.max_window_bytes
        costs = ShapeCosts(profile, (low, high))
        order = [shape for shape in shape_list(costs.count) if costs.allowed(shape)]
        step_floor = StepFloor(profile)
        fitting = []  # (bound of the key's first entry, index, shape, window: None while to be searched)
        for index, shape in enumerate(order):
            if costs.memory_bytes(shape, high) <= budget:
                fitting.append((round(step_floor.step_s(shape), 9), index, shape, high))
            elif shape[0] and costs.memory_bytes(shape, low) <= budget:  # a window between fits (only O's shrinks)
                fitting.append((round(step_floor.step_s(shape), 9), index, shape, None))
        goal = f"memory_budget_bytes={budget}"
        if not fitting:
            least = self._least_memory(profile, costs, order, low)
            slack = profile.memory_slack_bytes
            measured = (f", {slack / MIB:.1f} MiB of it transient buffers measured while profiling (the process's peak: "
                        "what other threads allocated meanwhile counts too)") if slack else ""
            raise TbaConfigError(
                f"memory_budget={budget_text(budget)} cannot be met: this model needs at least "
                f"{least.predicted_memory_bytes / MIB:.1f} MiB of activations (plan {least.code}{measured}); "
                "raise memory_budget, or lower the batch size or sequence length")
        best: Best | None = None
        for bound, index, shape, window in sorted(fitting, key=lambda fit: fit[:2]):
            if best is not None and bound > best[0][0]:
                break  # Note [The search prunes on lower bounds] in tba/policy/_shape_costs.py
            decisions = decisions_of(shape, costs.count)
            if window is None:
                window = _largest_window(lambda nbytes, s=shape: costs.memory_bytes(s, nbytes), budget, low, high)
            cost = estimate(profile, decisions, window)
            key = (round(cost.step_s, 9), _io_bytes(profile, decisions), cost.memory_bytes, decisions.count(RECOMPUTE))
            best = _better(best, key, index, decisions, window)
        chosen = _plan_of(profile, best[2], best[3], goal)
        caps = forward_write_caps(profile, chosen.decisions, chosen.window_bytes, budget)
        return dataclasses.replace(chosen, write_caps_bytes=caps)

    @staticmethod
    def _least_memory(profile: Profile, costs: ShapeCosts, order: list, window: int) -> Plan:
        """The placement with the least predicted memory at ``window`` (then the fastest, the fewest recomputed, the
        most offloaded, the earliest), marked as not fitting: what a budget that nothing meets is told."""
        memory = [costs.memory_bytes(shape, window) for shape in order]
        least = min(memory)
        best: Best | None = None
        for index, shape in enumerate(order):
            if memory[index] == least:
                decisions = decisions_of(shape, costs.count)
                key = (least, estimate(profile, decisions, window).step_s, decisions.count(RECOMPUTE),
                       -decisions.count(OFFLOAD))
                best = _better(best, key, index, decisions, window)
        return _plan_of(profile, best[2], window, "", fits=False)

    def _smallest_within(self, profile: Profile, bound: float) -> Plan:
        low, high = min_window_bytes(profile), profile.max_window_bytes
        costs = ShapeCosts(profile, (low, high))
        order = [shape for shape in shape_list(costs.count) if costs.allowed(shape)]
        decisions = _Decisions(order, costs.count)
        step_floor = StepFloor(profile)
        floors = [step_floor.step_s(shape) for shape in order]
        fastest: dict[int, float] = {}  # index -> predicted step time at the largest window

        def step_s(index: int) -> float:
            if index not in fastest:
                fastest[index] = estimate(profile, decisions[index], high).step_s
            return fastest[index]

        floor = math.inf  # the fastest placement's time (Note [The search prunes on lower bounds])
        for index in sorted(range(len(order)), key=floors.__getitem__):
            if floors[index] >= floor:
                break
            floor = min(floor, step_s(index))
        limit = (1 + bound) * floor
        within = [index for index in range(len(order)) if floors[index] <= limit + 1e-9]
        least = {index: costs.memory_bytes(order[index], low) for index in within}  # the peak grows with the window
        best: Best | None = None
        for index in sorted(within, key=lambda index: (least[index], index)):
            if best is not None and least[index] > best[0][0]:
                break
            if step_s(index) > limit + 1e-9:
                continue
            window = _smallest_window(lambda nbytes, i=index: estimate(profile, decisions[i], nbytes).step_s,
                                      OFFLOAD in decisions[index], limit, low, high)
            cost = estimate(profile, decisions[index], window)
            key = (cost.memory_bytes, round(cost.step_s, 9), _io_bytes(profile, decisions[index]),
                   decisions[index].count(RECOMPUTE))
            best = _better(best, key, index, decisions[index], window)
        goal = f"overhead_bound={bound:g}"
        if best is not None:
            return _plan_of(profile, best[2], best[3], goal)
        for index in range(len(order)):  # none met it (a step time beyond floats): the fastest, all costed
            key = (round(step_s(index), 9), estimate(profile, decisions[index], high).memory_bytes)
            best = _better(best, key, index, decisions[index], high)
        closest = _plan_of(profile, best[2], high, goal, fits=False)
        logger.warning("tba: no placement is within overhead_bound=%g; using the fastest one", bound)
        return closest


class _Decisions(dict):
    """The decisions of ``order[index]``, made when first asked for (most shapes never are)."""

    def __init__(self, order: list, layer_count: int) -> None:
        super().__init__()
        self.order, self.layer_count = order, layer_count

    def __missing__(self, index: int) -> tuple[str, ...]:
        self[index] = decisions_of(self.order[index], self.layer_count)
        return self[index]


def _largest_window(memory_bytes: Callable[[int], int], budget: int, low: int, high: int) -> int | None:
    """The largest window in ``[low, high]`` (MiB steps below ``high``) whose predicted peak ``memory_bytes(window)``
    fits ``budget``, for a shape with an offloaded layer that fits at ``low``."""
    if memory_bytes(high) <= budget:
        return high
    lo, hi = low // MIB, high // MIB
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if mid * MIB < high and memory_bytes(mid * MIB) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return max(lo * MIB, low)


def _smallest_window(step_s: Callable[[int], float], offloads: bool, limit_s: float, low: int, high: int) -> int:
    """The smallest window (MiB steps) in ``[low, high]`` whose predicted step time ``step_s(window)`` is within
    ``limit_s``."""
    if not offloads or step_s(low) <= limit_s + 1e-9:
        return low if offloads else high
    lo, hi = low // MIB + 1, -(-high // MIB)
    while lo < hi:
        mid = (lo + hi) // 2
        if step_s(min(mid * MIB, high)) <= limit_s + 1e-9:
            hi = mid
        else:
            lo = mid + 1
    return min(lo * MIB, high)


def plan(profile: Profile, *, memory_budget_bytes: int | str | None = None, overhead_bound: float | None = None) -> Plan:
    """The adaptive placement for ``profile`` (pure). See the module docstring for the model.

    Args:
        profile: Measured (:class:`~tba.policy._runner.PolicyRunner` builds one) or synthetic.
        memory_budget_bytes: Fastest placement using at most this many activation bytes (or a size such as "2G").
        overhead_bound: Least-memory placement within ``(1 + overhead_bound)`` x the fastest
            placement's time. Neither: the default goal (module docstring).

    Raises:
        ValueError: both goals, or a negative one.
        TbaConfigError: no placement fits ``memory_budget_bytes``.
    """
    return Adaptive(memory_budget_bytes=memory_budget_bytes, overhead_bound=overhead_bound).plan(profile)
