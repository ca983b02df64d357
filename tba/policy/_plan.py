"""Planner: from a profile and a goal to a per-layer keep / offload / recompute decision.

:func:`plan` is a pure function of a :class:`~tba.policy._profile.Profile`; costs come from the
model in :mod:`tba.policy._model`. Two goals:

* ``memory_budget_bytes=N``: the fastest placement whose predicted activation peak is at most
  ``N`` bytes;
* ``overhead_bound=x``: the placement with the least predicted activation peak whose predicted
  step time is at most ``(1 + x)`` times keep-all's.

The search space is every placement of the shape ``O^a R^r K^k`` (``a + r + k = L``): offload
the first ``a`` layers (they have the most forward time ahead to hide their writes), recompute the
next ``r`` (their I/O could not hide and their memory is still over budget), keep the last ``k``
(backward needs them first, so keeping them costs no I/O). ``k = L - a, r = 0`` with the largest
``a`` whose writes are hidden is the TBA paper's placement. For every shape the prefetch window
``P`` is chosen too: with a memory budget, the largest window (at most the offloader's prefetch
budget, at least two of the largest storage) that fits; with an overhead bound, the smallest window
that meets the bound (binary search on MiB; predicted time never grows with ``P``), ties going to
the faster placement, then the one moving fewer bytes. When no placement reaches
the goal, the plan with the least memory (memory goal) or the least time (overhead goal) is
returned with ``fits=False``, and a warning is logged. Among equally fast placements within a
memory budget the one moving the fewest bytes wins (I/O competes for memory bandwidth and CPU,
which the model leaves out), then the one with less memory.

The policy classes (:class:`KeepAll`, :class:`OffloadAll`, :class:`RecomputeAll`,
:class:`Adaptive`) share one interface, ``policy.plan(profile) -> Plan``. A :class:`Plan` prints as
a table and round-trips through JSON, so it can be inspected and pinned
(``Offloader(policy=Plan.load(path))``).
"""

from __future__ import annotations

import abc
import dataclasses
import json
import logging
from collections.abc import Sequence
from typing import Any

from tba.defaults import MIB
from tba.errors import TbaConfigError
from tba.policy._model import KEEP, OFFLOAD, RECOMPUTE, check_decisions, estimate
from tba.policy._profile import Profile

logger = logging.getLogger("tba")

SHORT = {KEEP: "K", OFFLOAD: "O", RECOMPUTE: "R"}


@dataclasses.dataclass(frozen=True)
class Plan:
    """A per-layer placement and what the model predicts for it.

    Attributes:
        decisions: A :class:`Placement` per layer (``"keep"`` / ``"offload"`` / ``"recompute"``), in
            forward order.
        window_bytes: Prefetch window (the offloader's prefetch budget while this plan runs).
        goal: What it was planned for, e.g. ``"memory_budget_bytes=104857600"``.
        fits: False when no placement met the goal (this one comes closest).
        predicted_step_s / predicted_keep_step_s / predicted_memory_bytes: the model's numbers.
    """

    decisions: tuple[str, ...]
    window_bytes: int
    goal: str = ""
    fits: bool = True
    predicted_step_s: float = 0.0
    predicted_keep_step_s: float = 0.0
    predicted_memory_bytes: int = 0

    def __post_init__(self) -> None:
        decisions = tuple(self.decisions)
        object.__setattr__(self, "decisions", check_decisions(decisions, len(decisions)))
        if self.window_bytes < 0:
            raise ValueError(f"window_bytes must be >= 0, got {self.window_bytes}")

    def layers(self, decision: str) -> list[int]:
        """Indices of the layers with ``decision``."""
        return [i for i, d in enumerate(self.decisions) if d == decision]

    @property
    def code(self) -> str:
        """One letter per layer: ``OOORKK``."""
        return "".join(SHORT[d] for d in self.decisions)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        return cls(**json.loads(text))

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            f.write(self.to_json() + "\n")

    @classmethod
    def load(cls, path: str) -> Plan:
        """The plan saved at ``path`` by :meth:`save`.

        Raises:
            TbaConfigError: the file cannot be read or is not a saved plan.
        """
        try:
            with open(path) as f:
                return cls.from_json(f.read())
        except (OSError, UnicodeDecodeError, ValueError, TypeError, AttributeError) as err:
            raise TbaConfigError(f"cannot load a plan from {path!s}: {type(err).__name__}: {err}; pass a file "
                                 "written by Plan.save (a JSON object with decisions and window_bytes)") from None

    def __str__(self) -> str:
        overhead = self.predicted_step_s / self.predicted_keep_step_s - 1 if self.predicted_keep_step_s else 0.0
        overhead = 0.0 if abs(overhead) < 5e-4 else overhead
        lines = [
            f"plan {self.code} ({self.goal or 'pinned'}{'' if self.fits else ', goal NOT met'})",
            f"  predicted: step {self.predicted_step_s:.3f} s ({overhead:+.0%} vs keep-all), activation peak "
            f"{self.predicted_memory_bytes / MIB:.1f} MiB, prefetch window {self.window_bytes / MIB:.1f} MiB",
        ]
        for decision in (KEEP, OFFLOAD, RECOMPUTE):
            indices = self.layers(decision)
            if indices:
                lines.append(f"  {decision:<9} layers {_ranges(indices)}")
        return "\n".join(lines)


