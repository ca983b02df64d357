"""The attributes of an object passed as it is to a recomputed layer, copied at the call and put back for the
recomputation (``tba/runtime/_call_args.py`` takes the call apart; this module handles what it passes as it is).

Note: [An object passed to a recomputed layer is called as it was]
An object passed as it is (a dataclass or any object with a ``__dict__``: a per-forward context, a
routing state) may have its attributes rebound by the caller after the call (``ctx.scale *= 0.7``
between blocks, ``state.h = block(x, state)``) or by the layer's own forward (a call counter). The
recomputation read the object as it was in backward: saved tensors computed from another scale, and
gradients silently different from training without tba under ``recompute`` and ``offloaded_recompute``
(a review found it; plain checkpoint does the same). The template keeps a shallow copy of each such
object's attributes at the call; the recomputation runs with them put back and, once it has run,
the object gets the attributes it had before the recomputation (``Template.as_called`` in
``tba/runtime/_call_args.py``). Tensors among them are version-checked like a namedtuple's: one changed
in place since the call raises torch's in-place error instead of being recomputed from.

What is copied: an object's ``__dict__`` and its set slots; of a module passed in (a rotary embedding
shared by the blocks), its public attributes, its buffers being version-checked; of a function (a
lambda), what its closure's cells hold. A list, dict, set or deque among them is copied one level deep
(a layer appending an auxiliary loss to ``context.losses``: the recomputation appended a second time,
and read the longer list). Classes and Python modules are not copied.
"""

from __future__ import annotations

import collections
import types
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

__all__ = ["CONTAINERS", "attribute_tensors", "attributes_of", "put_attributes", "put_contents"]


def attributes_of(value: Any) -> dict[str, Any] | None:
    """A shallow copy of the attributes of an object passed as it is (those in its ``__dict__`` and its slots
    that are set), or None for one whose attributes are not copied (Note [An object passed to a recomputed layer
    is called as it was])."""
    if isinstance(value, nn.Module):  # its public attributes; its buffers, to version-check them
        return {**{name: item for name, item in vars(value).items() if not name.startswith("_")},
                **{(_BUFFER, name): buffer for name, buffer in value.named_buffers()}}
    if isinstance(value, types.FunctionType):  # what its closure's cells hold (a lambda's captured scale)
        return {(_CELL, index): _cell(cell) for index, cell in enumerate(value.__closure__ or ())}
    if isinstance(value, (type, types.ModuleType, types.MethodType)):
        return None
    held = getattr(value, "__dict__", None)
    slots = _slot_names(type(value))
    if type(held) is not dict and not slots:
        return None
    attributes = dict(held) if type(held) is dict else {}
    for name in slots:
        if hasattr(value, name):
            attributes[_SLOT, name] = getattr(value, name)
    return attributes


_SLOT, _BUFFER, _CELL, _EMPTY = object(), object(), object(), object()
"""Mark a slot's entry (key ``(_SLOT, name)``), a module's buffer (``(_BUFFER, name)``, version-checked, not put
back) and a function's closure cell (``(_CELL, index)``; ``_EMPTY``: an unset cell) among an object's copied
attributes."""


def _cell(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:
        return _EMPTY


def _slot_names(kind: type) -> list[str]:
    names = []
    for cls in kind.__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for name in [slots] if isinstance(slots, str) else slots:
            if name not in ("__dict__", "__weakref__"):
                private = name.startswith("__") and not name.endswith("__")
                names.append(f"_{cls.__name__.lstrip('_')}{name}" if private else name)
    return names


def attribute_tensors(args: tuple, kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors that objects passed as they are hold as attributes (one level deep): what the recomputation
    version-checks besides the call's own tensors (Note [An object passed to a recomputed layer is called as it
    was]), and so what the checks around a recomputed layer's forward watch too."""
    return [item for leaf in pytree.tree_leaves((args, kwargs)) if not isinstance(leaf, torch.Tensor)
            for item in (attributes_of(leaf) or {}).values() if isinstance(item, torch.Tensor) and not item.is_inference()]


CONTAINERS = (list, dict, set, collections.deque)


def put_contents(container: Any, contents: Any) -> None:
    container.clear()
    if isinstance(container, (dict, set)):
        container.update(contents)
    else:
        container.extend(contents)


def put_attributes(obj: Any, attributes: dict[Any, Any]) -> None:
    now = attributes_of(obj) or {}
    if now.keys() == attributes.keys() and all(now[name] is value for name, value in attributes.items()):
        return
    if isinstance(obj, types.FunctionType):
        for (_, index), value in attributes.items():
            if value is _EMPTY:
                del obj.__closure__[index].cell_contents
            else:
                obj.__closure__[index].cell_contents = value
        return
    held = getattr(obj, "__dict__", None)
    if isinstance(obj, nn.Module):  # public attributes only: a module keeps its own bookkeeping in private ones
        for name in [name for name in held if not name.startswith("_") and name not in attributes]:
            del held[name]
    elif type(held) is dict:
        held.clear()
    if type(held) is dict:
        held.update((name, value) for name, value in attributes.items() if type(name) is str)
    for key in now.keys() - attributes.keys():
        if type(key) is tuple and key[0] is _SLOT:
            object.__delattr__(obj, key[1])
    for key, value in attributes.items():
        if type(key) is tuple and key[0] is _SLOT:
            object.__setattr__(obj, key[1], value)  # through the slot's descriptor, frozen classes too
