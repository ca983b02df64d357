"""Plans and the fixed policies: a per-layer keep / offload / recompute / offloaded-recompute decision
and its window.

A :class:`Plan` records one decision per layer, the prefetch window, the goal and the predicted
step time and memory (from :mod:`tba.policy._model`); it prints as a table and round-trips through
JSON, so it can be inspected and pinned (``Offloader(policy=Plan.load(path))``). The policy
classes share one interface, ``policy.plan(profile) -> Plan``: :class:`KeepAll`,
:class:`OffloadAll`, :class:`RecomputeAll` and :class:`OffloadedRecomputeAll` here,
:class:`~tba.policy._adaptive.Adaptive` (the search) in ``_adaptive.py``. :func:`shapes` lists the
placements the search considers.
"""

from __future__ import annotations

import abc
import dataclasses
import json
import logging
import numbers
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from tba._units import SizeError, parse_size
from tba.defaults import MIB
from tba.errors import TbaConfigError
from tba.policy._model import estimate
from tba.policy._placement import KEEP, OFFLOAD, OFFLOADED_RECOMPUTE, RECOMPUTE, Placement, check_decisions, spilled_bytes
from tba.policy._profile import Profile

logger = logging.getLogger("tba")

SHORT = {KEEP: "K", OFFLOAD: "O", RECOMPUTE: "R", OFFLOADED_RECOMPUTE: "S"}


def _plan_bytes(value: object, name: str = "window_bytes") -> int:
    """A size of a :class:`Plan` (``window_bytes``, an entry of ``write_caps_bytes``) as bytes: a whole number,
    or a size string such as ``"64M"`` (as every other size)."""
    if isinstance(value, str):
        try:
            value = parse_size(value)
        except SizeError as err:
            raise TbaConfigError(f"Plan {name}: {err}") from None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TbaConfigError(f"Plan {name} must be a whole number of bytes or a size such as '64M', "
                             f"got {type(value).__name__} {value!r}")
    if value < 0:
        raise TbaConfigError(f"Plan {name} must be >= 0, got {value}")
    return int(value)


def _sequence(value: object, name: str, what: str, example: str) -> tuple:
    """``value`` (a plan's ``decisions`` or ``write_caps_bytes``) as a tuple, or :class:`TbaConfigError`."""
    # A string would iterate: tuple("keep") is four unknown decisions 'k', 'e', ...
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise TbaConfigError(f"Plan {name} must be a sequence of {what}, one per layer, such as {example}, "
                             f"got {type(value).__name__} {value!r}")
    return tuple(value)


