"""Which policy a :class:`~tba.runtime._runner.PolicyRunner` plans with, and how it holds it.

``policy=`` is read once, as the runner is built: a :class:`~tba.policy.Plan` is pinned (every step
follows it), a :class:`~tba.policy.Policy` object plans on the profile, ``"adaptive"`` builds
:class:`~tba.policy.Adaptive` for the goal (``memory_budget_bytes`` or ``overhead_bound``), and
``"offload"`` and ``"keep"`` plan nothing; a goal given with another policy than ``"adaptive"`` is a
:class:`~tba.errors.TbaConfigError`. The runner's ``name`` is the policy's, or its object's class name.

A runner holds its policy strongly, except one that one-shot contexts share: the registry of shared
runners must not keep alive a model the policy holds, so such a runner holds its policy weakly and
each offloader strongly (Note [A policy object in one-shot contexts] in ``tba/runtime/_shared_runners.py``).
"""

from __future__ import annotations

import weakref

from tba.defaults import POLICIES
from tba.errors import TbaConfigError, did_you_mean
from tba.policy import Adaptive, Plan, Policy

__all__ = ["RunnerPolicy"]


class RunnerPolicy:
    """Mixin of :class:`~tba.runtime._runner.PolicyRunner`: the policy that plans, a pinned plan, and their name."""

    def __init__(self, policy: str | Plan | Policy, memory_budget_bytes: int | None,
                 overhead_bound: float | None) -> None:
        self._policy: Policy | weakref.ref | None = None
        self.pinned: Plan | None = None
        if (memory_budget_bytes is not None or overhead_bound is not None) and isinstance(policy, (Plan, Policy)):
            # A pinned plan or a policy object plans without the goal: refused, as with "offload" and "keep", not ignored.
            raise TbaConfigError(f"memory_budget and overhead_bound need policy='adaptive', not a {type(policy).__name__}; "
                                 "leave the goal out, or pass policy='adaptive'")
        if isinstance(policy, Plan):
            self.pinned = policy
        elif isinstance(policy, Policy):
            self.policy = policy
        elif policy == "adaptive":
            try:
                self.policy = Adaptive(memory_budget_bytes=memory_budget_bytes, overhead_bound=overhead_bound)
            except ValueError as err:
                raise TbaConfigError(f"policy='adaptive': {err}") from None
        elif isinstance(policy, type) and issubclass(policy, Policy):
            raise TbaConfigError(f"policy is the class {policy.__name__}, not an object of it: pass "
                                 f"policy={policy.__name__}() (with the arguments it takes)")
        elif policy not in POLICIES:
            raise TbaConfigError(f"unknown policy {policy!r}; {did_you_mean(policy, POLICIES)}"
                                 f"use one of {', '.join(POLICIES)}, a tba.Plan or a tba.Policy")
        elif memory_budget_bytes is not None or overhead_bound is not None:
            raise TbaConfigError(f"memory_budget and overhead_bound need policy='adaptive', not {policy!r}")
        self.name = policy if isinstance(policy, str) else type(policy).__name__
        self.policy_attributes: dict | None = None
        """A shared policy object's attributes as given (Note [A policy object in one-shot contexts])."""

    @property
    def policy(self) -> Policy | None:
        """The policy that plans (None: finding layers only, a pinned plan, ``offload``, ``keep``)."""
        return self._policy() if isinstance(self._policy, weakref.ref) else self._policy

    @policy.setter
    def policy(self, policy: Policy | None) -> None:
        self._policy = policy

    def hold_policy_weakly(self, policy: Policy) -> None:
        """Plan with ``policy``, held weakly: by the registry of shared runners, which must not keep alive a
        model the policy holds (Note [A policy object in one-shot contexts]); each offloader holds it."""
        try:
            self._policy = weakref.ref(policy)
        except TypeError:  # __slots__ without __weakref__: held as it is
            self._policy = policy