def _ranges(indices: Sequence[int]) -> str:
    parts, start = [], indices[0]
    for prev, cur in zip(indices, [*indices[1:], None]):
        if cur != prev + 1:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
            start = cur
    return ", ".join(parts)


def _plan_of(profile: Profile, decisions: Sequence[str], window: int, goal: str, fits: bool = True) -> Plan:
    cost = estimate(profile, decisions, window)
    return Plan(tuple(decisions), window, goal, fits, cost.step_s, cost.keep_step_s, cost.memory_bytes)


def _io_bytes(profile: Profile, decisions: Sequence[str]) -> int:
    return sum(layer.saved_bytes for layer, d in zip(profile.layers, decisions) if d == OFFLOAD)


def min_window_bytes(profile: Profile) -> int:
    """The smallest window a plan uses: two of the largest storage, rounded up to MiB."""
    return min(-(-2 * profile.max_storage_bytes // MIB) * MIB, profile.max_window_bytes)


def shapes(layer_count: int) -> list[tuple[str, ...]]:
    """Every placement ``O^a R^r K^k`` with ``a + r + k = layer_count``, keep-all first."""
    out = []
    for offload in range(layer_count + 1):
        for recompute in range(layer_count - offload + 1):
            keep = layer_count - offload - recompute
            out.append((OFFLOAD,) * offload + (RECOMPUTE,) * recompute + (KEEP,) * keep)
    return sorted(out, key=lambda d: (d.count(OFFLOAD) + d.count(RECOMPUTE), -d.count(OFFLOAD)))


class Policy(abc.ABC):
    """Turns a profile into a :class:`Plan`."""

    name = "policy"

    @abc.abstractmethod
    def plan(self, profile: Profile) -> Plan:
        """The placement for ``profile``."""


class KeepAll(Policy):
    """Every layer's activations stay in memory."""

    name = "keep"

    def plan(self, profile: Profile) -> Plan:
        return _plan_of(profile, (KEEP,) * len(profile.layers), profile.max_window_bytes, "keep all")


class OffloadAll(Policy):
    """Every layer is offloaded, with the offloader's full prefetch budget."""

    name = "offload"

    def plan(self, profile: Profile) -> Plan:
        return _plan_of(profile, (OFFLOAD,) * len(profile.layers), profile.max_window_bytes, "offload all")


class RecomputeAll(Policy):
    """Every layer is recomputed in backward (full activation checkpointing)."""

    name = "recompute"

    def plan(self, profile: Profile) -> Plan:
        return _plan_of(profile, (RECOMPUTE,) * len(profile.layers), profile.max_window_bytes, "recompute all")


class Adaptive(Policy):
    """Keep, offload or recompute per layer to meet one goal; see the module docstring.

    Args:
        memory_budget_bytes: Use at most this many activation bytes, as fast as possible.
        overhead_bound: Least memory with step time within ``(1 + overhead_bound)`` of keep-all.
            Exactly one of the two must be given.
    """

    name = "adaptive"

    def __init__(self, *, memory_budget_bytes: int | None = None, overhead_bound: float | None = None) -> None:
        if (memory_budget_bytes is None) == (overhead_bound is None):
            raise ValueError("give exactly one goal: memory_budget_bytes=N or overhead_bound=x")
        if memory_budget_bytes is not None and memory_budget_bytes < 0:
            raise ValueError(f"memory_budget_bytes must be >= 0, got {memory_budget_bytes}")
        if overhead_bound is not None and overhead_bound < 0:
            raise ValueError(f"overhead_bound must be >= 0, got {overhead_bound}")
        self.memory_budget_bytes = memory_budget_bytes
        self.overhead_bound = overhead_bound

    def plan(self, profile: Profile) -> Plan:
        if self.memory_budget_bytes is not None:
            return self._fastest_within(profile, self.memory_budget_bytes)
        return self._smallest_within(profile, self.overhead_bound)

    def _fastest_within(self, profile: Profile, budget: int) -> Plan:
        goal = f"memory_budget_bytes={budget}"
        low, high = min_window_bytes(profile), profile.max_window_bytes
        best: tuple[Any, ...] | None = None
        smallest: tuple[Any, ...] | None = None
        for decisions in shapes(len(profile.layers)):
            window = self._largest_window(profile, decisions, budget, low, high)
            cost = estimate(profile, decisions, window if window is not None else low)
            key = (cost.memory_bytes, cost.step_s, decisions.count(RECOMPUTE), -decisions.count(OFFLOAD))
            if smallest is None or key < smallest[0]:
                smallest = (key, decisions, window if window is not None else low)
            if window is None:
                continue
            key = (round(cost.step_s, 9), _io_bytes(profile, decisions), cost.memory_bytes, decisions.count(RECOMPUTE))
            if best is None or key < best[0]:
                best = (key, decisions, window)
        if best is not None:
            return _plan_of(profile, best[1], best[2], goal)
        logger.warning("tba: no placement fits memory_budget_bytes=%d; using the one with the least memory", budget)
        return _plan_of(profile, smallest[1], smallest[2], goal, fits=False)

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
        goal = f"overhead_bound={bound:g}"
        low, high = min_window_bytes(profile), profile.max_window_bytes
        best: tuple[Any, ...] | None = None
        fastest: tuple[Any, ...] | None = None
        for decisions in shapes(len(profile.layers)):
            cost = estimate(profile, decisions, high)
            key = (round(cost.step_s, 9), cost.memory_bytes)
            if fastest is None or key < fastest[0]:
                fastest = (key, decisions, high)
            if cost.overhead > bound + 1e-9:
                continue
            window = self._smallest_window(profile, decisions, bound, low, high)
            cost = estimate(profile, decisions, window)
            key = (cost.memory_bytes, round(cost.step_s, 9), _io_bytes(profile, decisions), decisions.count(RECOMPUTE))
            if best is None or key < best[0]:
                best = (key, decisions, window)
        if best is not None:
            return _plan_of(profile, best[1], best[2], goal)
        logger.warning("tba: no placement is within overhead_bound=%g; using the fastest one", bound)
        return _plan_of(profile, fastest[1], fastest[2], goal, fits=False)

    @staticmethod
    def _smallest_window(profile: Profile, decisions: tuple[str, ...], bound: float, low: int, high: int) -> int:
        """The smallest window (MiB steps) in ``[low, high]`` whose predicted overhead is within ``bound``."""
        if OFFLOAD not in decisions or estimate(profile, decisions, low).overhead <= bound + 1e-9:
            return low if OFFLOAD in decisions else high
        lo, hi = low // MIB + 1, -(-high // MIB)
        while lo < hi:
            mid = (lo + hi) // 2
            if estimate(profile, decisions, min(mid * MIB, high)).overhead <= bound + 1e-9:
                hi = mid
            else:
                lo = mid + 1
        return min(lo * MIB, high)


def plan(profile: Profile, *, memory_budget_bytes: int | None = None, overhead_bound: float | None = None) -> Plan:
    """The adaptive placement for ``profile`` (pure). See the module docstring for the model.

    Args:
        profile: Measured (:class:`~tba.policy._runner.PolicyRunner` builds one) or synthetic.
        memory_budget_bytes: Fastest placement using at most this many activation bytes.
        overhead_bound: Least-memory placement within ``(1 + overhead_bound)`` x keep-all time.

    Raises:
        ValueError: neither or both goals, or a negative one.
    """
    return Adaptive(memory_budget_bytes=memory_budget_bytes, overhead_bound=overhead_bound).plan(profile)
