"""What a recomputed layer's generator search read, kept to prove at its next call that the search would find the same.

Note: [A generator search is reused while what it read holds]
The search of a recomputed layer's generators (Note [Generators of a recomputed layer] in ``tba/runtime/_generators.py``)
ran in full at every call, first call and recomputation: a Hugging Face block's modules, hook dicts, config and the
helpers its code names, about 400 values, 0.7 ms a call for a tiny Llama or GPT-2 block (helper-131), some 45 ms of
host time a step for 32 recomputed blocks. Its result is a function of what it read, so each read of a layer's own
search goes through :class:`Reads`: an attribute as stored (a ``__dict__``, a ``__code__``, a class's ``__mro__``), a key
of a dict or a class's namespace (a global a forward names), the items of a container, or what a small function of one
value returns (a closure's contents, a plain object's fields, the names a code object reads, whether a function is a
library's); each of a value an earlier read gave, the layer itself first. The next search replays them, generation by
generation in batches at C speed, from the layer, and reuses what the search found when every read gives what it gave:
a value the search never looks into or tells apart (a plain value, a tensor, tba's wrapper of the layer's forward made
anew at every step, a logger) a value of the same type; any other the object with the same ``id`` (the replay holds each
while it runs); a value compared by ``==`` (a bool, names) an equal one. Given the same answers the search would make
the same reads in the same order and find the generators at the same places, which the replay takes from what it read.
A global, a field or a closure rebound, an attribute set, a dict or a list changed, a class patched, a ``__class__`` or
``__dict__`` replaced: a read differs and the search runs in full, so a generator bound between calls is found, and one
bound between the first call and the recomputation is refused as before (Note [A generator bound after the first call
is refused] in ``tba/runtime/_generators.py``). The call's arguments are searched at every call. The tapes hold no
value read (ids, types and names only), so a layer kept a model, a config, a sibling alive through none; they live as
long as the layer (:func:`kept_searches`), one for its first calls (inside the context, whose hook and wrapper the layer
holds) and one for its recomputations. A search recorded costs about four in full: one whose tape did not hold is
recorded at the first, second, fourth... search in full in a row (:meth:`KeptSearch.records`), so a layer that sets a
new object at every call pays for few. Measured on a loaded machine (tiny Llama block, alternating, 500 calls each):
690 us a call in full, 245 us replayed, of which 45 us take Python's and numpy's global generators' states.
"""

from __future__ import annotations

import collections
import functools
import itertools
import operator
import types
from collections.abc import Callable
from typing import Any

from torch import nn

from tba._weak import WeakRegistry
from tba.runtime._code_named import GENERATOR_TYPES, MISSING
from tba.runtime._layer_state import held_items
from tba.runtime._plain_containers import LEAVES, only_leaves
from tba.runtime._state_objects import kind_of

KEPT_TYPES_MAX_ITEMS = 64
"""A container of plain values with at most this many items is read again as its items' types, a bigger one (or one of
containers of plain values) as ``only_leaves`` in ``tba/runtime/_plain_containers.py`` asks."""

_ATTR, _GET, _DICT, _SEQUENCE, _CALL, _EMPTY, _EQUAL = range(7)
"""The kinds of read, in the order a generation's are replayed; the first five give values, the last two compare."""

_SIZED = (dict, collections.OrderedDict, list, tuple)
"""The containers an empty one of which is read again by its size only (no subclass: its ``__len__`` is its own)."""

_values_of = operator.methodcaller("values")


def _getter(kind: type) -> Callable[..., Any]:
    """The ``get`` of a mapping of type ``kind``, unbound."""
    return kind.get


_LOOKED_INTO = (*GENERATOR_TYPES, types.ModuleType, type, nn.Module, types.FunctionType, types.MethodType, functools.partial,
                functools.partialmethod, staticmethod, classmethod, property, dict, list, tuple, types.CodeType)
"""What the search looks into or at (Note [A generator search is reused while what it read holds]). A code object
too: its names are read once per code object, and functions of one factory share it; compared by type, one of them
given new code in place (``f.__code__ = ...``, as a reloader does) replayed the other's names (helper-132)."""


@functools.lru_cache(maxsize=1024)
def _by_type(kind: type) -> bool:
    """Whether a value of ``kind`` read again is compared by its type only: a leaf, a class's namespace (a new
    ``mappingproxy`` at every read of the same dict), or a value of a type the search neither looks into nor tells
    by identity (tba's wrapper set as a recomputed layer's ``forward``, made anew at every step; a logger)."""
    if kind is types.MappingProxyType or (issubclass(kind, LEAVES) and not issubclass(kind, GENERATOR_TYPES)):
        return True
    return kind is not object and kind_of(kind) == 0 and not issubclass(kind, _LOOKED_INTO)  # a sentinel by identity