@dataclasses.dataclass(frozen=True)
class Plan:
    """A per-layer placement and what the model predicts for it.

    Attributes:
        decisions: A :class:`Placement` per layer (``"keep"`` / ``"offload"`` / ``"recompute"`` /
            ``"offloaded_recompute"``), in forward order.
        window_bytes: Prefetch window (the offloader's prefetch budget while this plan runs): bytes, or a
            size string such as ``"64M"``.
        goal: What it was planned for, e.g. ``"memory_budget_bytes=104857600"``.
        fits: False when no placement met the goal (this one comes closest).
        predicted_step_s / predicted_keep_step_s / predicted_memory_bytes: the model's numbers.
        write_caps_bytes: Per layer, the most offloaded bytes forward may hold unwritten while it
            runs, bytes or sizes (a memory budget's plans; empty: writes never hold forward back). Note [A budget
            holds back forward's writes] in ``tba/policy/_model.py``.
    """

    decisions: tuple[str, ...]
    window_bytes: int
    goal: str = ""
    fits: bool = True
    predicted_step_s: float = 0.0
    predicted_keep_step_s: float = 0.0
    predicted_memory_bytes: int = 0
    write_caps_bytes: tuple[int, ...] = ()

    if TYPE_CHECKING:  # what the constructor takes, for type checkers (Note [A field that takes more than it holds])
        def __init__(self, decisions: Sequence[str], window_bytes: int | str, goal: str = "", fits: bool = True,
                     predicted_step_s: float = 0.0, predicted_keep_step_s: float = 0.0, predicted_memory_bytes: int = 0,
                     write_caps_bytes: Sequence[int | str] = ()) -> None: ...

    def __post_init__(self) -> None:
        decisions = _sequence(self.decisions, "decisions", "placements", "('keep', 'offload')")
        object.__setattr__(self, "decisions", check_decisions(decisions, len(decisions)))
        caps = _sequence(self.write_caps_bytes, "write_caps_bytes", "sizes", "(67108864, '32M') (or none)")
        object.__setattr__(self, "write_caps_bytes", tuple(_plan_bytes(cap, "write_caps_bytes entry") for cap in caps))
        if self.write_caps_bytes and len(self.write_caps_bytes) != len(decisions):
            raise TbaConfigError(f"write_caps_bytes has {len(self.write_caps_bytes)} entries for {len(decisions)} layers")
        object.__setattr__(self, "window_bytes", _plan_bytes(self.window_bytes))

    def __repr__(self) -> str:
        """Every field, the decisions by name, so that the text builds the same plan: ``Plan(decisions=('keep', ...), ...)``."""
        values = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}
        values["decisions"] = tuple(Placement(d).value for d in self.decisions)
        return f"Plan({', '.join(f'{name}={value!r}' for name, value in values.items())})"

    def layers(self, decision: str) -> list[int]:
        """Indices of the layers with ``decision``."""
        return [i for i, d in enumerate(self.decisions) if d == decision]

    @property
    def code(self) -> str:
        """One letter per layer: ``OOSRKK`` (``S``: offloaded recompute)."""
        return "".join(SHORT[d] for d in self.decisions)

    def to_json(self) -> str:
        """This plan as JSON, which :meth:`from_json` reads back."""
        return json.dumps(dataclasses.asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """The plan that :meth:`to_json` wrote."""
        return cls(**json.loads(text))

    def save(self, path: str) -> None:
        """Write this plan to ``path`` as JSON, for :meth:`load` (``policy=tba.Plan.load(path)`` pins it).

        Raises:
            TbaConfigError: the file cannot be written.
        """
        try:
            with open(path, "w") as f:
                f.write(self.to_json() + "\n")
        except OSError as err:
            raise TbaConfigError(f"cannot save the plan to {path!s}: {type(err).__name__}: {err}; pass a path in an "
                                 "existing, writable directory") from None

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
        for decision in Placement:
            indices = self.layers(decision)
            if indices:
                lines.append(f"  {decision:<9} layers {_ranges(indices)}")
        if self.write_caps_bytes:
            caps = ", ".join(f"{cap / MIB:.1f}" for cap in self.write_caps_bytes)
            lines.append(f"  forward waits while more than this many MiB are being written, per layer: {caps}")
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
    return sum(spilled_bytes(layer, d) for layer, d in zip(profile.layers, decisions))


def min_window_bytes(profile: Profile) -> int:
    """The smallest window a plan uses: two of the largest storage, rounded up to MiB."""
    return min(-(-2 * profile.max_storage_bytes // MIB) * MIB, profile.max_window_bytes)


def shapes(layer_count: int) -> list[tuple[str, ...]]:
    """Every placement ``O^a R^r K^k`` and ``O^a S^s K^k`` (``a + r + k = layer_count``), keep-all first.

    Offloaded recompute (``S``) goes where recompute would: it holds less (its input is written
    too) for a little more I/O, so it is worth it where a budget is below what ``R`` can reach.
    Mixing ``R`` and ``S`` is left out, which keeps the count quadratic in the layers.
    """
    out = []
    for offload in range(layer_count + 1):
        for recompute in range(layer_count - offload + 1):
            keep = layer_count - offload - recompute
            out.append((OFFLOAD,) * offload + (RECOMPUTE,) * recompute + (KEEP,) * keep)
            if recompute:
                out.append((OFFLOAD,) * offload + (OFFLOADED_RECOMPUTE,) * recompute + (KEEP,) * keep)
    return sorted(out, key=lambda d: (len(d) - d.count(KEEP), d.count(OFFLOADED_RECOMPUTE), -d.count(OFFLOAD)))


class Policy(abc.ABC):
    """Turns a profile into a :class:`Plan`."""

    name = "policy"

    @abc.abstractmethod
    def plan(self, profile: Profile) -> Plan:
        """The placement for ``profile``."""

    def __repr__(self) -> str:
        """The class and its public attributes (a goal), which also decide whether one-shot contexts share it."""
        public = {name: value for name, value in getattr(self, "__dict__", {}).items() if not name.startswith("_")}
        return f"{type(self).__name__}({', '.join(f'{name}={value!r}' for name, value in public.items())})"


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


class OffloadedRecomputeAll(Policy):
    """Every layer is recomputed in backward and its input written to the spill file."""

    name = "offloaded_recompute"

    def plan(self, profile: Profile) -> Plan:
        return _plan_of(profile, (OFFLOADED_RECOMPUTE,) * len(profile.layers), profile.max_window_bytes,
                        "offloaded recompute all")
