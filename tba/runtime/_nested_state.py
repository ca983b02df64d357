"""The objects nested in a recomputed layer's public attributes: a bounded walk, their signatures, and putting them back.

Note: [The walk of nested state]
:func:`walk` finds, below each public attribute, the containers (list, dict, set, deque, bytearray,
``array.array``; a tuple is walked through, it cannot change) and plain objects (``vars()``, or the slots of a ``__slots__``
class) that tba does not copy: a plain object held directly, and everything below a public
container or plain object, level by level (``self.config.history``, ``self.deep["a"]["b"]``). Each
is recorded once, by identity (a cycle or an object reached twice, as a config every attention
holds, is not walked again), with its contents' signature and its items to put back (Note [Nested
state a recomputation is given back] in ``tba/runtime/_private_state.py``). The walk is bounded so
that a recomputed call stays cheap: an object more than
:data:`~tba.defaults.RECOMPUTE_NESTED_STATE_DEPTH` levels below the module, or reached once the walk
has taken :data:`~tba.defaults.RECOMPUTE_NESTED_STATE_ITEMS` items, is held *shallow*
(:class:`Shallow`): the objects it holds are kept by identity (a copy of the references, at C speed),
compared by identity (``d["n"] += 1`` makes a new int, seen) and put back as they were, but not
walked into. A metrics list in a config object that grows every step is so put back for each
recomputation however long it gets (with a limit that raised instead, training would have failed
after about a thousand steps); what changes inside an object below it (a counter in a dict in it) is
not seen: so a recomputed layer whose shallow object holds one whose changes a comparison by
identity cannot see (a container or plain object, a tensor or numpy array; a tuple of plain values
can) is refused at its forward (:func:`check_watchable`), and the profiled steps mark such a layer
not recomputable (:func:`unwatchable`, in ``tba/runtime/_timer.py``), so the adaptive default never
plans it so. An object that holds plain values only is held shallow wherever it is and takes nothing
of the budget (:func:`_only_plain`): a growing list of numbers pushed a counter beside it past the
bound. A review found a counter in a dict one level below a shallow one, and a tensor in a shallow
list updated in place, recomputed from the changed value, silently
(tests/runtime/test_recompute_past_bound.py).
"""

from __future__ import annotations

import collections
import itertools
import operator
from typing import Any

import numpy as np
import torch
from torch import nn

from tba import defaults
from tba.errors import TbaError
from tba.runtime._state_objects import (
    CONTAINERS,
    PLAIN,
    fields,
    items_of,
    kind_of,
    pairs,
    set_items,
    size_of,
)

Entry = tuple[str, Any, "int | bytes | None"]
Nested = tuple[str, Any, list[Entry], list]
"""(label, the object, its entries, its items to put back: a :class:`Shallow` list for one past the walk's bound, whose
only entry is its length, and whose items are compared instead)."""


class Shallow(list):
    """The items of an object past the walk's bound (Note [The walk of nested state]): compared by identity and put back,
    not walked into; ``blind``: the label of one whose changes that cannot see (:func:`check_watchable`), else None."""

    blind: str | None = None


class DeepLabel(str):
    """The label of a value nested in a public attribute (Note [State a recomputed layer changes that tba does not put
    back] in ``tba/runtime/_private_state.py``), as opposed to private state."""


def entry(label: str, value: Any) -> Entry:
    """(label, value, what tells an update in place): a tensor's version counter, a writeable numpy array's bytes (it
    has no version; Note [Private state of a recomputed layer]), else None."""
    if isinstance(value, torch.Tensor) and not value.is_inference():
        return label, value, value._version
    if isinstance(value, np.ndarray) and value.flags.writeable:
        return label, value, value.tobytes()
    return label, value, None


def contents(value: Any, label: str) -> list[Entry]:
    if isinstance(value, CONTAINERS):
        return [entry(f"{label}[{key!r}]", item) for key, item in pairs(value)]
    return [entry(f"{label}.{name}", item) for name, item in fields(value)]


