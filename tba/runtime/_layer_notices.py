"""What a placement runner tells the user about the model's layers: none found to plan for, or the ones
given never run. Each is said once (per runner, or per ``layers=`` list)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from torch import nn

from tba._units import readable_size
from tba._weak import WeakRegistry

logger = logging.getLogger("tba")

__all__ = ["forget_layers", "say_layers_not_run", "say_no_repeated_blocks", "unchecked_budget"]

FORGOTTEN_BEFORE_WARNING = 3
"""Times a runner forgets the layers it learned before it says that it cannot plan (Note [One offloader, two models])."""

_SAID_NOT_RUN = WeakRegistry()
"""First layers of ``layers=`` lists whose forward-less steps were reported (Note [Layers the forward never runs])."""


def unchecked_budget(policy: object) -> str:
    """What the notices below add when ``policy`` has a memory budget: it is not checked while nothing is planned.

    Note: [A budget no plan is made for is said to be unchecked]
    A budget is met or refused when the plan is made (docs/policies.md). A runner that never plans (a model without
    repeated blocks, two models in turn on one directory) offloaded every saved tensor and said so, but
    ``memory_budget=1K`` trained on, neither met nor refused, and the warning did not name it: the contract the
    user asked for went unchecked unsaid. The warnings now say so and how to have it checked.
    """
    budget = getattr(policy, "memory_budget_bytes", None)
    if budget is None:
        return ""
    return (f"; memory_budget={readable_size(budget)} is not checked, since no plan is made (every saved tensor "
            "offloaded is the least memory tba can give without one)")


def say_no_repeated_blocks(policy: object = None) -> None:
    """A forward saved tensors in a model without repeated blocks, or compiled as a whole, or whose blocks are
    checkpointed by the model itself (their saves carry no module stack, ``tba/runtime/_discover.py``; helper-56 saw the
    message name only compiling for GPT-2 under Hugging Face's gradient checkpointing): nothing to plan for,
    so every step offloads all until one saves tensors in repeated blocks (helper-124: a fine-tuning run whose first
    steps train only the last block found them at its second step, after a warning that said every step)."""
    logger.warning("tba: the adaptive policy found no repeated blocks in this forward (none, or the model "
                   "compiled as a whole, or its blocks run under its own activation checkpointing, or frozen "
                   "so that only one saved tensors), so steps offload every saved tensor until a forward saves "
                   "tensors in repeated blocks%s; pass layers=[...] (the model's blocks) to have a placement "
                   "planned per block", unchecked_budget(policy), extra={"tba_notice": "no repeated blocks"})


def say_layers_not_run(first: nn.Module | None, count: int, effect: str,
                       largest_live_storage_bytes: Callable[[], int]) -> None:
    """Warn, once per ``layers=`` list (its ``first`` layer, of ``count``), that a step which saved tensors ran
    none of its layers, and what that did (``effect``).

    Note: [Layers the forward never runs]
    ``layers=`` naming blocks of another model than the one the context runs (a copy, the model of an
    earlier trial, a list built before the model was rebuilt) was silent: no layer's hook ever ran, so
    an adaptive runner never finished a profiled step nor planned, a pinned plan recomputed nothing,
    and every step offloaded every saved tensor untagged. A step may legitimately run none of them
    (a context around another part of the model), so this is a warning, once per first layer.
    """
    if first is None or largest_live_storage_bytes() <= 0:
        return
    said = _SAID_NOT_RUN.value_for(first, list)
    if said:
        return
    said.append(True)
    logger.warning("tba: this forward saved tensors but ran none of the %d layers given as layers= (the first "
                   "is a %s): %s; pass the blocks of the model this context runs (layers=model finds them), "
                   "not those of another model or of a copy", count, type(first).__name__, effect)


def forget_layers(times: int, policy: object = None) -> int:
    """A learning runner forgets its layers, for the ``times + 1``-th time: said at INFO, and once, at the
    :data:`FORGOTTEN_BEFORE_WARNING`-th, as a warning. Returns ``times + 1``.

    Note: [One offloader, two models]
    A runner that learned one model's layers forgets them at a step that runs none of them and learns those
    of the model that step runs. Entered for two models in turn (a generator and a discriminator), an adaptive
    Offloader forgot and learned at every step, so it never profiled nor planned and offloaded every layer
    of both for good, said only at INFO. One step of another model costs two (the model's layers are
    learned again after it), so the third time is said as a warning.
    """
    logger.info("tba: the forward ran none of the layers planned for; finding the layers again")
    if times + 1 == FORGOTTEN_BEFORE_WARNING:
        logger.warning("tba: this adaptive context has run forwards of different models in turn (each step ran "
                       "none of the layers the one before it found), so it finds layers at every step and never "
                       "profiles nor plans: every saved tensor is offloaded%s; use one tba.Offloader per model, or "
                       "pass each context its model's layers (layers=model)", unchecked_budget(policy))
    return times + 1
