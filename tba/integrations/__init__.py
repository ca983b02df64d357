"""Glue between tba and training frameworks; each framework lives in its own submodule.

Submodules import their framework lazily, so ``import tba.integrations.megatron`` works without
megatron-core installed and only the functions that need it raise, naming the extra to install.
:mod:`tba.integrations.deepspeed` does not import DeepSpeed at all: it reads the ``"tba"`` block of
a DeepSpeed config and wraps a ``DeepSpeedEngine``'s forward.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from tba.config import GOALS, OffloadConfig, env_name
from tba.config import options as config_options
from tba.defaults import ALIGN_BYTES
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


def option_chosen(options: Mapping[str, Any], name: str) -> bool:
    """Whether option ``name`` was chosen, so that an integration's own default for it must not replace it: given
    in ``options``, set by the ``config=`` among them to other than the schema's default, or, without a
    ``config=``, by its ``TBA_<NAME>`` variable.

    Note: [An integration's default yields to a chosen option]
    An integration that sets an option to its own default passes it as an option, and an option wins over the
    ``config=`` beside it and over the environment. MegatronOffloader set ``prefetch_depth_layers`` (1, or
    ``recompute_num_layers`` under full uniform recompute) so, and ``config=OffloadConfig(prefetch_depth_layers=3)``
    or ``TBA_PREFETCH_DEPTH_LAYERS=4`` (which add_tba_arguments says a flag not given leaves the option to) ran
    at depth 1, silently; TbaDeepSpeed put ``<nvme_path>/tba`` and DeepSpeed's ``aio`` request size and depth over
    ``TBA_DIR``, ``TBA_BLOCK_SIZE_BYTES`` and ``TBA_QUEUE_DEPTH`` (helper-165). As for the policy (Note [An
    integration's offload default and a given config]), a config's value equal to the schema's default cannot be
    told from one left unset, and takes the integration's default.
    """
    if name in options:
        return True
    config = options.get("config")
    if isinstance(config, OffloadConfig):
        default = next(field.default for field in config_options() if field.name == name)
        return getattr(config, name) != default
    return os.environ.get(env_name(name), "") != ""


_CHECKED_AGAINST = {"staging_bytes": lambda value: {"block_size_bytes": ALIGN_BYTES},
                    "block_size_bytes": lambda value: {"staging_bytes": value}}
"""Options the schema checks against another one, and that one set to fit the first's value."""


def check_alone(options: Mapping[str, Any]) -> OffloadConfig:
    """``OffloadConfig(**options)``, where an option checked against another that ``options`` leave out sets that one to
    fit: where the other comes from elsewhere, the pair is checked when the offloader is built.

    Note: [Options checked against one that comes later]
    ``staging_bytes`` must hold one block of ``block_size_bytes``. Options checked before the offloader's build, to
    name where they came from, were checked beside the schema's 4 MiB block: ``--tba-staging-bytes 1M
    --tba-block-size-bytes 512K`` was refused at the first flag (argparse reads them one at a time), and a DeepSpeed
    block's ``"staging_bytes": "2M"`` though its block size is DeepSpeed's ``aio.block_size``, 1 MiB by default
    (helper-165). Its partner, when not among the options, is set so that the pair fits; the offloader's config,
    which has every value (``TBA_*`` variables too), checks the pair.
    """
    partners: dict[str, Any] = {}
    for name, value in options.items():
        fit = _CHECKED_AGAINST.get(name)
        if fit is not None and value is not None:
            partners.update({key: fitting for key, fitting in fit(value).items() if key not in options})
    return OffloadConfig(**{**partners, **options})