def walk(found: dict[int, Nested], label: str, value: Any, budget: list[int]) -> None:
    """Record, in ``found``, the objects nested in the public attribute ``label`` (Note [The walk of nested state]);
    ``budget``: the items the walk may still take, shared by one signature's attributes."""
    if not kind_of(type(value)):
        return
    queue = collections.deque([(label, value, 1)])
    while queue:
        label, value, level = queue.popleft()
        if level > 1 or kind_of(type(value)) == 1:
            if id(value) in found:
                continue
            size, items = size_of(value), items_of(value)
            plain = _only_plain(value, items)
            if plain and isinstance(value, tuple):
                continue  # nothing in it can change
            if plain or level > defaults.RECOMPUTE_NESTED_STATE_DEPTH or size > budget[0]:
                shallow = Shallow(items)
                shallow.blind = None if plain else _blind(value, label, shallow)
                found[id(value)] = (label, value, [(label, size, None)], shallow)
                continue
            budget[0] -= size
            if not isinstance(value, tuple):
                found[id(value)] = (label, value, contents(value, label), items)
        for key, item in pairs(value):
            if kind_of(type(item)):
                inner = f"{label}.{key}" if isinstance(key, str) and not isinstance(value, CONTAINERS) else \
                    f"{label}[{key!r}]"
                queue.append((inner, item, level + 1))


def _unseen(item: Any) -> bool:
    """Whether a change of ``item`` (held by an object past the walk's bound) escapes a comparison by identity: a
    container or plain object (a change inside it), or a tensor or numpy array (updated in place); a tuple of plain
    values does not."""
    if isinstance(item, tuple):
        return any(not isinstance(inner, PLAIN) for inner in item)
    return bool(kind_of(type(item))) or isinstance(item, (torch.Tensor, np.ndarray))


def _only_plain(value: Any, items: list) -> bool:
    """Whether ``items`` (of ``value``, from :func:`items_of`) are plain values only, by type, at C speed: such an object
    is held shallow wherever it is (compared by identity, which sees every change of an immutable value) and takes
    nothing of the walk's budget, so a metrics list that grows every step does not push other state past the bound."""
    values = map(operator.itemgetter(1), items) if isinstance(value, dict) or not isinstance(value, CONTAINERS) else items
    return all(issubclass(kind, PLAIN) for kind in set(map(type, values)))


def _blind(value: Any, label: str, items: list) -> str | None:
    """The label of an item of ``value`` (past the walk's bound; ``items``: from :func:`items_of`) whose changes a
    comparison by identity cannot see, else None."""
    pairs = isinstance(value, dict) or not isinstance(value, CONTAINERS)
    for key, item in (items if pairs else enumerate(items)):
        if _unseen(item):
            return f"{label}.{key}" if isinstance(key, str) and not isinstance(value, CONTAINERS) else f"{label}[{key!r}]"
    return None


def unwatchable(found: dict[int, Nested]) -> str | None:
    """The label of what an object past the walk's bound holds whose changes tba cannot see, else None (Note [The walk
    of nested state]); the profiled steps mark such a layer not recomputable."""
    return next((items.blind for _, _, _, items in found.values() if isinstance(items, Shallow) and items.blind), None)


def check_watchable(layer: nn.Module, found: dict[int, Nested]) -> None:
    """Raise :class:`TbaError` when an object past the walk's bound holds one whose changes tba cannot see (Note [The
    walk of nested state]): a recomputation would start silently from what the forward changed there."""
    blind = unwatchable(found)
    if blind is not None:
        raise TbaError(
            f"a recomputed layer ({type(layer).__name__}) holds {blind} past the bound of the state tba watches for a "
            f"recomputation (more than tba.defaults.RECOMPUTE_NESTED_STATE_DEPTH = {defaults.RECOMPUTE_NESTED_STATE_DEPTH}"
            f" levels deep, or after tba.defaults.RECOMPUTE_NESTED_STATE_ITEMS = {defaults.RECOMPUTE_NESTED_STATE_ITEMS} "
            "items): a change inside it, or a tensor or numpy array updated in place, would be recomputed from the "
            "changed value. Raise those limits, hold less state in the layer, or keep or offload this layer")


def entries_change(before: list[Entry], after: list[Entry]) -> str | None:
    if len(before) != len(after):
        return None if not before and not after else (after or before)[0][0]
    return first_differing(before, after)


def first_differing(before: list[Entry], after: list[Entry]) -> str | None:
    """Of two entry lists of one length: the label of the first entry that differs, else None."""
    for (label, value, version), (label_after, value_after, version_after) in zip(before, after):
        if label != label_after:
            return label_after
        if version != version_after or not same(value, value_after):
            return label
    return None


