"""What a recomputed layer's forward does to its modules' private attributes, which tba does not put back.

Note: [Private state of a recomputed layer]
tba copies and puts back a recomputed layer's buffers and public attributes (Note [Side effects of
a recomputed forward] in ``tba/runtime/_layer_state.py``) but leaves private ones (``_name``) alone:
frameworks keep their own bookkeeping there, and putting it back in the middle of backward could
break them. A forward that changes private state it reads would recompute from the changed state,
silently: a tensor updated in place (``self._ema.mul_(0.9)``), one rebound (``self._ema =
self._ema * 0.9``), a counter (``self._n += 1``), or the same in a private dict, list or tuple (one
level; Transformer Engine keeps FP8 state so). So :func:`private_state` takes a signature of that
state (each value's identity, a tensor's version counter, a plain value itself) before the first
call and :func:`first_change` compares it after: a recomputed layer then raises
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
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tba.errors import TbaError

_MODULE_INTERNALS = frozenset(vars(nn.Module()))
"""Private attributes every module has (``_parameters``, ``_buffers``, hooks): torch's own bookkeeping."""

_PLAIN = (int, float, complex, bool, str, bytes, type(None))

Signature = list[tuple[str, Any, int | None]]
"""(label, value, a tensor's version or None) per private value."""


def private_state(layer: nn.Module) -> Signature:
    """The signature of the private state of ``layer``'s modules (Note [Private state of a recomputed layer]);
    empty when no recomputation can follow (grad disabled, inference mode)."""
    if not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
        return []
    found: Signature = []
    for module in layer.modules():
        prefix = type(module).__name__
        for name, value in vars(module).items():
            if not name.startswith("_") or name in _MODULE_INTERNALS:
                continue
            found.append(_entry(f"{prefix}.{name}", value))
            if isinstance(value, dict):
                found += [_entry(f"{prefix}.{name}[{key!r}]", item) for key, item in value.items()]
            elif isinstance(value, (list, tuple)):
                found += [_entry(f"{prefix}.{name}[{index}]", item) for index, item in enumerate(value)]
    return found


def first_change(before: Signature, after: Signature) -> str | None:
    """The label of the first private value that changed between the two signatures (or one that appeared or
    went), else None."""
    if len(before) != len(after):
        labels_before = {label for label, _, _ in before}
        return next((label for label, _, _ in after if label not in labels_before), None) or "an attribute removed"
    for (label, value, version), (label_after, value_after, version_after) in zip(before, after):
        if label != label_after:
            return label_after
        if version != version_after or not _same(value, value_after):
            return label
    return None


def _entry(label: str, value: Any) -> tuple[str, Any, int | None]:
    if isinstance(value, torch.Tensor) and not value.is_inference():
        return label, value, value._version
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
    call ended (``after_first``: its signature then; Note [Private state of a recomputed layer])."""
    if not after_first:
        return
    change = first_change(after_first, private_state(layer))
    if change is not None:
        raise TbaError(
            f"private state of a recomputed layer ({type(layer).__name__}) changed ({change}) between its forward and "
            "backward, and tba does not put private state back for the recomputation, which would compute another "
            "forward. Change it after backward, register a tensor as a buffer or make the attribute public (tba "
            "restores those), or keep or offload this layer")