class Reads:
    """The reads of one search of a layer, each of a value an earlier one gave (the layer itself first), kept as a tape
    of generations to replay without holding any of them (Note [A generator search is reused while what it read
    holds])."""

    def __init__(self, layer: nn.Module) -> None:
        self._values: list[Any] = [layer]  # by slot, while recording only
        self._slot: dict[int, int] = {id(layer): 0}
        self._generation: list[int] = [0]  # by slot
        self._reads: list[tuple[int, int, Any, Any, int]] = []  # (generation, kind, subject slot, argument, first slot)
        self._usable = True
        self._done: dict[tuple[int, int, Any], int] = {}  # each read kept, with its first slot
        self._tape: list[list[Any]] = []

    def attr(self, holder: Any, name: str) -> Any:
        """``holder``'s attribute ``name`` as stored (``object.__getattribute__``: no ``__getattr__``)."""
        return self._read(_ATTR, holder, name, [object.__getattribute__(holder, name)])[0]

    def get(self, mapping: Any, key: Any) -> Any:
        """``mapping.get(key)`` (a dict or a class's namespace), :data:`MISSING` if not there."""
        return self._read(_GET, mapping, key, [mapping.get(key, MISSING)])[0]

    def items(self, container: dict | list | tuple) -> list[Any]:
        """A dict's values, a list's or tuple's items."""
        values = list(container.values() if isinstance(container, dict) else container)
        if not values and type(container) in _SIZED:  # a module's hook dicts: read again by their size only
            self._read(_EMPTY, container, None, None)
            return values
        return self._read(_DICT if isinstance(container, dict) else _SEQUENCE, container, None, values)

    def skipped(self, container: dict | list | tuple, items: Any, levels: int) -> None:
        """A container the search skipped, of plain values ``levels`` deep (Note [The generator search skips
        containers of plain values] in ``tba/runtime/_plain_containers.py``)."""
        if len(items) <= KEPT_TYPES_MAX_ITEMS and all(issubclass(kind, LEAVES) for kind in map(type, items)):
            self.items(container)
        else:
            self.equal(functools.partial(_holds_leaves_only, levels=levels), container)

    def values(self, function: Callable[[Any], Any], subject: Any) -> list[Any]:
        """What ``function(subject)`` returns, a list of values read as the other reads' are."""
        return self._read(_CALL, subject, function, list(function(subject)))

    def equal(self, function: Callable[[Any], Any], subject: Any) -> Any:
        """What ``function(subject)`` returns, compared by ``==`` (a bool, a name, names)."""
        value = function(subject)
        self._read(_EQUAL, subject, (function, value), None)
        return value

    def _read(self, kind: int, subject: Any, argument: Any, values: list[Any] | None) -> Any:
        slot = self._slot.get(id(subject))
        if slot is None:  # not a value an earlier read gave: this search is not kept
            self._usable = False
            return values
        read = (kind, slot, argument[0] if kind == _EQUAL else argument)
        done = self._done.get(read)
        if done is not None:  # the search reads a class's namespace, a function's code many times: what it gave then
            return values if values is None else self._values[done:done + len(values)]
        self._done[read] = len(self._values)
        generation = self._generation[slot] + 1
        self._reads.append((generation, kind, slot, argument, len(self._values)))
        for value in values or ():
            self._slot.setdefault(id(value), len(self._values))
            self._values.append(value)
            self._generation.append(generation)
        return values

    def finish(self, generators: list[Any], seen: dict[int, int]) -> bool:
        """Make the tape from the reads, with the slots of ``generators`` and of the objects ``seen`` searched; drop the
        values read. False if the search read a value it was not given by an earlier read."""
        found = [self._slot.get(id(generator)) for generator in generators]
        searched = [(self._slot.get(identity), depth) for identity, depth in seen.items()]
        if not self._usable or None in found or any(slot is None for slot, _ in searched):
            return False
        order = sorted(range(len(self._reads)), key=lambda index: self._reads[index][:2])
        replayed: dict[int, int] = {0: 0}  # a recorded slot's slot in the replay
        ends = [*(read[4] for read in self._reads[1:]), len(self._values)]  # each read's values end where the next begin
        for _, reads in itertools.groupby(order, key=lambda index: self._reads[index][0]):
            batches: dict[int, list[tuple[int, Any, int, int]]] = {}
            for index in reads:
                _, kind, slot, argument, first = self._reads[index]
                if kind == _GET:  # with its mapping's get, unbound: the mapping's type is compared first
                    argument = (_getter(type(self._values[slot])), argument)
                batches.setdefault(kind, []).append((replayed[slot], argument, first, ends[index]))
            values: list[Any] = []
            step = []
            for kind, batch in sorted(batches.items()):
                sizes = [end - first for _, _, first, end in batch]
                for _, _, first, end in batch:
                    for recorded in range(first, end):
                        replayed[recorded] = len(replayed)
                    values += self._values[first:end]
                step.append((kind, _picker([slot for slot, _, _, _ in batch]), [argument for _, argument, _, _ in batch],
                             sizes))
            kinds = list(map(type, values))
            compared = [not _by_type(kind) for kind in kinds]
            self._tape.append([step, kinds, compared,
                               list(map(id, itertools.compress(values, compared)))])
        self.generators = [replayed[slot] for slot in found]
        self.searched = [(replayed[slot], depth) for slot, depth in searched]
        del self._values, self._slot, self._generation, self._reads, self._done
        return True

    def replay(self, layer: nn.Module) -> tuple[list[Any], dict[int, int]] | None:
        """The generators and the objects searched and how deep (with ``seen``'s ids), if every read of ``layer`` gives
        what it gave (Note [A generator search is reused while what it read holds]); else None."""
        slots: list[Any] = [layer]
        try:
            for step, kinds, compared, ids in self._tape:
                values = []
                for kind, pick, arguments, sizes in step:
                    subjects = pick(slots)
                    if kind == _ATTR:
                        values += map(object.__getattribute__, subjects, arguments)
                    elif kind == _GET:
                        getters, keys = zip(*arguments)
                        values += map(operator.call, getters, subjects, keys, itertools.repeat(MISSING))
                    elif kind == _EMPTY:
                        if any(map(len, subjects)):
                            return None
                    elif kind == _EQUAL:
                        if [function(subject) for (function, _), subject in zip(arguments, subjects)] != \
                                [value for _, value in arguments]:
                            return None
                    else:
                        got = list(map(_values_of, subjects) if kind == _DICT else map(list, subjects) if kind == _SEQUENCE
                                   else map(operator.call, arguments, subjects))
                        if list(map(len, got)) != sizes:
                            return None
                        values += itertools.chain.from_iterable(got)
                if list(map(type, values)) != kinds or \
                        list(map(id, itertools.compress(values, compared))) != ids:
                    return None
                slots += values
        except Exception:  # a read that fails now (an attribute deleted): searched in full, which says what it finds
            return None
        return [slots[slot] for slot in self.generators], {id(slots[slot]): depth for slot, depth in self.searched}


