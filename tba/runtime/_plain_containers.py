"""Containers of plain values, which the generator search of a recomputed layer skips after a pass over their types
(Note [The generator search skips containers of plain values]); the search is ``tba/runtime/_generators.py``'s."""

from __future__ import annotations

import functools
import itertools
import operator
from typing import Any

import numpy as np
import torch

from tba.runtime._layer_state import held_items
from tba.runtime._state_objects import PLAIN, fields, kind_of, slots

LEAVES = (*PLAIN, torch.Tensor, np.ndarray)
"""What the generator search never looks into: plain values, tensors and numpy arrays."""


def only_leaves(items: Any, levels: int) -> bool:
    """Whether ``items`` (a container's) are :data:`LEAVES` only, or containers of them (``levels`` deep), by
    type, at C speed.

    Note: [The generator search skips containers of plain values]
    The search runs at every call of a recomputed layer, and each item it meets costs a Python call with a few
    ``isinstance`` (about 0.7 us). Since it looks into plain objects (a config the blocks share), a metrics list such an
    object holds and grows every step (``config.history``, Note [The walk of nested state] in
    ``tba/runtime/_nested_state.py``), or a vocabulary dict, was walked item by item at every call: 100,000 floats in
    a config shared by 8 recomputed blocks made a step 665 ms where it took 85 ms before, and growing with the list.
    A container whose items are of the types the search never looks into is skipped after one pass over their types
    (as the nested-state walk tells plain values, ``_only_plain`` there), and so is one of containers or plain objects
    of them, a level of items at a time (a history of ``(step, loss)`` pairs, a vocabulary of lists, rows as dicts or
    dataclasses: since the search takes what a layer's code names, a module-level table of 100,000 lists made each
    call 126 ms, of 100,000 dataclass rows 360 ms, helper-121); one holding anything else is walked as before.
    """
    for _ in range(levels):
        every = set(map(type, items))
        kinds = {kind for kind in every if not issubclass(kind, LEAVES)}
        if not kinds:
            return True
        if not all(issubclass(kind, (dict, list, tuple)) or fields_in_dict(kind) for kind in kinds):
            return False
        if kinds != every:  # the next level's items, without the leaves
            items = [item for item in items if type(item) in kinds]
        if all(issubclass(kind, dict) for kind in kinds):
            items = list(itertools.chain.from_iterable(map(dict.values, items)))
        elif all(issubclass(kind, (list, tuple)) for kind in kinds):
            items = list(itertools.chain.from_iterable(items))
        elif all(map(fields_in_dict, kinds)):  # dataclass rows
            items = list(itertools.chain.from_iterable(map(dict.values, map(_DICT, items))))
        else:
            items = [item for held in items for item in (held_items(held) if isinstance(held, (dict, list, tuple))
                                                         else dict(fields(held)).values())]
    return False


_DICT = operator.attrgetter("__dict__")


@functools.lru_cache(maxsize=1024)
def fields_in_dict(kind: type) -> bool:
    """Whether a plain object of ``kind`` holds its fields in its ``__dict__`` only, read as is (no slots, no
    ``__getattribute__`` of its own: Note [An object's fields are read without its __getattr__])."""
    return kind_of(kind) == 1 and not slots(kind) and kind.__getattribute__ is object.__getattribute__
