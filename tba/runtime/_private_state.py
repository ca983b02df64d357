"""What a recomputed layer's forward does to its modules' private attributes, which tba does not put back.

Note: [Private state of a recomputed layer]
tba copies and puts back a recomputed layer's buffers and public attributes (Note [Side effects of
a recomputed forward] in ``tba/runtime/_layer_state.py``) but leaves private ones (``_name``) alone:
frameworks keep their own bookkeeping there, and putting it back in the middle of backward could
break them. A forward that changes private state it reads would recompute from the changed state,
silently: a tensor updated in place (``self._ema.mul_(0.9)``), one rebound (``self._ema =
self._ema * 0.9``), a counter (``self._n += 1``), or the same in a private dict, list or tuple (one
level; Transformer Engine keeps FP8 state so), or a numpy array updated in place (``self._hist +=
1``; it has no version counter, so its bytes stand for one). So :func:`private_state` takes a
signature of that state (each value's identity, a tensor's version counter, a numpy array's bytes,
a plain value itself) before the first call and :func:`first_change` compares it after: a recomputed layer then raises
:class:`~tba.errors.TbaError` right after its forward, and the profiled steps mark such a layer not
recomputable, so the adaptive default never recomputes it (reviews found ``OOSS`` and ``OSSS``
planned for such layers, silently wrong). torch's own attributes of every module are left out. A
change of a value two levels deep, or inside a plain object, is not seen.
The same signature, taken when the first call ends, is compared again before the recomputation:
private state changed *between* forward and backward (a schedule setting ``block._scale`` after
forward, a private tensor updated in place or rebound) was read by the recomputation, silently the
gradients of another forward where torch without tba uses what forward saved (an adversarial review
found it); it raises :class:`~tba.errors.TbaError` there instead. The profiled steps do not look for
such a change: a plan that recomputes the layer raises at its first backward.

Note: [State a recomputed layer changes that tba does not put back]
tba copies public container attributes one level deep (Note [Side effects of a recomputed forward]
in ``tba/runtime/_layer_state.py``): a container inside one or inside a public tuple (``self.history
= {"calls": []}``, ``self.rows = [[0]]``, ``self.pair = ([], [])``) and a plain object
(``self.counter.n += 1``, a config object a schedule writes into) are held, not copied. A forward
that changed them and read them recomputed from the changed state, silently, and the adaptive
default planned such layers for recomputation (``ORRK`` and ``RRKK`` in an adversarial review,
every gradient of the planned steps wrong). So the signature
also holds, per public attribute, the contents of each such object one level down (each container
inside a public container, each plain object held directly or in one: its items, or its ``vars()``),
compared around the first call; the labels of these values are :class:`DeepLabel`. Such a change no longer
raises but is put back for the recomputation (Note [Nested state a recomputation is given back]); the
comparison still tells the profiled steps. Only objects present in both signatures are compared: a
new inner list appended to a public list is the outer list's change, which tba puts back. Callables,
modules, tensors, arrays and generators are not plain objects here (tba copies or checks those
otherwise, or they carry no state of the forward's). Deeper values (a list in a dict in a dict) are
still not seen. The profiled steps also compare each layer's signature taken when its forward ended
with the state as the offloader exits (``tba/runtime/_timer.py``): a
model writing into an object its layers share between their calls (``block.shared.index = i``)
made every recomputation read the last layer's value; such a layer is marked not recomputable.

Note: [Nested state a recomputation is given back]
Raising for every change of such an object refused exact models: every Hugging Face
``*ForSequenceClassification`` head sets ``config.problem_type`` on its first call, after the blocks
ran, in the config every attention holds, and a ``functools.cached_property`` of a config object
read for the first time in a forward adds to its ``__dict__``; a pinned recompute plan failed their
first step (a review found both; exact before). tba cannot tell whether the recomputation reads the
change. So, like a public attribute, it is put back: the signature keeps each nested object's items
as the first call began (``FirstCall.nested``), and :func:`put_back_nested` writes them back for the
recomputation, by identity (the items of a list, dict, set or deque; a plain object's ``vars()``,
straight into its ``__dict__``: no ``__setattr__``, frozen dataclasses too) and returns what
restores the present items after it; a counter ``self.counter.n += 1`` or ``block.shared.index = i``
recomputes exactly. Only a tensor or a numpy array among them updated in place (its version moved,
its bytes changed; tba holds no copy) raises: in forward (:func:`moved_nested_tensor`) or before the recomputation. The profiled
steps still mark a layer whose nested state changes not recomputable.
"""

from __future__ import annotations

