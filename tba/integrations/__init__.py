"""Glue between tba and training frameworks; each framework lives in its own submodule.

Submodules import their framework lazily, so ``import tba.integrations.megatron`` works without
megatron-core installed and only the functions that need it raise, naming the extra to install.
:mod:`tba.integrations.deepspeed` does not import DeepSpeed at all: it reads the ``"tba"`` block of
a DeepSpeed config and wraps a ``DeepSpeedEngine``'s forward.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tba.config import GOALS, OffloadConfig
from tba.errors import TbaConfigError


def integration_policy(options: Mapping[str, Any]) -> Any:
    """The policy an integration's offloader runs with: ``options["policy"]`` where given, else that of the
    ``config=`` where it chose one, else ``"offload"`` (docs/policies.md).

    Note: [An integration's offload default and a given config]
    The integrations offload unless told to plan, and passed ``policy="offload"`` beside the user's options.
    An option wins over the ``config=`` it comes with, so ``MegatronOffloader(model, config=OffloadConfig(
    policy="adaptive", overhead_bound=0.5))`` (or the same config in ``TbaTrainer``'s ``tba_options``) was
    refused with "overhead_bound need policy='adaptive', not 'offload'", blaming the user for the policy the
    integration had put in, and a config pinning a ``tba.Plan`` silently offloaded everything (helper-125).
    The config's policy is taken where it chose one: a policy other than the schema's default, or an
    adaptive goal. Its bare default, ``"adaptive"`` with no goal, cannot be told from one left unset, and
    stays the integration's ``"offload"``.
    """
    if "policy" in options:
        return options["policy"]
    config = options.get("config")
    if isinstance(config, OffloadConfig) and (
            config.policy != "adaptive" or any(getattr(config, goal) is not None for goal in GOALS)):
        return config.policy
    return "offload"


def check_goal(options: Mapping[str, Any], policy: Any, *, policy_given: bool, owner: str, fix: str) -> None:
    """Refuse a goal in ``options`` beside a ``policy`` that plans nothing, where the integration is built.

    ``owner`` names where the goal was given (``"tba_options'"``), ``fix`` how to ask for planning (``"add
    \"policy\": \"adaptive\" to tba_options"``). Left to the runner, the goal was refused at the first step as
    "need policy='adaptive', not 'offload'", a policy the user never gave: the integration's default.
    """
    goals = [name for name in GOALS if options.get(name) is not None]
    if not goals or (isinstance(policy, str) and policy == "adaptive"):
        return
    given = repr(policy) if isinstance(policy, str) else f"a {type(policy).__name__}"
    default = "" if policy_given else " (the integration's default)"
    raise TbaConfigError(f"{owner} {goals[0]} is a goal of policy='adaptive', and policy is {given}{default}: "
                         f"{fix}, or drop {goals[0]}")