def _holds_leaves_only(container: Any, levels: int) -> bool:
    return only_leaves(held_items(container), levels)


def _picker(slots: list[int]) -> Callable[[list[Any]], Any]:
    """A function giving the values at ``slots``, a tuple, at C speed."""
    if len(slots) == 1:
        only = slots[0]
        return lambda values: (values[only],)
    return operator.itemgetter(*slots)


class Unrecorded:
    """The reads of a search not kept (the modules outside a layer, searched once)."""

    @staticmethod
    def attr(holder: Any, name: str) -> Any:
        return object.__getattribute__(holder, name)

    @staticmethod
    def get(mapping: Any, key: Any) -> Any:
        return mapping.get(key, MISSING)

    @staticmethod
    def items(container: dict | list | tuple) -> Any:
        return container.values() if isinstance(container, dict) else container

    @staticmethod
    def skipped(container: dict | list | tuple, items: Any, levels: int) -> None:
        return None

    @staticmethod
    def values(function: Callable[..., Any], *args: Any) -> Any:
        return function(*args)

    @staticmethod
    def equal(function: Callable[..., Any], *args: Any) -> Any:
        return function(*args)


UNRECORDED = Unrecorded()


class KeptSearch:
    """A recomputed layer's last search, kept while the layer lives, holding none of what it read (Note [A generator
    search is reused while what it read holds])."""

    def __init__(self) -> None:
        self.tape: Reads | None = None
        self.reused = 0
        """How many searches were answered from the tape, for tests."""
        self.misses = 0
        """Searches in full since the tape last held: one is recorded when their number is a power of two, so a layer
        that sets a new object at every call pays for recording (about 4 full searches) at a few of them."""

    def reuse(self, layer: nn.Module) -> tuple[list[Any], dict[int, int]] | None:
        """What the tape found, if every read it made gives what it gave."""
        tape = self.tape
        found = tape.replay(layer) if tape is not None else None
        if found is None:
            self.misses += 1
        else:
            self.reused += 1
            self.misses = 0
        return found

    def records(self) -> bool:
        """Whether the search in full about to run is recorded."""
        return self.misses & (self.misses - 1) == 0

    def keep(self, tape: Reads, generators: list[Any], seen: dict[int, int]) -> None:
        self.tape = tape if tape.finish(generators, seen) else None


_kept = WeakRegistry()


def kept_searches(layer: nn.Module) -> tuple[KeptSearch, KeptSearch]:
    """The :class:`KeptSearch` of ``layer``'s first calls and that of its recomputations, while it lives (Note [A
    registry that threads and the collector can share] in ``tba/_weak.py``): a first call runs inside the context, whose
    hooks and wrapper the layer holds, a recomputation in backward, mostly after the context has taken them off."""
    return _kept.value_for(layer, lambda: (KeptSearch(), KeptSearch()))
