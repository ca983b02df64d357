"""Applying a placement policy to an offloader, step by step.

A :class:`PolicyRunner` is called by the offloader when it is entered (``enter``) and exited
(``exit``). It never touches the offloader: ``enter`` reads the offloader's counters through one
:class:`StepCounters` snapshot and returns a :class:`StepPlacement` (kept layers, window) that the
offloader applies; ``exit`` is told whether the step failed and how large the largest live
storage is. For ``policy="adaptive"`` the first ``profile_steps`` steps run offload-all while a
:class:`~tba.runtime._timer.LayerTimer` times every layer; at the next ``enter`` (backward of the
last profiled step has run by then) the runner builds a :class:`tba.policy.Profile`:

* ``f_i``, ``b_i``: the minimum over the profiled steps (noise from other work only adds time);
* ``s_i``: the offloader's ``layer_saved_bytes`` growth over the last profiled step; the last
  layer's count includes what runs after it (the head and loss), since tba tags storages with the
  last layer entered;
* ``W``, ``R``: bytes over busy seconds of the offloader's write and read clocks over the profiled
  steps; the largest storage is read from the offloader's live entries at the end of forward.

It then calls :func:`tba.policy.plan`, logs the plan, and from then on applies it every step:
kept layers go into ``Offloader.keep_layers``, recomputed layers are wrapped with non-reentrant
checkpoint (:class:`~tba.runtime._recompute.RecomputeLayers`) from ``enter`` to ``exit`` (checkpoint keeps
the original forward for backward, so the wrapper can go at exit), and the prefetch window becomes
the plan's. Tensors saved inside a recomputed layer never reach tba (checkpoint's own hooks take
them); an ``offloaded_recompute`` layer's inputs, saved by checkpoint, go through tba like any
other tensor, a ``recompute`` layer's stay in memory (Note [Hook nesting of a recomputed layer]).

``offload_activations()`` builds a new one-shot offloader every step, so its runner is shared:
a weak-keyed registry maps the first layer module and the goal to the runner, which holds its
layers only weakly, so the runner lives exactly as long as the model and never touches it.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from collections.abc import Callable
from typing import Any

from torch import nn

from tba.defaults import POLICIES, POLICY_MAX_WINDOW_BYTES, PREFETCH_DEPTH_LAYERS, PROFILE_STEPS
from tba.errors import TbaConfigError, TbaError
from tba.policy import Adaptive, LayerProfile, Placement, Plan, Policy, Profile
from tba.runtime._recompute import RecomputeLayers
from tba.runtime._timer import LayerTimer

logger = logging.getLogger("tba")

_SHARED_RUNNERS: weakref.WeakKeyDictionary[nn.Module, dict[tuple, PolicyRunner]] = weakref.WeakKeyDictionary()


@dataclasses.dataclass(frozen=True)
class StepCounters:
    """What an offloader has counted so far (summed over steps): the runner's only view of it."""

    layer_saved_bytes: dict[int | None, int]
    bytes_written: int
    write_busy_s: float
    bytes_read: int
    read_busy_s: float


@dataclasses.dataclass(frozen=True)
class StepPlacement:
    """What the coming step applies: layers whose tensors stay in memory, and the prefetch window."""

    keep_layers: frozenset[int | None] | None = None
    """None: leave the offloader's ``keep_layers`` as they are (no placement policy)."""
    window_bytes: int | None = None
    """None: leave the window as it is."""