import collections
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from tba.errors import TbaError

_MODULE_INTERNALS = frozenset(vars(nn.Module()))
"""Private attributes every module has (``_parameters``, ``_buffers``, hooks): torch's own bookkeeping."""

_PLAIN = (int, float, complex, bool, str, bytes, type(None))

Entry = tuple[str, Any, "int | bytes | None"]


class Signature(list):
    """(label, value, a tensor's version or None) per private value; ``deep``: per object nested in a public attribute
    (Note [State a recomputed layer changes that tba does not put back]), by id: (label, the object, its entries, its
    items to put back)."""

    def __init__(self, entries: Any = ()) -> None:
        super().__init__(entries)
        self.deep: dict[int, tuple[str, Any, list[Entry], list]] = {}

    def __bool__(self) -> bool:
        return len(self) > 0 or bool(self.deep)


class DeepLabel(str):
    """The label of a value nested in a public attribute (Note [State a recomputed layer changes that tba does not put
    back]), as opposed to private state."""


def private_state(layer: nn.Module) -> Signature:
    """The signature of the private state of ``layer``'s modules (Note [Private state of a recomputed layer]);
    empty when no recomputation can follow (grad disabled, inference mode)."""
    found = Signature()
    if not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
        return found
    for module in layer.modules():
        prefix = type(module).__name__
        for name, value in vars(module).items():
            if name in _MODULE_INTERNALS:
                continue
            if not name.startswith("_"):
                _deep(found.deep, f"{prefix}.{name}", value)
                continue
            found.append(_entry(f"{prefix}.{name}", value))
            if isinstance(value, (dict, list, tuple)):
                found += _contents(value, f"{prefix}.{name}")
    return found


_CONTAINERS = (list, tuple, dict, set, collections.deque)


def _plain_object(value: Any) -> bool:
    """Whether ``value`` is an object whose attributes a forward may update and tba neither copies nor checks."""
    if isinstance(value, (torch.Tensor, np.ndarray, nn.Module, torch.Generator, random.Random, np.random.Generator,
                          np.random.RandomState, type, *_PLAIN, *_CONTAINERS)) or callable(value):
        return False
    try:
        vars(value)
    except TypeError:
        return False
    return True


def _contents(value: Any, label: str) -> list[Entry]:
    if isinstance(value, dict):
        return [_entry(f"{label}[{key!r}]", item) for key, item in value.items()]
    if isinstance(value, _CONTAINERS):
        return [_entry(f"{label}[{index}]", item) for index, item in enumerate(value)]
    return [_entry(f"{label}.{name}", item) for name, item in vars(value).items()]


def _deep(found: dict[int, tuple[str, Any, list[Entry], list]], label: str, value: Any) -> None:
    """Record, in ``found``, the objects nested in the public attribute ``label`` that tba does not copy: plain objects
    and containers inside a container (Note [State a recomputed layer changes that tba does not put back])."""
    if _plain_object(value):
        found[id(value)] = (label, value, _contents(value, label), _items(value))
    elif isinstance(value, _CONTAINERS):  # a tuple too: it cannot change, a list it holds can
        items = value.items() if isinstance(value, dict) else enumerate(value) if not isinstance(value, set) else ()
        for key, item in items:
            if _plain_object(item) or (isinstance(item, _CONTAINERS) and not isinstance(item, tuple)):
                inner = f"{label}[{key!r}]"
                found.setdefault(id(item), (inner, item, _contents(item, inner), _items(item)))


def _entries_change(before: list[Entry], after: list[Entry]) -> str | None:
    if len(before) != len(after):
        return None if not before and not after else (after or before)[0][0]
    return _first_differing(before, after)


def _first_differing(before: list[Entry], after: list[Entry]) -> str | None:
    """Of two entry lists of one length: the label of the first entry that differs, else None."""
    for (label, value, version), (label_after, value_after, version_after) in zip(before, after):
        if label != label_after:
            return label_after
        if version != version_after or not _same(value, value_after):
            return label
    return None


def first_change(before: Signature, after: Signature) -> str | None:
    """The label of the first private value that changed between the two signatures (or one that appeared or
    went), else that of the first object nested in a public attribute (a :class:`DeepLabel`) whose contents changed,
    else None."""
    private = _private_change(before, after)
    if private is not None:
        return private
    deep_after = getattr(after, "deep", {})
    for key, (label, value, entries, _) in getattr(before, "deep", {}).items():
        now = deep_after.get(key)
        if now is not None and now[1] is value and _entries_change(entries, now[2]) is not None:
            return DeepLabel(label)
    return None