def same(a: Any, b: Any) -> bool:
    """Whether a private value is unchanged: the same object, an equal plain value, or a tuple of the same
    type and length (a ``torch.Size`` rebuilt each call; its items are compared as entries of their own)."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, tuple):
        return len(a) == len(b)
    return isinstance(a, PLAIN) and a == b


def changed(then: Nested, now: Nested | None = None) -> bool:
    """Whether the object of ``then`` (its signature at one time) holds something else in ``now`` (a later signature of
    it; None: at present)."""
    label, value, entries, items = then
    if isinstance(items, Shallow):
        present = now[3] if now is not None else items_of(value)
        return not _same_items(value, items, present)
    return entries_change(entries, now[2] if now is not None else contents(value, label)) is not None


def _same_items(value: Any, before: list, after: list) -> bool:
    """Whether two :func:`items_of` lists of ``value`` hold the same objects (a dict's or a plain object's pairs by their
    key and value), compared at C speed."""
    if len(before) != len(after):
        return False
    if isinstance(value, dict) or not isinstance(value, CONTAINERS):  # (key, item) pairs
        before, after = list(itertools.chain.from_iterable(before)), list(itertools.chain.from_iterable(after))
    # An equal plain value made anew (``stats.rows[0] = x.shape[1]``, a large int) is no change, as for a walked object
    # (:func:`same`): else the profiled steps marked its layer not recomputable.
    # A tuple only by identity: its items were not walked (:func:`same` compares a tuple's length only).
    return all(map(operator.is_, before, after)) or all(map(_same_plain, before, after))


def _same_plain(a: Any, b: Any) -> bool:
    return a is b or (type(a) is type(b) and isinstance(a, PLAIN) and a == b)


def check_restorable(layer: nn.Module, before: dict[int, Nested], after: dict[int, Nested] | None = None) -> list[Nested]:
    """Raise :class:`TbaError` when an object of ``before`` changed (in the forward, as ``after`` shows; or since, when
    ``after`` is None) in a way :func:`put_back_nested` cannot put back: a tensor or array in it updated in place;
    return the signatures (of ``before``) of those that changed."""
    changes, name = [], type(layer).__name__
    for key, then in before.items():
        now = after.get(key) if after is not None else None  # not in ``after``: compared with its present contents
        if not changed(then, now):
            continue
        changes.append(then)
        label, value, entries, items = then
        if isinstance(items, Shallow):
            continue
        now_entries = now[2] if now is not None else contents(value, label)
        versions = {id(item): version for _, item, version in entries if version is not None}
        moved = next((label for label, item, version in now_entries
                      if version is not None and versions.get(id(item), version) != version), None)
        if moved is not None and after is not None:
            raise TbaError(
                f"the forward of a recomputed layer ({name}) updated in place a tensor tba does not copy ({moved}: in "
                "a container inside a public container, or in a plain object; tba copies public attributes one level "
                "deep), so its recomputation in backward would start from the changed tensor (or numpy array). Hold "
                "it one level deep (a buffer, or a tensor in a public attribute), or keep or offload this layer")
        if moved is not None:
            raise TbaError(
                f"state of a recomputed layer ({name}) nested too deep for tba to copy was updated in place ({moved}) "
                "between its forward and backward (tba copies public attributes one level deep: a tensor in a "
                "container inside a container, or in a plain object, is not), and the recomputation would compute "
                "another forward. Change it after backward, hold it one level deep (a buffer, or a tensor in a public "
                "attribute), or keep or offload this layer")
    return changes


def put_back_nested(layer: nn.Module, before: Any) -> Any:
    """Before a recomputation: put the contents of each object nested in a public attribute that changed since the
    first call began (``before``: their signatures then) back as they were, and return what restores the present
    contents (Note [Nested state a recomputation is given back]); raise :class:`TbaError` where that cannot be done."""
    present = [(value, items_of(value), then) for _, value, _, then in check_restorable(layer, getattr(before, "deep", {}))]
    for value, _, then in present:
        set_items(value, then)

    def restore() -> None:
        for value, items, _ in present:
            set_items(value, items)

    return restore


