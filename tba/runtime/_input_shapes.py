"""Input shapes across the steps of a :class:`~tba.runtime._runner.PolicyRunner`: which one a step
expects, and what a step does when its first layer sees another.

Each input shape (:func:`~tba.runtime._profiling.signature`: the shapes and dtypes the first layer
receives) has its own profile and plan in the runner. A step is entered with the plan of the shape
expected next; a forward pre-hook on the first layer reads the real one and, when it differs,
switches the rest of the step to that shape's plan, or to offloading everything (Note [A step whose
shape has a plan follows it]).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch import nn

from tba.policy import RECOMPUTED, Placement, Plan
from tba.runtime._profiling import signature
from tba.runtime._recompute import RecomputeLayers
from tba.runtime._step_placement import StepPlacement, placement_of

if TYPE_CHECKING:
    from tba.runtime._profiled_step import ProfiledStep

logger = logging.getLogger("tba")

__all__ = ["InputShapes"]


class InputShapes:
    """Mixin of :class:`~tba.runtime._runner.PolicyRunner`: the shape state and the first layer's hook."""

    layers: list[nn.Module]
    pinned: Plan | None
    _plans: dict[tuple | None, Plan]
    _recompute: RecomputeLayers | None
    _step: ProfiledStep
    _cannot_follow: Callable[..., bool]
    """The runner's check that a plan's recomputed layers can still be wrapped (``wrapped``: those already are)."""

    def __init__(self) -> None:
        self._shape: tuple | None = None
        """The input shape of the current step: expected at entry, the one seen once the first layer ran."""
        self._seen: tuple | None = None
        """The input shape the last step's first layer saw."""
        self._next_shape: dict[tuple | None, tuple | None] = {}
        """Per input shape, the one the step after it saw last."""
        self._step_plan: Plan | None = None
        self._shape_hook: Any = None
        self._reapply: Callable[[StepPlacement], None] | None = None

    def _forget_shapes(self) -> None:
        self._shape = self._seen = None
        self._next_shape.clear()

    def _expect_shape(self) -> None:
        """At entry: the step expects the shape that followed the last one seen, the last time it was seen."""
        self._shape = self._next_shape.get(self._seen, self._seen)

    def _wrap_recomputed(self, plan: Plan, start: int = 0) -> RecomputeLayers | None:
        """Wrap the layers ``plan`` recomputes, from layer ``start`` on, for recomputation; None when none is."""
        indices = [i for i, decision in enumerate(plan.decisions) if decision in RECOMPUTED and i >= start]
        if not indices:
            return None
        offload = [plan.decisions[i] == Placement.OFFLOADED_RECOMPUTE for i in indices]
        return RecomputeLayers([self.layers[i] for i in indices], indices, offload)

    def _attach_shape_hook(self) -> None:
        # A step that an exception ended before exit (a signal handler's) may have left its hook on;
        # two would remove each other's handle mid-forward and torch would call one without kwargs.
        if self._shape_hook is not None:
            self._shape_hook.remove()
        self._shape_hook = self.layers[0].register_forward_pre_hook(self._check_shape, with_kwargs=True)

    def _check_shape(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        """First layer's forward pre-hook: note the step's input shape; on another one than expected, follow
        its plan or offload the rest of the step."""
        self._shape_hook.remove()
        shape = signature(args, kwargs)
        if self._step.pending is not None:
            self._step.note_shape(shape, args, kwargs)
        elif shape != self._shape and self._step_plan is not None and self.pinned is None:
            running = self._unwrap_all_but(module)
            plan = self._plans.get(shape)
            if plan is not None and self._switch(plan, running):
                logger.info("tba: new input shape; this step follows its plan from the first layer on")
            else:
                logger.info("tba: new input shape; this step offloads every layer, the next one %s",
                            "follows its plan" if plan is not None else "starts profiling it")
                if self._reapply is not None:
                    self._reapply(StepPlacement(frozenset()))
        if self._seen is not None:
            self._next_shape[self._seen] = shape
        self._shape = self._seen = shape

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

    def _switch(self, plan: Plan, running: list[nn.Module]) -> bool:
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
        if (first in RECOMPUTED or self._step_plan.decisions[0] in RECOMPUTED) and first != self._step_plan.decisions[0]:
            return False
        if self._reapply is None or self._cannot_follow(plan, running):
            return False
        wrapped = self._wrap_recomputed(plan, start=1)
        if wrapped is not None:
            wrapped.layers = running + wrapped.layers
            self._recompute = wrapped
        self._step_plan = plan
        self._reapply(placement_of(plan))
        return True