def _private_change(before: Signature, after: Signature) -> str | None:
    if len(before) != len(after):
        labels_before = {label for label, _, _ in before}
        return next((label for label, _, _ in after if label not in labels_before), None) or "an attribute removed"
    return _first_differing(before, after)


def _entry(label: str, value: Any) -> Entry:
    """(label, value, what tells an update in place): a tensor's version counter, a writeable numpy array's bytes (it
    has no version; Note [Private state of a recomputed layer]), else None."""
    if isinstance(value, torch.Tensor) and not value.is_inference():
        return label, value, value._version
    if isinstance(value, np.ndarray) and value.flags.writeable:
        return label, value, value.tobytes()
    return label, value, None


def _same(a: Any, b: Any) -> bool:
    """Whether a private value is unchanged: the same object, an equal plain value, or a tuple of the same
    type and length (a ``torch.Size`` rebuilt each call; its items are compared as entries of their own)."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, tuple):
        return len(a) == len(b)
    return isinstance(a, _PLAIN) and a == b


def check_private_unchanged(layer: nn.Module, after_first: list) -> None:
    """Before a recomputation: raise :class:`TbaError` when private state of the layer's modules changed since its first
    call ended (``after_first``: its signature then; Note [Private state of a recomputed layer]). Nested state is put
    back instead (:func:`put_back_nested`)."""
    if not after_first:
        return
    change = _private_change(after_first, private_state(layer))
    if change is not None:
        raise TbaError(
            f"private state of a recomputed layer ({type(layer).__name__}) changed ({change}) between its forward and "
            "backward, and tba does not put private state back for the recomputation, which would compute another "
            "forward. Change it after backward, register a tensor as a buffer or make the attribute public (tba "
            "restores those), or keep or offload this layer")


def moved_nested_tensor(before: Signature, after: Signature) -> str | None:
    """The label (a :class:`DeepLabel`) of a tensor nested in a public attribute that was updated in place between the
    two signatures, which :func:`put_back_nested` cannot put back; else None."""
    deep_after = getattr(after, "deep", {})
    for key, (label, value, entries, _) in getattr(before, "deep", {}).items():
        now = deep_after[key][2] if key in deep_after else _contents(value, label)
        moved = _moved(entries, now)
        if moved is not None:
            return DeepLabel(moved)
    return None


def _moved(entries: list[Entry], now: list[Entry]) -> str | None:
    versions = {id(item): version for _, item, version in entries if version is not None}
    return next((name for name, item, version in now
                 if version is not None and versions.get(id(item), version) != version), None)


def put_back_nested(layer: nn.Module, before: list) -> Callable[[], None]:
    """Before a recomputation: put the contents of each object nested in a public attribute that changed since the
    first call began (``before``: its signature then) back as they were, and return what restores the present contents
    (Note [Nested state a recomputation is given back]); raise :class:`TbaError` when a tensor among them was updated
    in place."""
    present: list[tuple[Any, list, list]] = []
    for label, value, entries, then in getattr(before, "deep", {}).values():
        now = _contents(value, label)
        if _entries_change(entries, now) is None:
            continue
        tensor = _moved(entries, now)
        if tensor is not None:
            raise TbaError(
                f"state of a recomputed layer ({type(layer).__name__}) nested too deep for tba to copy was updated in "
                f"place ({tensor}) between its forward and backward (tba copies public attributes one level deep: a "
                "tensor in a container inside a container, or in a plain object, is not), and the recomputation would "
                "compute another forward. Change it after backward, hold it one level deep (a buffer, or a tensor in a "
                "public attribute), or keep or offload this layer")
        present.append((value, _items(value), then))
    for value, _, then in present:
        _set_items(value, then)

    def restore() -> None:
        for value, items, _ in present:
            _set_items(value, items)

    return restore


def _items(value: Any) -> list:
    """What ``value`` holds, to put back with :func:`_set_items`: (key, item) pairs of a dict or a plain object's
    ``vars()``, else the items."""
    if isinstance(value, dict):
        return list(value.items())
    if isinstance(value, _CONTAINERS):
        return list(value)
    return list(vars(value).items())


def _set_items(value: Any, items: list) -> None:
    """Make ``value`` hold ``items`` (from :func:`_items`), in place."""
    if isinstance(value, list):
        value[:] = items
    elif isinstance(value, (set, collections.deque)):
        value.clear()
        value.update(items) if isinstance(value, set) else value.extend(items)
    else:
        target = value if isinstance(value, dict) else vars(value)
        target.clear()
        target.update(items)
