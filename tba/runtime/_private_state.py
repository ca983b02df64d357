"""What a recomputed layer's forward does to its modules' private attributes, which tba does not put back.

Note: [Private state of a recomputed layer]
tba copies and puts back a recomputed layer's buffers and public attributes (Note [Side effects of
a recomputed forward] in ``tba/runtime/_layer_state.py``) but leaves private ones (``_name``) alone:
frameworks keep their own bookkeeping there, and putting it back in the middle of backward could
break them. A forward that changes private state it reads would recompute from the changed state,
silently: a tensor updated in place (``self._ema.mul_(0.9)``), one rebound (``self._ema = self._ema * 0.9``), a
counter (``self._n += 1``), or the same in a private dict, list or tuple (one level; Transformer Engine keeps FP8
state so) or set, deque, ``bytearray`` or ``array.array`` (their contents were not compared, and a count kept in one
recomputed silently, under the adaptive default too), or a numpy array updated in place (``self._hist += 1``; it has
no version counter, so its bytes stand for one). So :func:`private_state` takes a signature of that state (each
value's identity, a tensor's version counter, a numpy array's bytes, a plain value itself) before the first call and
:func:`first_change` compares it after: a recomputed layer then raises :class:`~tba.errors.TbaError` right after its
forward, and the profiled steps mark such a layer not
recomputable, so the adaptive default never recomputes it (reviews found ``OOSS`` and ``OSSS``
planned for such layers, silently wrong). torch's own attributes of every module are left out. A
change of a private value two levels deep (a list in a private dict), or inside a plain object held
in a private attribute, is not seen: private state is not walked as public state is.
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
also holds, per public attribute, the contents of each such object (each container below a public
container or plain object, each plain object held directly or below one: its items, or its
``vars()`` and slots), walked level by level (``self.config.history``, ``self.deep["a"]["b"]``; a
review found a list in a config object, dicts three levels deep and a ``__slots__`` object
recomputed silently when only one level was held) within a bound on depth and items, each object
once (Note [The walk of nested state] in ``tba/runtime/_nested_state.py``), and
compared around the first call; the labels of these values are :class:`DeepLabel`. Such a change no longer
raises but is put back for the recomputation (Note [Nested state a recomputation is given back]); the
comparison still tells the profiled steps. Only objects present in both signatures are compared: a
new inner list appended to a public list is the outer list's change, which tba puts back. Callables,
modules, tensors, arrays and generators are not plain objects here (tba copies or checks those
otherwise, or they carry no state of the forward's), and are not walked into: what a module held in
a plain object holds, or an object reached only through a callable (a bound method's ``__self__``, a
closure), is not seen. Past the walk's bound an object is held shallow: what it holds is compared by
identity and put back, what changes below it is not seen. The profiled steps also compare each layer's
signature taken when its forward ended with the state as the offloader exits (``tba/runtime/_timer.py``): a
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
recomputation, by identity (the items of a list, dict, set or deque; a plain object's ``vars()`` and slots,
straight into its ``__dict__`` and slot descriptors: no ``__setattr__``, frozen dataclasses too) and returns what
restores the present items after it; a counter ``self.counter.n += 1`` or ``block.shared.index = i``
recomputes exactly, at any level the walk reaches (``self.config.counts["n"] += 1``). Only a tensor
or a numpy array among them updated in place (its version moved, its bytes changed; tba holds no
copy) raises (:func:`~tba.runtime._nested_state.check_restorable`): in forward or before the recomputation. The profiled
steps still mark a layer whose nested state changes not recomputable.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from tba import defaults
from tba.errors import TbaError
from tba.runtime._nested_state import (
    DeepLabel,
    Entry,
    Nested,
    changed,
    check_restorable,
    check_watchable,
    contents,
    entry,
    first_differing,
    put_back_nested,
    walk,
)
from tba.runtime._state_objects import CONTAINERS

__all__ = ["MODULE_INTERNALS", "DeepLabel", "Signature", "check_private_unchanged", "check_restorable", "check_watchable",
           "first_change", "modules_state", "private_state", "put_back_nested"]

MODULE_INTERNALS = frozenset(vars(nn.Module()))
"""Private attributes every module has (``_parameters``, ``_buffers``, hooks): torch's own bookkeeping."""


