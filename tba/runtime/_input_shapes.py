"""Input shapes across the steps of a :class:`~tba.runtime._runner.PolicyRunner`: which one a step
expects, and what a step does when its first layer sees another.

Each input shape (:func:`signature`: the shapes and dtypes the first layer
receives) that recurs has its own profile and plan in the runner; a new one follows the plan of a
larger shape that covers it (Note [A new input shape follows a larger one's plan]). A step is entered
with the plan of the shape expected next; a forward pre-hook on the first layer reads the real one
and, when it differs, switches the rest of the step to that shape's plan, or to offloading everything
(Note [A step whose shape has a plan follows it]).
"""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from torch import nn

from tba import defaults
from tba.policy import RECOMPUTED, LayerProfile, Placement, Plan
from tba.runtime._compiled_call import add_layer_hook
from tba.runtime._input_signature import covers, signature, tensors_in
from tba.runtime._layer_hooks import measuring_hook
from tba.runtime._recompute import RecomputeLayers
from tba.runtime._step_placement import StepPlacement, placement_of
from tba.runtime._wrappable import can_recompute

if TYPE_CHECKING:
    from tba.runtime._profiled_step import ProfiledStep
    from tba.runtime._profiling import Samples


logger = logging.getLogger("tba")

__all__ = ["InputShapes", "covers", "signature", "tensors_in"]

RECURRING_SIGHTINGS = 2
"""Sightings after which an input shape is profiled and planned on its own instead of following a covering plan."""


def _elements(shape: tuple) -> int:
    return sum(math.prod(size) for size, _ in shape)


