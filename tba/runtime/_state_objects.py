"""What a recomputed layer's nested state is made of: plain values, containers and plain objects, their fields and
items, read and written back (the walk and its signatures: ``tba/runtime/_nested_state.py``)."""

from __future__ import annotations

import array
import collections
import functools
import logging
import random
from typing import Any

import numpy as np
import torch
from torch import nn

PLAIN = (int, float, complex, bool, str, bytes, type(None))
CONTAINERS = (list, tuple, dict, set, collections.deque, bytearray, array.array)
"""What the walk takes items of; a ``bytearray`` and an ``array.array`` hold plain values a forward may update in place
(Note [A container refilled in place])."""


@functools.cache
def slots(cls: type) -> tuple[str, ...]:
    """The attribute names of the ``__slots__`` of ``cls`` and its bases (mangled as Python stores them)."""
    names = []
    for base in cls.__mro__:
        declared = vars(base).get("__slots__", ())
        for name in (declared,) if isinstance(declared, str) else declared:
            if name in ("__dict__", "__weakref__"):
                continue
            names.append(f"_{base.__name__.lstrip('_')}{name}" if name.startswith("__") else name)
    return tuple(names)


UNSET = object()


def stored(value: Any, name: str) -> Any:
    """The attribute ``name`` as ``value`` stores it (its ``__dict__``, a slot), else :data:`UNSET`.

    Note: [An object's fields are read without its __getattr__]
    ``getattr``, ``hasattr`` and ``vars`` call a class's ``__getattr__`` for a name not stored: a proxy whose
    ``__getattr__`` looks names up elsewhere (``self._data[name]``) raised ``KeyError('__dict__')`` out of the layer's
    forward for a slotted object, and one that answers every name (``self._data.get(name)``) made ``vars`` raise
    ``TypeError``. Since the generator search looks into a passed function's closure (Note [Generators of a recomputed
    layer] in ``tba/runtime/_generators.py``), a lambda closing over such an object failed every recomputed call that
    trained without tba. ``object.__getattribute__`` reads what the object stores, and no more.
    """
    try:
        return object.__getattribute__(value, name)
    except AttributeError:
        return UNSET


def fields(value: Any) -> list[tuple[str, Any]]:
    """A plain object's attributes: its ``vars()`` and its slots that are set (Note [An object's fields are read
    without its __getattr__])."""
    held = stored(value, "__dict__")
    found = list(held.items()) if isinstance(held, dict) else []
    for name in slots(type(value)):
        item = stored(value, name)
        if item is not UNSET:
            found.append((name, item))
    return found


def plain_object(value: Any) -> bool:
    """Whether ``value`` is an object whose attributes a forward may update and tba neither copies nor checks."""
    return kind_of(type(value)) == 1


NOT_STATE = (logging.Filterer, logging.Manager, logging.PlaceHolder)
"""Objects a layer may hold that are not its state: a logger (``self.logger = logging.getLogger(...)``), its handlers,
and through them every logger of the process, which the walk took items of until it reached its bound."""


@functools.lru_cache(maxsize=4096)
def kind_of(cls: type) -> int:
    """1 for a plain object's type (:func:`plain_object`), 2 for a container's, else 0; by type, as the walk asks it of
    every value it meets (an ``isinstance`` of a Hugging Face config runs its ``__getattribute__``)."""
    if issubclass(cls, CONTAINERS):
        return 2
    if issubclass(cls, (torch.Tensor, np.ndarray, nn.Module, torch.Generator, random.Random, np.random.Generator,
                        np.random.RandomState, type, *NOT_STATE, *PLAIN)) or \
            any("__call__" in vars(base) for base in cls.__mro__):
        return 0
    return 1 if cls.__dictoffset__ or slots(cls) else 0


def pairs(value: Any) -> Any:
    """(key, item) of what ``value`` holds: a dict's items, a plain object's fields, else (index, item)."""
    if isinstance(value, dict):
        return value.items()
    return enumerate(value) if isinstance(value, CONTAINERS) else fields(value)


def size_of(value: Any) -> int:
    return len(value) if isinstance(value, CONTAINERS) else len(fields(value))


def items_of(value: Any) -> list:
    """What ``value`` holds, to put back with :func:`set_items`: (key, item) pairs of a dict or a plain object's
    fields, else the items."""
    if isinstance(value, dict):
        return list(value.items())
    return list(value) if isinstance(value, CONTAINERS) else fields(value)


def set_items(value: Any, items: list) -> None:
    """Make ``value`` hold ``items`` (from :func:`items_of`), in place; a plain object's straight into its ``__dict__``
    and slots (no ``__setattr__``: frozen dataclasses too)."""
    if isinstance(value, CONTAINERS):
        refill(value, items)
    else:
        declared = set(slots(type(value)))
        target = stored(value, "__dict__")
        if isinstance(target, dict):
            target.clear()
            target.update((name, item) for name, item in items if name not in declared)
        held = dict(items)
        for name in declared:
            if name in held:
                object.__setattr__(value, name, held[name])
            elif stored(value, name) is not UNSET:
                object.__delattr__(value, name)


def refill(container: Any, items: Any) -> None:
    """Make ``container`` (a list, dict, set, deque, bytearray or ``array.array``) hold ``items``, in place: (key, item)
    pairs for a dict, else the items.

    Note: [A container refilled in place]
    A recomputation puts back what a forward's state held when the first call began, in the same objects (the program's
    own, which it may hold elsewhere too). ``Counter.update`` adds counts, and counts each (key, count) pair as one
    element: a count a forward kept in a ``collections.Counter`` came back as ``Counter({('calls', 1): 1})``, so the
    recomputation read 0 calls and computed another forward (gradients differed silently), and the Counter the program
    kept was left so. It is refilled as a dict. A ``bytearray`` or ``array.array`` that a forward updated in place (a
    count, a flag) was not seen at all, neither copied nor walked, and was recomputed from its changed value; both are
    containers now, refilled through a slice (an ``array.array`` has no ``clear`` and takes only an array there).
    """
    if isinstance(container, dict):
        container.clear()
        (dict.update if isinstance(container, collections.Counter) else type(container).update)(container, items)
    elif isinstance(container, array.array):
        container[:] = array.array(container.typecode, items)
    elif isinstance(container, (list, bytearray)):
        container[:] = items
    else:
        container.clear()
        container.update(items) if isinstance(container, set) else container.extend(items)
