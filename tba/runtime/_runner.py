"""Applying a placement policy to an offloader, step by step.

A :class:`PolicyRunner` is called by the offloader when it is entered (``enter``) and exited
(``exit``). It never touches the offloader: ``enter`` reads the offloader's counters through one
:class:`~tba.runtime._profiling.StepCounters` snapshot and returns a :class:`StepPlacement` (the
layers to tag, kept layers, window) that the offloader applies; ``exit`` is told whether the step
failed, how large the largest live storage is and, while the runner has no layers yet, which
layers the offloader found during that forward (``tba/runtime/_discover.py``).

For ``policy="adaptive"`` (the default):

1. Without ``layers=``, the first step offloads everything while the offloader finds the layers;
   the runner keeps them (weakly) and hands them back at every entry, so from then on storages are
   tagged by a :class:`~tba.runtime._layers.LayerTracker`, which is what a plan needs.
2. The next ``profile_steps`` steps offload everything (the placement with the least memory, so
   no early step peaks above a later one) and are profiled: ``tba/runtime/_profiled_step.py``
   measures each, ``tba/runtime/_profiling.py`` builds the profile from them.
3. At the next entry the runner plans (:func:`tba.policy.plan`) and from then on applies the plan:
   kept layers go into ``Offloader.keep_layers``, recomputed layers are wrapped with non-reentrant
   checkpoint (:class:`~tba.runtime._recompute.RecomputeLayers`) from ``enter`` to ``exit``
   (checkpoint keeps the original forward for backward, so the wrapper can go at exit), and the
   prefetch window becomes the plan's. Tensors saved inside a recomputed layer never reach tba
   (checkpoint's own hooks take them); an ``offloaded_recompute`` layer's inputs, saved by
   checkpoint, go through tba like any other tensor, a ``recompute`` layer's stay in memory (Note
   [Hook nesting of a recomputed layer]). A memory budget the model cannot meet raises
   :class:`~tba.errors.TbaConfigError` at that entry, naming the least the model needs.

Each input shape (see :func:`~tba.runtime._input_shapes.signature`) has its own profile and plan. A
step is entered with the shape expected next; a forward pre-hook on the first layer reads the real
one. When that differs, the step follows the real shape's plan, or that of a larger shape covering
it, from that layer on where it can (Notes [A step whose shape has a plan follows it] and [A new
input shape follows a larger one's plan] in ``tba/runtime/_input_shapes.py``), else falls
back to offloading everything (no layer kept, the recompute wrappers of the layers not yet run
removed), which is exact under any plan and uses the least memory. A forward that runs none of the
runner's layers (another model in the same context) makes the runner forget them and find them
again.

One-shot contexts share runners: ``tba/runtime/_shared_runners.py``. Which policy a runner plans with,
and how it holds it: ``tba/runtime/_runner_policy.py``.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable

import torch
from torch import nn

from tba.defaults import POLICY_MAX_WINDOW_BYTES, PREFETCH_DEPTH_LAYERS, PROFILE_STEPS
from tba.errors import TbaConfigError, TbaError
from tba.policy import Plan, Policy, Profile
from tba.runtime._input_shapes import InputShapes
from tba.runtime._layer_notices import forget_layers, say_layers_not_run, say_no_repeated_blocks
from tba.runtime._one_step import OneStepAtATime
from tba.runtime._profiled_step import ProfiledStep, stream_sync
from tba.runtime._profiling import Samples, StepCounters
from tba.runtime._recompute import RecomputeLayers
from tba.runtime._runner_policy import RunnerPolicy
from tba.runtime._step_placement import StepPlacement, placement_of
from tba.runtime._wrappable import plannable_for_recomputation

logger = logging.getLogger("tba")


__all__ = ["PolicyRunner", "StepCounters", "StepPlacement"]


class PolicyRunner(InputShapes, RunnerPolicy, OneStepAtATime):
    """Profiles, plans and applies a placement across the steps of one model.

    Args:
        layers: The offloader's layers; empty: learned from the offloader's discovery (adaptive only).
        policy: ``"adaptive"``, ``"offload"``, ``"keep"``, a :class:`Plan` to pin, or a
            :class:`Policy` to run on the profile.
        memory_budget_bytes / overhead_bound: The adaptive goal (at most one; none: the default goal).
        profile_steps: Steps profiled before planning. Default 2.
        prefetch_depth_layers / prefetch_budget_bytes: The offloader's, for the profile.
    """

    def __init__(self, layers: list[nn.Module], policy: str | Plan | Policy = "adaptive", *,
                 memory_budget_bytes: int | None = None, overhead_bound: float | None = None,
                 profile_steps: int = PROFILE_STEPS, prefetch_depth_layers: int = PREFETCH_DEPTH_LAYERS,
                 prefetch_budget_bytes: int | None = None) -> None:
        self._prefetch_depth_layers = prefetch_depth_layers
        self._max_window_bytes = max(prefetch_budget_bytes or POLICY_MAX_WINDOW_BYTES, 1)
        RunnerPolicy.__init__(self, policy, memory_budget_bytes, overhead_bound)
        if (self.name == "keep" or self.pinned is not None) and not layers:
            raise TbaConfigError(f"policy {self.name} needs the model's layers: pass layers=model or a list of blocks")
        if self.pinned is not None and len(self.pinned.decisions) != len(layers):
            raise TbaConfigError(f"the plan has {len(self.pinned.decisions)} decisions but layers= has {len(layers)} layers; "
                                 f"give the plan one decision per layer ({len(layers)}), or pass the layers it was made for")
        if profile_steps < 1:
            raise TbaConfigError(f"profile_steps must be >= 1, got {profile_steps}")
        self.profile_steps = profile_steps
        self.learns = self.policy is not None and not layers
        """Whether the layers come from the offloader's discovery (adaptive without ``layers=``)."""
        self._said_none_found, self._forgotten = False, 0
        self.profile: Profile | None = None
        """The profile of the last plan made."""
        self._plans: dict[tuple | None, Plan] = {}
        self._samples = Samples()
        self._step = ProfiledStep()
        """The profiled step being measured, if any."""
        self._entries = 0
        """Steps entered so far; the first one's period holds one-off costs (Note [The rest of the step])."""
        self._recompute: RecomputeLayers | None = None
        OneStepAtATime.__init__(self)
        InputShapes.__init__(self)
        self._layer_refs: list[weakref.ref] = []
        self._set_layers(layers)

    def _set_layers(self, layers: list[nn.Module]) -> None:
        self._layer_refs = [weakref.ref(layer) for layer in layers]
        self._learner = None
        self._step.set_layers(layers)
        self._plans.clear()
        self._samples.clear()
        self._forget_shapes()

    @property
    def layers(self) -> list[nn.Module]:
        """The model's layers; raises once the model was freed."""
        layers = [ref() for ref in self._layer_refs]
        if any(layer is None for layer in layers):
            raise TbaError("the model this policy was planned for no longer exists; build a new Offloader")
        return layers

    @property
    def model_freed(self) -> bool:
        """Whether the model whose layers this runner learned was freed: its next entry finds layers again,
        as a new runner would (what it had planned went with them)."""
        return self.learns and any(ref() is None for ref in self._layer_refs)

    @property
    def plan(self) -> Plan | None:
        """The plan in force: that of the current (or last) step, its input shape's own or a larger shape's
        (Note [A new input shape follows a larger one's plan]); None while finding layers or profiling."""
        return self.pinned if self.pinned is not None else self._step_plan

    @property
    def profiling(self) -> bool:
        """Whether the input shape expected next has no plan of its own yet (its steps are profiled)."""
        return self.policy is not None and self.pinned is None and self._plans.get(self._shape) is None

    def enter(self, counters: Callable[[], StepCounters],
              reapply: Callable[[StepPlacement], None] | None = None, thread: int | None = None,
              owner: object | None = None) -> StepPlacement:
        """The placement of the coming step (called by the offloader as it is entered).

        ``reapply(placement)`` changes the step's placement during the step (a new input shape; its
        ``layers`` is None);
        ``thread``: the identity of the training thread that enters (its CPU clock times the rest of
        a profiled step, Note [The rest of the step] in ``tba/runtime/_profiling.py``);
        ``owner``: what identifies this entry to :meth:`exit`.
        """
        if not self._claim_step(owner, thread, busy=self._recompute is not None):
            return StepPlacement(frozenset(), layers=[] if self.learns else None)  # Note [A runner shared by contexts at once]
        try:
            return self._enter(counters, reapply, thread)
        except BaseException:
            # Undone as a failed step: a profiled step's timer left on held a global module pre-hook
            # (tba/runtime/_outside.py), run at every module call of the program, until another step ended.
            self.exit(True, lambda: 0)
            raise

    def _enter(self, counters: Callable[[], StepCounters], reapply: Callable[[StepPlacement], None] | None,
               thread: int | None) -> StepPlacement:
        self._collect(thread)
        self._entries += 1
        self._step_plan = None
        if self.model_freed:
            self._set_layers([])  # the model was freed: find the next one's layers
        if self.learns and not self._layer_refs:
            return StepPlacement(frozenset(), layers=[])
        learned = self.layers if self.learns else None
        self._expect_shape()
        if self.policy is not None and self._cannot_follow(self._plans.get(self._shape)):
            del self._plans[self._shape]  # Note [A plan made before a layer's forward was patched]
        if self.policy is not None and self.pinned is None:
            self._plan_ready_shapes()
        self._reapply = reapply
        placement = self._placement(counters, thread, learned)
        if self.policy is not None:
            # After the profiled step's timer: its first layer's hooks have run when this one stops them.
            self._attach_shape_hook()
        return placement

    def _plan_ready_shapes(self) -> None:
        """Plan each input shape whose samples now suffice (Note [A warm step is enough for a new shape]);
        the expected one last, so that :attr:`profile` is its."""
        ready = [shape for shape in self._samples.by_shape
                 if shape not in self._plans and self._samples.plannable(shape, self.profile_steps)]
        wrappable = plannable_for_recomputation(self.layers) if ready else []
        for shape in sorted(ready, key=lambda shape: shape == self._shape):
            self.profile = self._samples.profile(shape, len(self._layer_refs), self._prefetch_depth_layers,
                                                 self._max_window_bytes, wrappable)
            try:
                self._plans[shape] = self._checked(self.policy.plan(self.profile))
            except TbaConfigError:
                # Refused (a budget it cannot meet): forget its samples, or every later entry is refused, whatever its shape.
                del self._samples.by_shape[shape]
                raise
            self._remember_bytes(shape, self.profile.layers)
            logger.info("tba: %s", self._plans[shape])

    def _placement(self, counters: Callable[[], StepCounters], thread: int | None,
                   learned: list[nn.Module] | None) -> StepPlacement:
        """The entered step's placement: kept, planned (its expected shape's own plan, or a covering one while
        that shape is new), profiled or as configured."""
        if self.name == "keep":
            return StepPlacement(frozenset({None, *range(len(self.layers))}))
        plan, planned = ((self.pinned, self._shape) if self.pinned is not None  # a pinned plan is every shape's own
                         else self._plan_for(self._shape, profiling=True, wrapped=[]))
        self._step_plan = plan
        if plan is not None:
            self._recompute = self._wrap_recomputed(plan, thread=thread)
            return placement_of(plan, learned, self._keep_caps(self._shape, planned))
        if self.profiling:
            self._step.start(counters, self._shape, thread, first=self._entries == 1, synchronize=self._stream_sync(),
                             cuda=self._on_cuda(), release=self._samples.collected >= self.profile_steps - 1)
            return StepPlacement(frozenset(), layers=learned)
        return StepPlacement()


    def _checked(self, plan: Plan) -> Plan:
        """``plan`` as the policy returned it, when it is a plan for these layers."""
        if not isinstance(plan, Plan) or len(plan.decisions) != len(self._layer_refs):
            got = f"a plan of {len(plan.decisions)} layers" if isinstance(plan, Plan) else repr(plan)
            raise TbaConfigError(f"policy {self.name}.plan(profile) returned {got} for a profile of "
                                 f"{len(self._layer_refs)} layers; return a tba.Plan with one decision per "
                                 "profile.layers entry")
        return plan

    def _cuda_device(self) -> torch.device | None:
        """The CUDA device of the model's first parameter, or None (a CPU model, or no parameter)."""
        first = next(self.layers[0].parameters(), None)
        return first.device if first is not None and first.is_cuda else None

    def _on_cuda(self) -> bool:
        return self._cuda_device() is not None

    def _stream_sync(self) -> Callable[[], None] | None:
        """What the timer calls before each stamp (:func:`~tba.runtime._profiled_step.stream_sync`)."""
        return stream_sync(self._cuda_device())

    def exit(self, failed: bool, largest_live_storage_bytes: Callable[[], int],
             found_layers: list[nn.Module] | None = None, ran_a_layer: bool = True,
             window_bytes: int = 0, backlog_bytes: Callable[[], int] | None = None, owner: object | None = None) -> None:
        """Undo per-step changes (called by the offloader's exit, after the hooks are removed).

        ``found_layers``: what discovery found in this step (a learning runner takes them);
        ``ran_a_layer``: whether the forward ran one of the layers handed out at entry;
        ``backlog_bytes()``: bytes saved in the layers whose write has not finished yet (asked in
        profiled steps only); ``owner``: the entry's, as given to :meth:`enter` (None: the step that holds the runner).
        """
        if not self._release_step(owner):
            return  # a bypassed entry: the runner's per-step state is another step's (Note [A runner shared by contexts at once])
        if self._shape_hook is not None:
            self._shape_hook.remove()
            self._shape_hook = None
        self._reapply = None
        if self._recompute is not None:
            self._recompute.remove()
            self._recompute = None
        self._step.end_forward(failed, self._on_cuda, largest_live_storage_bytes, window_bytes, backlog_bytes)
        if not self.learns and not failed and not ran_a_layer and self._layer_refs:
            say_layers_not_run(self._layer_refs[0](), len(self._layer_refs), self._effect_of_no_layer(),
                               largest_live_storage_bytes)
        if not self.learns or failed:
            return
        if not self._layer_refs and found_layers:
            self._set_layers(found_layers)
            self._learned_in_this_step()
            logger.debug("tba: the adaptive policy plans for the %d layers found", len(found_layers))
        elif (not self._layer_refs and found_layers is not None and not self._said_none_found
              and largest_live_storage_bytes() > 0):
            # A forward that saved tensors, in a model without repeated blocks or whose blocks are each
            # compiled (their saves carry no module stack, tba/runtime/_discover.py): nothing to plan
            # for, so every step offloads all.
            self._said_none_found = True
            say_no_repeated_blocks(self.policy)  # Note [A budget no plan is made for is said to be unchecked]
        elif self._layer_refs and not ran_a_layer:
            self._forgotten = forget_layers(self._forgotten, self.policy)
            self._step.pending = None
            self._set_layers([])

    def _effect_of_no_layer(self) -> str:
        if self.pinned is not None:
            return "the pinned plan was not followed and every saved tensor was offloaded"
        if self.policy is not None:
            return f"the {self.name} policy can neither profile nor plan, and every saved tensor was offloaded"
        return "every saved tensor was offloaded without a layer to prefetch it by"

    def note_unpack(self, packed: object, layer: int | None) -> None:
        """An unpack in backward (Note [A saved tensor unpacked twice in one backward] in ``tba/runtime/_profiled_step.py``)."""
        self._step.note_unpack(packed, layer)

    def _collect(self, thread: int | None = None) -> None:
        """Finish the pending profiled step from its offloader's counters: its backward has run by now.

        ``thread``: the training thread entering the next step."""
        sample = self._step.finish(thread)
        if sample is not None:
            self._samples.collect(sample, sample.pop("counters")(), len(self._layer_refs))