class PolicyRunner:
    """Profiles, plans and applies a placement across the steps of one model.

    Args:
        layers: The offloader's layers.
        policy: ``"offload"``, ``"keep"``, ``"adaptive"``, a :class:`Plan` to pin, or a
            :class:`Policy` to run on the profile.
        memory_budget_bytes / overhead_bound: The adaptive goal (exactly one).
        profile_steps: Steps profiled before planning. Default 2.
        prefetch_depth_layers / prefetch_budget_bytes: The offloader's, for the profile.
    """

    def __init__(self, layers: list[nn.Module], policy: str | Plan | Policy = "offload", *,
                 memory_budget_bytes: int | None = None, overhead_bound: float | None = None,
                 profile_steps: int = PROFILE_STEPS, prefetch_depth_layers: int = PREFETCH_DEPTH_LAYERS,
                 prefetch_budget_bytes: int | None = None) -> None:
        self._prefetch_depth_layers = prefetch_depth_layers
        self._max_window_bytes = max(prefetch_budget_bytes or POLICY_MAX_WINDOW_BYTES, 1)
        self._layer_refs = [weakref.ref(layer) for layer in layers]
        self.policy: Policy | None = None
        self.plan: Plan | None = None
        self.profile: Profile | None = None
        if isinstance(policy, Plan):
            self.plan = policy
        elif isinstance(policy, Policy):
            self.policy = policy
        elif policy == "adaptive":
            try:
                self.policy = Adaptive(memory_budget_bytes=memory_budget_bytes, overhead_bound=overhead_bound)
            except ValueError as err:
                raise TbaConfigError(f"policy='adaptive': {err}") from None
        elif policy not in POLICIES:
            raise TbaConfigError(f"unknown policy {policy!r}; use one of {', '.join(POLICIES)} or a tba.Plan")
        elif memory_budget_bytes is not None or overhead_bound is not None:
            raise TbaConfigError(f"memory_budget_bytes and overhead_bound need policy='adaptive', not {policy!r}")
        self.name = policy if isinstance(policy, str) else type(policy).__name__
        if (self.policy is not None or self.plan is not None) and not layers:
            raise TbaConfigError(f"policy {self.name} needs the model's layers: pass layers=model or a list of blocks")
        if self.plan is not None and len(self.plan.decisions) != len(layers):
            raise TbaConfigError(f"the plan has {len(self.plan.decisions)} layers but the model has {len(layers)}")
        if profile_steps < 1:
            raise TbaConfigError(f"profile_steps must be >= 1, got {profile_steps}")
        self.profile_steps = profile_steps
        self._timer = LayerTimer(layers)
        self._samples: list[dict[str, Any]] = []
        self._pending: dict[str, Any] | None = None
        self._recompute: RecomputeLayers | None = None

    @property
    def layers(self) -> list[nn.Module]:
        """The model's layers; raises once the model was freed."""
        layers = [ref() for ref in self._layer_refs]
        if any(layer is None for layer in layers):
            raise TbaError("the model this policy was planned for no longer exists; build a new Offloader")
        return layers

    @property
    def profiling(self) -> bool:
        return self.policy is not None and self.plan is None

    def enter(self, counters: Callable[[], StepCounters]) -> StepPlacement:
        """The placement of the coming step (called by the offloader as it is entered)."""
        self._collect(counters)
        if self.profiling and len(self._samples) >= self.profile_steps:
            self.profile = self._build_profile()
            self.plan = self.policy.plan(self.profile)
            logger.info("tba: %s", self.plan)
        if self.name == "keep":
            return StepPlacement(frozenset({None, *range(len(self.layers))}))
        if self.plan is not None:
            indices = [i for i, d in enumerate(self.plan.decisions)
                       if d in (Placement.RECOMPUTE, Placement.OFFLOADED_RECOMPUTE)]
            offload = [self.plan.decisions[i] == Placement.OFFLOADED_RECOMPUTE for i in indices]
            self._recompute = RecomputeLayers([self.layers[i] for i in indices], indices, offload) if indices else None
            return StepPlacement(frozenset(self.plan.layers(Placement.KEEP)), self.plan.window_bytes)
        if self.profiling:
            self._timer.reset()
            self._timer.attach()
            self._pending = {"start": counters()}
            return StepPlacement(frozenset())
        return StepPlacement()

    def exit(self, failed: bool, largest_live_storage_bytes: Callable[[], int]) -> None:
        """Undo per-step changes (called by the offloader's exit, after the hooks are removed)."""
        if self._recompute is not None:
            self._recompute.remove()
            self._recompute = None
        if self._pending is not None:
            self._timer.detach()
            if failed:
                self._pending = None
            else:
                self._pending["forward_s"] = list(self._timer.forward_s)
                self._pending["input_bytes"] = list(self._timer.input_bytes)
                self._pending["max_storage"] = largest_live_storage_bytes()

    def _collect(self, counters: Callable[[], StepCounters]) -> None:
        """Finish the pending profiled step: its backward has run by now."""
        pending, self._pending = self._pending, None
        if pending is None or "forward_s" not in pending:
            return
        start, now = pending.pop("start"), counters()
        saved, before = now.layer_saved_bytes, start.layer_saved_bytes
        pending["saved_bytes"] = [saved.get(i, 0) - before.get(i, 0) for i in range(len(self.layers))]
        pending["backward_s"] = self._timer.backward_s()
        pending["written"] = now.bytes_written - start.bytes_written
        pending["write_s"] = now.write_busy_s - start.write_busy_s
        pending["read"] = now.bytes_read - start.bytes_read
        pending["read_s"] = now.read_busy_s - start.read_busy_s
        self._samples.append(pending)

    def _build_profile(self) -> Profile:
        samples = self._samples
        layers = []
        for i in range(len(self.layers)):
            forward = [s["forward_s"][i] for s in samples if s["forward_s"][i] is not None]
            backward = [s["backward_s"][i] for s in samples if s["backward_s"][i] is not None]
            layers.append(LayerProfile(
                forward_s=min(forward, default=0.0),
                saved_bytes=samples[-1]["saved_bytes"][i],
                input_bytes=samples[-1]["input_bytes"][i],
                backward_s=min(backward) if backward else None,
                backward_measured=bool(backward),
            ))
        written, write_s = sum(s["written"] for s in samples), sum(s["write_s"] for s in samples)
        read, read_s = sum(s["read"] for s in samples), sum(s["read_s"] for s in samples)
        return Profile(
            layers=tuple(layers),
            write_bytes_per_s=written / write_s if written and write_s else float("inf"),
            read_bytes_per_s=read / read_s if read and read_s else float("inf"),
            max_storage_bytes=max(s["max_storage"] for s in samples),
            prefetch_depth_layers=self._prefetch_depth_layers,
            max_window_bytes=self._max_window_bytes,
        )


def shared_runner(layers: list[nn.Module], policy: Any, *, shared: bool, **goal: Any) -> PolicyRunner:
    """A runner; with ``shared``, the one for ``layers`` and this goal that successive one-shot offloaders share."""
    if not shared or not layers or not isinstance(policy, str) or policy != "adaptive":
        return PolicyRunner(layers, policy, **goal)
    key = (len(layers), *sorted(goal.items()))
    runners = _SHARED_RUNNERS.setdefault(layers[0], {})
    if key not in runners:
        runners[key] = PolicyRunner(layers, policy, **goal)
    return runners[key]
