"""The runners that successive one-shot contexts share.

``offload_activations()`` builds a new one-shot offloader every step, so its runner is shared: a
weak-keyed registry maps the first layer module and the goal (and a policy object's class, Note [A
policy object in one-shot contexts]) to the runner (with ``layers=``), a bounded one maps the spill
directory and the goal to it (without; Note [Bare contexts' runners are bounded]); the runner holds
its layers only weakly, so it lives no longer than needed and never keeps a model alive.
"""

from __future__ import annotations

import copy
import logging
import weakref
from typing import Any

import torch
from torch import nn

from tba.policy import Policy
from tba.runtime._runner import PolicyRunner

_SHARED_RUNNERS: weakref.WeakKeyDictionary[nn.Module, dict[tuple, PolicyRunner]] = weakref.WeakKeyDictionary()
_SHARED_BARE_RUNNERS: dict[tuple, PolicyRunner] = {}
"""Keyed by directory and goal, least recently used first (Note [Bare contexts' runners are bounded])."""
MAX_BARE_RUNNERS = 32
"""Runners of bare contexts (no ``layers=``) kept at most, each for one directory, goal and policy class."""
_WARNED_REPLACED: weakref.WeakSet[type] = weakref.WeakSet()
"""Policy classes whose object replaced one that had not planned yet (warned about once per class)."""

logger = logging.getLogger("tba")

__all__ = ["shared_runner"]


def shared_runner(layers: list[nn.Module], policy: Any, *, shared: bool, directory: str | None = None,
                  **goal: Any) -> PolicyRunner:
    """A runner; with ``shared``, the one that successive one-shot offloaders of these layers (or,
    without layers, of this directory) and this goal share.

    Note: [A policy object in one-shot contexts]
    A :class:`~tba.policy.Policy` object profiles and plans across steps, as ``"adaptive"`` does, so
    its one-shot contexts share a runner too: given a new runner every step, it profiled every step
    and never planned, silently offloading everything for good (found twice, by the fuzzer's new
    cases and by a review). One slot per policy class holds it; the same object, or one of its class
    with the attributes that one was given with (``policy=MyPolicy()`` written in the ``with`` line
    builds one every step; what the policy records in itself later does not count) reuses it; another
    replaces it, so objects built per step leave nothing behind. The runner holds its policy weakly and
    each offloader strongly (a policy may hold the model, which the registries must not keep alive);
    once that object is gone, the next one of its class with its attributes takes its place.
    """
    is_object = isinstance(policy, Policy)
    if not shared or not (is_object or (isinstance(policy, str) and policy == "adaptive")):
        return PolicyRunner(layers, policy, **goal)
    key = (len(layers), *sorted(goal.items()))
    if is_object:
        key = (*key, type(policy))
    runners = _SHARED_RUNNERS.setdefault(layers[0], {}) if layers else _SHARED_BARE_RUNNERS
    if not layers:
        key = (directory, *key)
        if key in runners:
            runners[key] = runners.pop(key)  # the most recently used goes last
    if key not in runners or (is_object and not _same_policy(runners[key], policy)):
        if key in runners and runners[key].profile is None and type(policy) not in _WARNED_REPLACED:
            _WARNED_REPLACED.add(type(policy))
            logger.warning("tba: a new %s object replaced the one the last step was given before it planned (their "
                           "attributes differ, or do not compare equal), so its profile starts again and the step "
                           "offloads everything; if it is built per step, build the policy once, outside the training "
                           "loop, and pass that object", type(policy).__name__)
        runners[key] = PolicyRunner(layers, policy, **goal)
        if is_object:
            runners[key].policy_attributes = _attributes(policy)
        if not layers:
            _bound_bare_runners(key)
    if is_object and (runners[key].policy is None or runners[key].policy is policy):  # None: its object is gone
        runners[key].hold_policy_weakly(policy)
    return runners[key]


def _bound_bare_runners(new_key: tuple) -> None:
    """Forget bare contexts' runners whose model was freed, then the least recently used beyond the bound.

    Note: [Bare contexts' runners are bounded]
    A bare context's runner is found by its directory and goal, for as long as the process lives: a
    sweep or a test suite that trains each model in a directory of its own added a runner per model,
    each with its profiles and plans, and none ever went. A runner whose model was freed holds nothing
    a new runner would not (its next entry finds layers again), so it goes as soon as a new runner
    comes; beyond :data:`MAX_BARE_RUNNERS`, the least recently used goes too. A context that used
    that one profiles again, as it did on its first steps: slower for a few steps, never inexact.
    """
    for key in [key for key, runner in _SHARED_BARE_RUNNERS.items() if key != new_key and runner.model_freed]:
        del _SHARED_BARE_RUNNERS[key]
    while len(_SHARED_BARE_RUNNERS) > MAX_BARE_RUNNERS:
        del _SHARED_BARE_RUNNERS[next(key for key in _SHARED_BARE_RUNNERS if key != new_key)]


def _attributes(policy: Policy) -> dict | None:
    """A copy of ``policy``'s attributes as given (what it records of its own later does not count), or None.

    Modules and tensors (held directly or in a list, tuple or dict attribute) are not copied: each is
    stood for by a :class:`_Same`, equal to that object only and holding it weakly. Deep-copied, a policy
    that holds the model had its weights copied at every new slot, and the copy, never equal to the model,
    gave a policy built per step a new runner every step."""
    try:
        attributes = vars(policy)
        held = [*attributes.values()]
        held += [item for value in attributes.values() if isinstance(value, (list, tuple, dict))
                 for item in (value.values() if isinstance(value, dict) else value)]
        memo = {id(value): _Same(value) for value in held if isinstance(value, (nn.Module, torch.Tensor))}
        return copy.deepcopy(attributes, memo)
    except Exception:  # noqa: BLE001 - no __dict__ (slots), or attributes that cannot be copied: only the object matches
        return None


class _Same:
    """Stands for a module or tensor among a policy's attributes as given: equal to that object only, which
    it holds weakly (the registries must not keep a model alive)."""

    __slots__ = ("ref",)
    __hash__ = None

    def __init__(self, value: Any) -> None:
        self.ref = weakref.ref(value)

    def __eq__(self, other: object) -> bool:
        return self.ref() is other


def _same_policy(runner: PolicyRunner, policy: Policy) -> bool:
    """Whether ``policy`` is the runner's, or an object of its class with the attributes it was given with."""
    if runner.policy is policy:
        return True
    given = runner.policy_attributes  # the slot's key holds the class: only the attributes can differ
    if given is None:
        return False
    try:
        return bool(given == vars(policy))  # given's _Same compare first
    except Exception:  # noqa: BLE001 - attributes that do not compare (tensors): not the same
        return False
