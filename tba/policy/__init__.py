"""Placement policies: keep, offload or recompute each layer, chosen from measurements.

* :mod:`tba.policy._profile`: what is measured per layer (forward and backward time, saved and
  input bytes) and the disk's bandwidth;
* :mod:`tba.policy._model`: the cost model, predicted step time and activation peak of a placement;
* :mod:`tba.policy._plan`: the planner (:func:`plan`, pure) and the policy classes;
* :mod:`tba.policy._runner`: profiling the first steps of an :class:`~tba.Offloader` and applying
  the plan to it.
"""

from tba.policy._model import DECISIONS, KEEP, OFFLOAD, RECOMPUTE, Estimate, estimate
from tba.policy._plan import Adaptive, KeepAll, OffloadAll, Plan, Policy, RecomputeAll, plan
from tba.policy._profile import LayerProfile, LayerTimer, Profile
from tba.policy._runner import POLICIES, PolicyRunner

__all__ = [
    "DECISIONS", "KEEP", "OFFLOAD", "RECOMPUTE", "Adaptive", "Estimate", "KeepAll", "LayerProfile", "LayerTimer",
    "OffloadAll", "POLICIES", "Plan", "Policy", "PolicyRunner", "Profile", "RecomputeAll", "estimate", "plan",
]
