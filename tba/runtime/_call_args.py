"""A recomputed layer's call taken apart at its first call and rebuilt for the recomputation.

Note: [A recomputation gets the call as it was]
Checkpoint saves only its *top-level* tensor arguments, through the saved-tensor pair on top, and
keeps every other argument referenced by its closure until backward. tba therefore hands checkpoint
every tensor of a recomputed layer's call, keyword ones and those in lists, tuples and dicts too,
as top-level arguments, so that each is saved on its own: written and read back (prefetched) for
an ``offloaded_recompute`` layer, kept for a ``recompute`` one, and version-checked at unpack either
way (an in-place change after forward raises instead of being recomputed from). What the closure
keeps, a :class:`Template`, is the call's structure and its other values, no tensor.

The two calls get different objects:

* The *first* call (in forward) gets the caller's own objects: a list the layer appends an
  auxiliary loss to is the caller's list (a rebuilt copy lost every append, and the loss changed).
* The *recomputation* gets the call as it was when the first call started: every ``list``,
  ``tuple`` and ``dict`` rebuilt as a new one of the same type, with the items it held then. A
  caller that changed its list after the call (``state[0] = block(state)``, or DenseNet's growing
  ``features`` list) no longer changes what the recomputation computes (it did under plain
  checkpoint, silently), and the recomputation's own appends do not reach the caller's list twice.

Only exact ``list``, ``tuple`` and ``dict`` objects are taken apart. Any other object is passed as
it is, the very object, its tensors held in memory until backward as under plain checkpoint: a
``torch.Size`` (rebuilt by ``torch.utils._pytree`` as a plain tuple, it lost ``numel()``), a
namedtuple, an ``OrderedDict``, the user's own classes. (Two reviews found these cases.)
"""

from __future__ import annotations

from typing import Any

import torch


class _Slot:
    """Where a tensor goes back: ``saved[index]``."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


class _Sequence:
    """A ``list`` or ``tuple`` of the call, rebuilt from its items' templates."""

    __slots__ = ("kind", "items")

    def __init__(self, kind: type, items: tuple) -> None:
        self.kind, self.items = kind, items


class _Mapping:
    """A ``dict`` of the call, rebuilt with the same keys in the same order."""

    __slots__ = ("keys", "items")

    def __init__(self, keys: tuple, items: tuple) -> None:
        self.keys, self.items = keys, items


class Template:
    """A call's ``(args, kwargs)`` without its tensors (Note [A recomputation gets the call as it was]):
    :func:`take_apart` makes one, :meth:`call` rebuilds the call around the tensors checkpoint hands back."""

    __slots__ = ("_structure",)

    def __init__(self, structure: Any) -> None:
        self._structure = structure

    def call(self, saved: tuple[torch.Tensor, ...]) -> tuple[tuple, dict[str, Any]]:
        """``(args, kwargs)`` as they were, with ``saved`` in the tensors' places."""
        return _rebuild(self._structure, saved)


def take_apart(args: tuple, kwargs: dict[str, Any]) -> tuple[Template, list[torch.Tensor]]:
    """The call's :class:`Template` and its tensors, in the order :meth:`Template.call` expects them."""
    tensors: list[torch.Tensor] = []
    return Template(_take_apart((args, kwargs), tensors)), tensors


def _take_apart(value: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return _Slot(len(tensors) - 1)
    kind = type(value)
    if kind is tuple or kind is list:
        return _Sequence(kind, tuple(_take_apart(item, tensors) for item in value))
    if kind is dict:
        return _Mapping(tuple(value), tuple(_take_apart(item, tensors) for item in value.values()))
    return value


def _rebuild(template: Any, saved: tuple[torch.Tensor, ...]) -> Any:
    kind = type(template)
    if kind is _Slot:
        return saved[template.index]
    if kind is _Sequence:
        return template.kind(_rebuild(item, saved) for item in template.items)
    if kind is _Mapping:
        return dict(zip(template.keys, (_rebuild(item, saved) for item in template.items)))
    return template