class Signature(list):
    """(label, value, a tensor's version or None) per private value; ``deep``: per object nested in a public attribute
    (Note [State a recomputed layer changes that tba does not put back]), by id (``tba/runtime/_nested_state.py``)."""

    def __init__(self, entries: Any = ()) -> None:
        super().__init__(entries)
        self.deep: dict[int, Nested] = {}

    def __bool__(self) -> bool:
        return len(self) > 0 or bool(self.deep)

    def add(self, other: Signature) -> None:
        """Append ``other``'s entries; of an object nested in both, the signature already here stays (the earlier)."""
        self.extend(other)
        for key, nested in other.deep.items():
            self.deep.setdefault(key, nested)


def private_state(layer: nn.Module, nested: bool = True, outside: Iterable[Iterable[nn.Module]] = ()) -> Signature:
    """The signature of the private state of ``layer``'s modules (Note [Private state of a recomputed layer]) and, unless
    not ``nested``, of the objects nested in their public attributes; empty when no recomputation can follow (grad
    disabled, inference mode). Then those of each group of ``outside`` (the modules outside the layer that its first
    call ran, a group per module it called: Note [A recomputation puts back the modules outside its layer that it
    calls] in ``tba/runtime/_outside_state.py``), each walked within a bound of its own, as :func:`modules_state`
    took them when the first call reached them."""
    found = modules_state(layer.modules(), nested)
    for modules in outside:
        found.add(modules_state(modules, nested))
    return found


def modules_state(modules: Iterable[nn.Module], nested: bool = True) -> Signature:
    """The signature of :func:`private_state` of ``modules`` alone."""
    found = Signature()
    if not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
        return found
    budget = [defaults.RECOMPUTE_NESTED_STATE_ITEMS]
    for module in modules:
        prefix = type(module).__name__
        for name, value in vars(module).items():
            if name in MODULE_INTERNALS:
                continue
            if not name.startswith("_"):
                if nested:
                    walk(found.deep, f"{prefix}.{name}", value, budget)
                continue
            found.append(entry(f"{prefix}.{name}", value))
            if isinstance(value, CONTAINERS):  # a set, deque, bytearray or array.array too: their contents were unseen
                found += contents(value, f"{prefix}.{name}")
    return found


def first_change(before: Signature, after: Signature) -> str | None:
    """The label of the first private value that changed between the two signatures (or one that appeared or
    went), else that of the first object nested in a public attribute (a :class:`DeepLabel`) whose contents changed,
    else None."""
    private = _private_change(before, after)
    if private is not None:
        return private
    deep_after = getattr(after, "deep", {})
    for key, then in getattr(before, "deep", {}).items():
        now = deep_after.get(key)
        if now is not None and now[1] is then[1] and changed(then, now):
            return DeepLabel(then[0])
    return None


def _private_change(before: list[Entry], after: list[Entry]) -> str | None:
    if len(before) != len(after):
        labels_before = {label for label, _, _ in before}
        return next((label for label, _, _ in after if label not in labels_before), None) or "an attribute removed"
    return first_differing(before, after)


def check_private_unchanged(layer: nn.Module, after_first: list, outside: Iterable[Iterable[nn.Module]] = ()) -> None:
    """Before a recomputation: raise :class:`TbaError` when private state of the layer's modules (and of the ``outside``
    ones its first call ran, as :func:`private_state` takes them) changed since its first call ended (``after_first``:
    its signature then; Note [Private state of a recomputed layer]). Nested state is put back instead
    (:func:`put_back_nested`)."""
    if not after_first:
        return
    change = _private_change(after_first, private_state(layer, nested=False, outside=outside))
    if change is not None:
        raise TbaError(
            f"private state of a recomputed layer ({type(layer).__name__}) changed ({change}) between its forward and "
            "backward, and tba does not put private state back for the recomputation, which would compute another "
            "forward. Change it after backward, register a tensor as a buffer or make the attribute public (tba "
            "restores those), or keep or offload this layer")
