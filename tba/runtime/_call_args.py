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
namedtuple, an ``OrderedDict``, the user's own classes. The tensors ``torch.utils._pytree`` finds
inside them (a namedtuple's, an ``OrderedDict``'s) are version-checked before the recomputation,
raising torch's in-place error as torch does without checkpoint. A tensor or container met twice
in the call is one object twice in the rebuilt call too (``block(h, h, h)`` keeps attention's
``query is key`` path; a list passed twice stays one list). (Three reviews found these cases.)

Note: [An object passed to a recomputed layer is called as it was]
An object passed as it is (a dataclass or any object with a ``__dict__``: a per-forward context, a
routing state) may have its attributes rebound by the caller after the call (``ctx.scale *= 0.7``
between blocks, ``state.h = block(x, state)``) or by the layer's own forward (a call counter). The
recomputation read the object as it was in backward: saved tensors computed from another scale, and
gradients silently different from training without tba under ``recompute`` and ``offloaded_recompute``
(a review found it; plain checkpoint does the same). The template keeps a shallow copy of each such
object's attributes at the call; the recomputation runs with them put back and, once it has run,
the object gets the attributes it had before the recomputation (:meth:`Template.as_called`). Tensors
among them are version-checked like a namedtuple's: one changed in place since the call raises
torch's in-place error instead of being recomputed from. An object's slots are copied as its ``__dict__`` is;
of a module passed in (a rotary embedding shared by the blocks), its public attributes, its buffers being
version-checked; of a function (a lambda), what its closure's cells hold; classes and Python modules are
not copied.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from tba.runtime._views import inplace_error


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

    __slots__ = ("_structure", "_unsaved", "_objects")

    def __init__(self, structure: Any, unsaved: list[tuple[torch.Tensor, int]],
                 objects: list[tuple[Any, dict[str, Any]]] | None = None) -> None:
        self._structure = structure
        self._unsaved = unsaved
        """Tensors inside objects passed as they are, with their versions at the call."""
        self._objects = objects or []
        """Objects passed as they are, with a shallow copy of their attributes at the call (Note [An object
        passed to a recomputed layer is called as it was])."""

    @contextlib.contextmanager
    def as_called(self) -> Iterator[None]:
        """Run the recomputation with each object passed as it is holding the attributes it held at the call;
        afterwards they hold what they held before (Note [An object passed to a recomputed layer is called as it
        was])."""
        before = [(obj, _attributes(obj)) for obj, _ in self._objects]
        for obj, then in self._objects:
            _put_attributes(obj, then)
        try:
            yield
        finally:
            for obj, now in before:
                _put_attributes(obj, now)

    def call(self, saved: tuple[torch.Tensor, ...]) -> tuple[tuple, dict[str, Any]]:
        """``(args, kwargs)`` as they were, with ``saved`` in the tensors' places.

        Raises:
            RuntimeError: torch's in-place error, when a tensor inside an object passed as it is (a
                namedtuple's) was changed in place since the call, as torch raises without checkpoint.
        """
        for tensor, version in self._unsaved:
            if tensor._version != version:
                raise inplace_error(tensor._version, version, tensor.dtype, tuple(tensor.shape))
        return _rebuild(self._structure, saved, {})


def take_apart(args: tuple, kwargs: dict[str, Any]) -> tuple[Template, list[torch.Tensor]]:
    """The call's :class:`Template` and its tensors, each once, in the order :meth:`Template.call` expects them."""
    tensors: list[torch.Tensor] = []
    unsaved: list[tuple[torch.Tensor, int]] = []
    objects: list[tuple[Any, dict[str, Any]]] = []
    structure = _take_apart((args, kwargs), tensors, {}, {}, unsaved, objects)
    return Template(structure, unsaved, objects), tensors


def _take_apart(value: Any, tensors: list[torch.Tensor], slots: dict[int, _Slot], nodes: dict[int, Any],
                unsaved: list[tuple[torch.Tensor, int]], objects: list[tuple[Any, dict[str, Any]]]) -> Any:
    """``value``'s template; ``slots`` and ``nodes`` (by ``id``) give a tensor or container met twice one
    place, so that the rebuilt call has the same object twice too (``block(h, h, h)``: attention's
    ``query is key`` path)."""
    key = id(value)
    if isinstance(value, torch.Tensor):
        if key not in slots:
            tensors.append(value)
            slots[key] = _Slot(len(tensors) - 1)
        return slots[key]
    if key in nodes:
        return nodes[key]
    kind = type(value)
    if kind is tuple or kind is list:
        node = nodes[key] = _Sequence(kind, ())
        node.items = tuple(_take_apart(item, tensors, slots, nodes, unsaved, objects) for item in value)
        return node
    if kind is dict:
        node = nodes[key] = _Mapping(tuple(value), ())
        node.items = tuple(_take_apart(item, tensors, slots, nodes, unsaved, objects) for item in value.values())
        return node
    unsaved += [(leaf, leaf._version) for leaf in pytree.tree_leaves(value)
                if isinstance(leaf, torch.Tensor) and not leaf.is_inference()]
    nodes[key] = value
    attributes = _attributes(value)
    if attributes is not None:
        objects.append((value, attributes))
        unsaved += [(item, item._version) for item in attributes.values()
                    if isinstance(item, torch.Tensor) and not item.is_inference()]
    return value


def _attributes(value: Any) -> dict[str, Any] | None:
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
            for item in (_attributes(leaf) or {}).values() if isinstance(item, torch.Tensor) and not item.is_inference()]


def _put_attributes(obj: Any, attributes: dict[Any, Any]) -> None:
    now = _attributes(obj) or {}
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


def _rebuild(template: Any, saved: tuple[torch.Tensor, ...], built: dict[int, Any]) -> Any:
    kind = type(template)
    if kind is _Slot:
        return saved[template.index]
    if kind is not _Sequence and kind is not _Mapping:
        return template
    key = id(template)
    if key not in built:
        if kind is _Sequence:
            built[key] = template.kind(_rebuild(item, saved, built) for item in template.items)
        else:
            built[key] = dict(zip(template.keys, (_rebuild(item, saved, built) for item in template.items)))
    return built[key]


def updated_cache(args: tuple, kwargs: dict[str, Any]) -> Any | None:
    """A key/value cache among a layer's top-level arguments (or None): a Hugging Face ``transformers``
    ``Cache``, which a decoder layer appends its keys and values to.

    Note: [A layer given a key/value cache is not recomputed]
    Hugging Face decoders build a ``DynamicCache`` per forward while ``use_cache`` is on (GPT-2's default,
    in training too) and hand it to every block, whose attention appends to it. A recomputation
    appended a second time and attended over twice the keys: with an attention mask, backward failed
    with a shape error; without one the gradients came out right only because the causal mask happened
    to line up (found by a review). Hugging Face turns the cache off under its own gradient
    checkpointing for this reason. So a layer given one is profiled as not recomputable (the adaptive
    planner keeps or offloads it), and a plan that recomputes it raises :class:`tba.TbaError` naming
    the fix.
    """
    for value in (*args, *kwargs.values()):
        if any(cls.__name__ == "Cache" and cls.__module__.startswith("transformers") for cls in type(value).__mro__):
            return value
    return None
