"""Placement policies: keep, offload, recompute or offloaded-recompute each layer, chosen from measurements. Pure.

* :mod:`tba.policy._profile`: what is measured per layer (forward and backward time, saved and
  input bytes) and the disk's bandwidth (plain data);
* :mod:`tba.policy._placement`: the placements (keep, offload, recompute, offloaded-recompute) and
  the bytes each spills;
* :mod:`tba.policy._model`: the cost model, predicted step time and activation peak of a placement;
* :mod:`tba.policy._plan`: :class:`Plan` and the fixed policies; :mod:`tba.policy._adaptive`: the
  adaptive planner (:func:`plan`, pure).
* :mod:`tba.policy._shape_costs` and :mod:`tba.policy._step_floor`: the adaptive search's exact
  memory and step-time lower bound of every placement shape from prefix sums, so that it runs the
  model only on the shapes that could win.

Nothing here touches a model or autograd: profiling a real step and applying a plan to an
offloader is the runtime's (``tba/runtime/_runner.py``, ``tba/runtime/_timer.py``).
"""

from tba.policy._adaptive import Adaptive, plan
from tba.policy._memory import io_bytes
from tba.policy._model import Estimate, estimate
from tba.policy._placement import (
    DECISIONS,
    KEEP,
    OFFLOAD,
    OFFLOADED_RECOMPUTE,
    RECOMPUTE,
    RECOMPUTED,
    Placement,
    holds_layers_through_forward,
)
from tba.policy._plan import KeepAll, OffloadAll, OffloadedRecomputeAll, Plan, Policy, RecomputeAll, min_window_bytes, shapes
from tba.policy._profile import LayerProfile, Profile

__all__ = [
    "DECISIONS", "KEEP", "OFFLOAD", "OFFLOADED_RECOMPUTE", "RECOMPUTE", "RECOMPUTED", "Adaptive", "Estimate", "KeepAll",
    "LayerProfile", "OffloadAll", "OffloadedRecomputeAll", "Placement", "Plan", "Policy", "Profile", "RecomputeAll",
    "estimate", "holds_layers_through_forward", "io_bytes", "min_window_bytes", "plan", "shapes",
]
