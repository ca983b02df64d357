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

A numpy array (of any shape, 0-d ones too, in a list, tuple or dict of the call or at its top level)
is no container and has no version counter to check, and a caller may change it in place after the
call (``scale *= 0.5``, a per-step schedule advanced before ``backward()``): the recomputation read
the changed array, and gradients differed from training without tba, silently (helper-93 found it).
So an array is copied when the call is taken apart, as a module's own arrays are (Note [Side effects
of a recomputed forward] in ``tba/runtime/_layer_state.py``), and each recomputation gets a copy of
that copy (a forward that writes into its array would otherwise have changed what a second backward
recomputes from); the first call gets the caller's array. An array met twice is copied once and is
one array twice in the rebuilt call. Read-only arrays are copied too: ``np.broadcast_to`` gives a
read-only view that changes with its base. An array of Python objects is copied one level deep, as
lists are. Numpy scalars (``np.float32(0.5)``) are immutable and pass as they are. The cost: each
array's bytes once per call of a recomputed layer, held until backward (an array handed to every
block is held once per block), and once more per recomputation; no cheaper test is exact (numpy
keeps no version counter, and comparing bytes reads as much as copying them).

What an object passed as it is holds is copied at the call and put back for the recomputation by
``tba/runtime/_call_objects.py`` (Note [An object passed to a recomputed layer is called as it was]).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils import _pytree as pytree

from tba.errors import TbaError
from tba.runtime._call_objects import CONTAINERS, attributes_of, copied_arrays, put_attributes, put_contents
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


class _Array:
    """A numpy array of the call: a copy of it at the call, copied again for each recomputation."""

    __slots__ = ("value",)

    def __init__(self, value: np.ndarray) -> None:
        self.value = value


class Template:
    """A call's ``(args, kwargs)`` without its tensors (Note [A recomputation gets the call as it was]):
    :func:`take_apart` makes one, :meth:`call` rebuilds the call around the tensors checkpoint hands back."""

    __slots__ = ("_structure", "_unsaved", "_objects", "_contents")

    def __init__(self, structure: Any, unsaved: list[tuple[torch.Tensor, int]],
                 objects: list[tuple[Any, dict[str, Any]]] | None = None) -> None:
        self._structure = structure
        self._unsaved = unsaved
        """Tensors inside objects passed as they are, with their versions at the call."""
        self._objects = objects or []
        """Objects passed as they are, with a shallow copy of their attributes at the call (Note [An object
        passed to a recomputed layer is called as it was])."""
        self._contents = [(item, copy.copy(item)) for _, attributes in self._objects for item in attributes.values()
                          if type(item) in CONTAINERS]
        """The lists, dicts, sets and deques those attributes hold, with a copy of their contents at the call."""

    @contextlib.contextmanager
    def as_called(self) -> Iterator[None]:
        """Run the recomputation with each object passed as it is holding the attributes it held at the call;
        afterwards they hold what they held before (Note [An object passed to a recomputed layer is called as it
        was])."""
        before = [(obj, attributes_of(obj)) for obj, _ in self._objects]
        held = [(container, copy.copy(container)) for container, _ in self._contents]
        for obj, then in self._objects:
            put_attributes(obj, copied_arrays(then))
        for container, then in self._contents:
            put_contents(container, then)
        try:
            yield
        finally:
            for obj, now in before:
                put_attributes(obj, now)
            for container, now in held:
                put_contents(container, now)

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
    if isinstance(value, np.ndarray):  # no version counter to check: copied (Note [A recomputation gets the call as it was])
        nodes[key] = _Array(value.copy(order="K"))
        return nodes[key]
    unsaved += [(leaf, leaf._version) for leaf in pytree.tree_leaves(value)
                if isinstance(leaf, torch.Tensor) and not leaf.is_inference()]
    nodes[key] = value
    attributes = attributes_of(value)
    if attributes is not None:
        objects.append((value, copied_arrays(attributes)))
        unsaved += [(item, item._version) for item in attributes.values()
                    if isinstance(item, torch.Tensor) and not item.is_inference()]
    return value


def _rebuild(template: Any, saved: tuple[torch.Tensor, ...], built: dict[int, Any]) -> Any:
    kind = type(template)
    if kind is _Slot:
        return saved[template.index]
    if kind is not _Sequence and kind is not _Mapping and kind is not _Array:
        return template
    key = id(template)
    if key not in built:
        if kind is _Array:
            built[key] = template.value.copy(order="K")
        elif kind is _Sequence:
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
    the fix. Not with grad disabled or in inference mode (``generate()``), where nothing is recomputed:
    a plan's offloader entered around ``generate()`` refused its cache for nothing.
    """
    for value in (*args, *kwargs.values()):
        if any(cls.__name__ == "Cache" and cls.__module__.startswith("transformers") for cls in type(value).__mro__):
            return value
    return None


def call_tensor_versions(args: tuple, kwargs: dict, held: Any = lambda args, kwargs: ()
                         ) -> list[tuple[int | Any, torch.Tensor, int]]:
    """(position among the tensor arguments, tensor, version) of every tensor in a call's arguments, nested and
    keyword ones too; none when no recomputation can follow (grad disabled, or inference mode, whose tensors
    have no version). What Note [A recomputed layer must not change its input] in ``tba/runtime/_recompute_inputs.py``
    compares around a layer's forward. ``held(args, kwargs)``: more tensors to watch, after those, each as ``(what
    holds it, tensor)``, which takes the position's place (the attributes of objects passed as they are,
    ``tba/runtime/_call_objects.py``)."""
    if not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
        return []
    tensors = [*enumerate(t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)),
               *held(args, kwargs)]
    return [(where, tensor, tensor._version) for where, tensor in tensors if not tensor.is_inference()]


def refuse_cache(layer: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
    """Raise :class:`TbaError` when a key/value cache is among the recomputed layer's arguments (Note [A layer
    given a key/value cache is not recomputed] above)."""
    if not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
        return  # nothing is recomputed then: generate() under a plan that recomputes the blocks
    cache = updated_cache(args, kwargs)
    if cache is not None:
        raise TbaError(f"a recomputed layer ({type(layer).__name__}) is given a key/value cache ({type(cache).__name__}), "
                       "which its recomputation would update a second time; train with use_cache=False (model(..., "
                       "use_cache=False) or model.config.use_cache = False), or keep or offload this layer")
