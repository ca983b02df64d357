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
and read the longer list). A numpy array among them is copied as one in the call is (it has no
version counter; ``ctx.scale *= 0.5`` on an array attribute changes it in place), and the
recomputation gets a copy of that copy (Note [A recomputation gets the call as it was] in
``tba/runtime/_call_args.py``). Classes and Python modules are not copied.
"""

from __future__ import annotations

import collections
import dataclasses
import types
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase
from torch.utils import _pytree as pytree

from tba.runtime._state_objects import UNSET, stored

__all__ = ["CONTAINERS", "Holder", "attribute_tensors", "attributes_of", "changed_holder_message", "copied_arrays",
           "put_attributes", "put_contents"]


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
    # Note [An object's fields are read without its __getattr__] in tba/runtime/_state_objects.py
    held = stored(value, "__dict__")
    slots = _slot_names(type(value))
    if type(held) is not dict and not slots:
        return None
    attributes = dict(held) if type(held) is dict else {}
    for name in slots:
        item = stored(value, name)
        if item is not UNSET:
            attributes[_SLOT, name] = item
    return attributes


def copied_arrays(attributes: dict[Any, Any]) -> dict[Any, Any]:
    """``attributes`` with a copy of each numpy array among them (Note [An object passed to a recomputed layer is
    called as it was])."""
    return {name: item.copy(order="K") if isinstance(item, np.ndarray) else item for name, item in attributes.items()}


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


@dataclasses.dataclass(frozen=True)
class Holder:
    """What holds a tensor that an object passed as it is holds: the message's words for it, and whether it is a buffer
    of a module (which a recomputation does not put back) and of a norm layer (which updates its running statistics in
    training mode)."""

    what: str
    buffer: bool = False
    norm: bool = False


def attribute_tensors(args: tuple, kwargs: dict[str, Any]) -> list[tuple[Holder, torch.Tensor]]:
    """The tensors that objects passed as they are hold as attributes (one level deep), each with what holds it:
    what the recomputation version-checks besides the call's own tensors (Note [An object passed to a recomputed
    layer is called as it was]), and so what the checks around a recomputed layer's forward watch too."""
    found = []
    for where, argument in [*((f"args[{index}]", value) for index, value in enumerate(args)),
                            *((f"kwargs[{name!r}]", value) for name, value in kwargs.items())]:
        for leaf in pytree.tree_leaves(argument):
            if isinstance(leaf, torch.Tensor):
                continue
            for key, item in (attributes_of(leaf) or {}).items():
                if isinstance(item, torch.Tensor) and not item.is_inference():
                    found.append((_holder(leaf, key, where), item))
    return found


def _holder(obj: Any, key: Any, where: str) -> Holder:
    passed = f"of the {type(obj).__name__} passed in {where}"
    if type(key) is str:
        return Holder(f"its tensor attribute {key!r} {passed}")
    kind, name = key
    if kind is _BUFFER:
        owner = obj.get_submodule(name.rpartition(".")[0])
        return Holder(f"the buffer {name!r} {passed}", True, isinstance(owner, _NormBase))
    if kind is _CELL:
        return Holder(f"the tensor in closure cell {name} {passed}")
    return Holder(f"its tensor attribute {name!r} {passed}")


def changed_holder_message(layer: str, holder: Holder, version: int, now: int) -> str:
    """The message for a recomputed layer's forward that changed ``holder``'s tensor in place (Note [A recomputed layer
    must not change its input] in ``tba/runtime/_recompute_inputs.py``)."""
    why = ("; a norm layer in training mode updates its running statistics and counter" if holder.norm else "")
    if holder.buffer:
        fix = ("Keep or offload this layer (policy='offload', or a tba.Plan that does not recompute it), make the module "
               "a submodule of the layer instead of an argument (tba puts a layer's own buffers back for its "
               "recomputation), or put it in eval mode if its state need not change")
    else:
        fix = ("Keep or offload this layer (policy='offload', or a tba.Plan that does not recompute it), or rebind the "
               "attribute instead of changing the tensor in place (obj.scale = obj.scale * 0.9 instead of "
               "obj.scale.mul_(0.9)): tba puts an object's attributes back for the recomputation")
    return (f"the forward of a recomputed layer ({layer}) changed {holder.what} in place (version {version}, now "
            f"{now}{why}): its recomputation in backward would start from the changed state. {fix}")


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