class InputShapes:
    """Mixin of :class:`~tba.runtime._runner.PolicyRunner`: the shape state and the first layer's hook."""

    layers: list[nn.Module]
    pinned: Plan | None
    _plans: dict[tuple | None, Plan]
    _samples: Samples
    _recompute: RecomputeLayers | None
    _step: ProfiledStep

    def __init__(self) -> None:
        self._shape: tuple | None = None
        """The input shape of the current step: expected at entry, the one seen once the first layer ran."""
        self._seen: tuple | None = None
        """The input shape the last step's first layer saw."""
        self._next_shape: dict[tuple | None, tuple | None] = {}
        """Per input shape, the one the step after it saw last."""
        self._sightings: dict[tuple | None, int] = {}
        """Per input shape, the steps whose first layer saw it; least recently seen first (Note [What is kept
        per input shape is bounded])."""
        self._saved_by_plan: dict[tuple | None, tuple[int, ...]] = {}
        """Per planned input shape, the bytes each layer saved in the profiled step its plan was made from."""
        self._inputs_by_plan: dict[tuple | None, tuple[int, ...]] = {}
        """Per planned input shape, each layer's input bytes in that step."""
        self._step_plan: Plan | None = None
        self._shape_hook: Any = None
        self._reapply: Callable[[StepPlacement], None] | None = None

    def _forget_shapes(self) -> None:
        self._shape = self._seen = None
        self._saved_by_plan.clear()
        self._inputs_by_plan.clear()
        self._next_shape.clear()
        self._sightings.clear()

    def _plan_for(self, shape: tuple | None, *, profiling: bool,
                  wrapped: list[nn.Module]) -> tuple[Plan | None, tuple | None]:
        """The plan a step that sees ``shape`` at its first layer follows, and the shape it was made for: the
        shape's own; else that of the smallest planned shape covering it (that can be followed, ``wrapped``
        being the layers this step has wrapped for recomputation already), unless the step is ``profiling``
        and the shape recurs (it is profiled instead); else None.

        Note: [A new input shape follows a larger one's plan]
        Inputs padded per batch (a collator that pads to the longest sequence of each batch) bring a
        new shape at almost every step. Each shape was profiled and planned on its own, so such a
        shape rarely got its two profiled steps: a 4-layer GPT fed lengths from 64 to 128 at random
        profiled 28 steps before its first plan, offloading everything the whole time, and then
        planned only the one shape that had come twice. Now a step whose shape has no plan of its own
        follows the plan of the smallest planned shape that covers it (:func:`covers`: every dimension
        at least as large): such a step usually saves no more in any layer, and where it does its kept
        layers keep no more than that plan was made for (Note [A covered step keeps no more than the
        plan was made for]), so a memory budget holds for it too. At entry, the shape expected next
        does the same while it is new; once seen :data:`RECURRING_SIGHTINGS` times it recurs, and
        without a plan of its own the step is profiled, so that it gets one. A profiled step that sees
        another shape, with a plan of its own or a covering one while it is new, stops profiling and
        follows it (where the first layer allows: Note [A step whose shape has a plan follows it]). A
        shape that no plan covers is profiled or offloads everything, as before. Entering with the
        covering plan rather than profiling matters when that plan recomputes the first layer: a
        profiled step, its first layer bound to run without recomputation, cannot switch to it (with
        a memory budget on a 4-layer GPT, plan ``RRRK``, most steps were profiled).
        """
        plan = self._plans.get(shape)
        if plan is not None or shape is None or (profiling and self._sightings.get(shape, 0) >= RECURRING_SIGHTINGS):
            return plan, shape
        covering = [(planned, plan) for planned, plan in self._plans.items()
                    if planned is not None and covers(planned, shape) and not self._cannot_follow(plan, wrapped)]
        return min(covering, key=lambda item: _elements(item[0]))[::-1] if covering else (None, None)

    def _keep_caps(self, shape: tuple, planned: tuple | None) -> tuple[int, ...] | None:
        """What each layer may keep in a step of ``shape`` that follows the plan of ``planned``: what ``planned``
        saved per layer when its plan was made (no limit under a pinned plan, made from no profile).

        Note: [A covered step keeps no more than the plan was made for]
        A smaller input saves no more in most models, but not in all: a block that computes dense scores
        for short sequences only (attention implementations that switch on length) saved 44% more in a
        covered step, which kept it all under the covering plan, past what that plan (and a memory budget)
        was made for. Such a step's kept layers keep at most what the covering shape's profiled step
        saved in them; the rest of their tensors are offloaded, which is exact under any plan. A step of the
        plan's own shape too: that shape is read at the first layer only, and a later one's inputs grow
        under it (a decoder's target length under a fixed source length: 16 times what the plan kept).
        It keeps its input's bytes beyond: a layer's input saved by the layer before it (a block ending in
        tanh) counted in that layer's bytes when profiled, but a recomputed layer's saves never reach tba,
        so the kept layer after it saves it first, and it wrote what its plan keeps at every step. A layer
        that did not run in that profiled step (LayerDrop) has no measure, and is not held to one.
        """
        if planned == shape and shape in self._saved_by_plan:
            return tuple(saved + held if saved or held else sys.maxsize
                         for saved, held in zip(self._saved_by_plan[shape], self._inputs_by_plan[shape]))
        if planned == shape:
            return None  # a pinned plan
        return self._saved_by_plan.get(planned, (0,) * len(self.layers))  # unknown: keep nothing

    def _remember_bytes(self, shape: tuple | None, layers: Sequence[LayerProfile]) -> None:
        """What each layer saved, and its input, in the profiled step the plan of ``shape`` is made from."""
        self._saved_by_plan[shape] = tuple(layer.saved_bytes for layer in layers)
        self._inputs_by_plan[shape] = tuple(layer.input_bytes for layer in layers)

    def _note_seen(self, shape: tuple | None) -> None:
        """Count a sighting of ``shape``; forget the least recently seen shapes past :data:`~tba.defaults.INPUT_SHAPES_KEPT`.

        Note: [What is kept per input shape is bounded]
        A runner kept each input shape's profiled samples, plan and successor for good, so inputs with a
        new shape at every step (sequences of any length, not padded to buckets) grew it without bound:
        about 7 KiB per step with 24 layers, objects that every full collection walks. Only the shapes
        seen most recently are kept now; one forgotten and seen again is profiled again, as a new one is,
        and follows a covering plan meanwhile (Note [A new input shape follows a larger one's plan]).
        """
        self._sightings[shape] = self._sightings.pop(shape, 0) + 1
        while len(self._sightings) > max(1, defaults.INPUT_SHAPES_KEPT):
            old = next(iter(self._sightings))
            del self._sightings[old]
            self._plans.pop(old, None)
            self._saved_by_plan.pop(old, None)
            self._inputs_by_plan.pop(old, None)
            self._samples.by_shape.pop(old, None)
            self._next_shape.pop(old, None)

    def _cannot_follow(self, plan: Plan | None, wrapped: list[nn.Module] = ()) -> bool:
        """Whether ``plan`` recomputes a layer that can no longer be wrapped for recomputation (those of
        ``wrapped`` are, by this step already).

        Note: [A plan made before a layer's forward was patched]
        The planner never recomputes a layer whose ``forward`` is set on the instance (``can_recompute``),
        but a loop may set one after the plan was made (a hook library's wrapper, added after warm-up);
        ``RecomputeLayers`` then refuses the layer, and the default would raise at every later step
        for a placement the user never chose. An adaptive runner plans that shape again instead, from
        its profiled samples, with that layer marked as not recomputable. A pinned plan still raises.
        """
        return plan is not None and any(decision in RECOMPUTED and not can_recompute(layer)
                                        for decision, layer in zip(plan.decisions, self.layers)
                                        if not any(layer is done for done in wrapped))

    def _expect_shape(self) -> None:
        """At entry: the step expects the shape that followed the last one seen, the last time it was seen."""
        self._shape = self._next_shape.get(self._seen, self._seen)

    def _wrap_recomputed(self, plan: Plan, start: int = 0, thread: int | None = None) -> RecomputeLayers | None:
        """Wrap the layers ``plan`` recomputes, from layer ``start`` on, for recomputation (the context of
        training thread ``thread``, default the calling one); None when none is."""
        indices = [i for i, decision in enumerate(plan.decisions) if decision in RECOMPUTED and i >= start]
        if not indices:
            return None
        offload = [plan.decisions[i] == Placement.OFFLOADED_RECOMPUTE for i in indices]
        return RecomputeLayers([self.layers[i] for i in indices], indices, offload, thread=thread)

    def _attach_shape_hook(self) -> None:
        # A step that an exception ended before exit (a signal handler's) may have left its hook on;
        # two would remove each other's handle mid-forward and torch would call one without kwargs.
        if self._shape_hook is not None:
            self._shape_hook.remove()
        first = self.layers[0]  # Note [Hooks traced into a whole-model graph do nothing] in tba/runtime/_layer_hooks.py
        hook = measuring_hook(first, self._check_shape)
        self._shape_hook = add_layer_hook(first, hook, pre=True, with_kwargs=True)

    def _check_shape(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        """First layer's forward pre-hook: note the step's input shape; on another one than expected, follow
        its plan (or a covering one), else profile it (a profiled step) or offload the rest of the step."""
        self._shape_hook.remove()
        shape = signature(args, kwargs)
        profiled = self._step.pending is not None
        if shape != self._shape and (profiled or self._step_plan is not None) and self.pinned is None:
            self._follow(shape, module, profiled)
        if self._step.pending is not None:
            self._step.note_shape(shape, module, args, kwargs)
        if self._seen is not None:
            self._next_shape[self._seen] = shape
        self._shape = self._seen = shape
        self._note_seen(shape)

    def _follow(self, shape: tuple, first: nn.Module, profiled: bool) -> None:
        """The step's first layer saw ``shape``, not the one the step was entered with: follow its plan or
        a covering one where the step can; else a ``profiled`` step goes on profiling (now ``shape``) and
        a planned one offloads every layer."""
        running = self._unwrap_all_but(first)
        plan, planned = self._plan_for(shape, profiling=profiled, wrapped=running)
        if plan is not None and self._switch(plan, running, self._keep_caps(shape, planned)):
            if profiled:
                self._step.cancel()
            logger.info("tba: new input shape; this step follows %s from the first layer on",
                        "its plan" if plan is self._plans.get(shape) else "the plan of a larger one")
        elif not profiled:
            logger.info("tba: new input shape; this step offloads every layer, the next one %s",
                        "follows its plan" if plan is not None else "starts profiling it")
            self._step_plan = None
            if self._reapply is not None:
                self._reapply(StepPlacement(frozenset()))

    def _unwrap_all_but(self, first: nn.Module) -> list[nn.Module]:
        """Remove the recompute wrappers of the layers not run yet; the first layer's forward is already
        bound and stays as it is. Returns the layers still wrapped ([first] or [])."""
        if self._recompute is None:
            return []
        running = [layer for layer in self._recompute.layers if layer is first]
        for layer in self._recompute.layers:
            if layer is not first:
                del layer.forward
        self._recompute.layers = running
        return running

    def _switch(self, plan: Plan, running: list[nn.Module], keep_caps: tuple[int, ...] | None = None) -> bool:
        """From the first layer's pre-hook, apply ``plan`` (that of the step's real input shape) to the rest
        of the step; False when it cannot be, and nothing changed.

        Note: [A step whose shape has a plan follows it]
        A step was entered with the plan of the last shape seen, so inputs whose shape alternates (two
        sequence lengths in turn) never ran a plan: every step found a new shape and offloaded
        everything, and one of the shapes was never profiled. Now a step is entered with the plan (or
        the profiling) of the shape that followed the last one the previous time it was seen, which
        is right for shapes in any fixed cycle. When the guess is wrong and the shape seen at the
        first layer has a plan, this step follows that plan from there on: nothing of
        the layers has been saved yet, so their kept set, write caps and window can still change, and
        the recompute wrappers of every layer but the first are installed anew. The first layer's
        forward is bound already, so the switch happens only when both plans treat that layer alike
        (the same placement, or neither recomputes it); otherwise the step offloads every layer.
        """
        first = plan.decisions[0]
        current = self._step_plan.decisions[0] if self._step_plan is not None else Placement.OFFLOAD  # profiled
        if (first in RECOMPUTED or current in RECOMPUTED) and first != current:
            return False
        if self._reapply is None or self._cannot_follow(plan, running):
            return False
        wrapped = self._wrap_recomputed(plan, start=1)
        if wrapped is not None:
            wrapped.layers = running + wrapped.layers
            self._recompute = wrapped
        self._step_plan = plan
        self._reapply(placement_of(plan, keep_caps=keep_caps))
        return True
