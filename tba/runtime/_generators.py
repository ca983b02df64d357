"""The random generators a recomputed layer draws from, their states taken and put back.

Note: [Generators of a recomputed layer]
Checkpoint preserves torch's global RNG states only. A layer that draws from a generator of its
own (a ``torch.Generator``, ``random.Random``, numpy ``Generator`` or ``RandomState``, held as an
attribute of one of its modules or passed in its call's arguments, as diffusers-style code passes
``generator=``, directly or in dicts, lists, tuples and plain objects' attributes up to three deep), or from Python's
``random`` or numpy's global generator (stochastic depth written with ``random.random()``), would
draw differently in the recomputation, so its gradients would be those of another forward (a
review found the adaptive default recomputing such layers: ``SSSK``), and the generator would end
advanced twice. The wrapper records each such generator's state before the first forward, sets it
back before the recomputation and, afterwards, restores the state the recomputation started from.
Every generator found is replayed, whether or not the first forward left it moved: one that drew
and then put its own state back (a fixed noise per step) still drew, and a later layer may move it
before backward (a review found skipping those wrong; numpy's ``get_state`` is most of the cost,
about 30 µs a call). A generator held by a plain object (``ctx.generator`` of a context passed to
every block, ``self.config.rng`` of a config the blocks share) is found too: it was not, and the
recomputation drew other numbers from it, silently (helper-117 found it; the adaptive default
recomputed such layers), and so is one held by a module outside the layer (a noise module passed to
every block, or held in a list), and, from its first call there on, by any module outside the layer
that the layer's first call runs (a module-level one: Note [A recomputation puts back the modules
outside its layer that it calls] in ``tba/runtime/_outside_state.py``), and one a passed function
holds (a lambda's closure, a ``functools.partial``'s arguments, a bound method's object); all of
them drew again in the recomputation, silently, too (helper-117). So is one the layer's code names
(Note [Generators a layer's code names] in ``tba/runtime/_code_named.py``). A generator the layer
reaches any other way (through what a call returns, a name computed at run time) is not found, nor is any other state outside the
layer's modules: as under plain checkpoint, keep or offload such a layer instead of recomputing it.
The global generators are the process's, and so is one at module level that a layer's code names (drawn or not):
another thread drawing from them while a layer is recomputed sees its draws replayed and rewound (torch's own CPU
generator under checkpoint shares the exposure), silently: draw from a generator of the thread's own there, or run the backward
before the next forward (Note [A recomputation and a first call of its state in two threads] in
``tba/runtime/_overlap.py`` says why such draws are not refused).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import operator
import random
import types
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch import nn

from tba.errors import TbaError
from tba.runtime._code_named import class_code_named, closure_contents, code_named, is_generator, library_module, user_code
from tba.runtime._layer_state import held_items
from tba.runtime._state_objects import PLAIN, fields, kind_of, plain_object, slots


def generator_states(layer: nn.Module, args: tuple = (), kwargs: dict | None = None) -> dict[int, tuple[Any, Any]]:
    """Each generator (:data:`GENERATOR_TYPES`) held by ``layer``'s modules or passed in the call's arguments,
    directly or in dicts, lists, tuples, plain objects and other modules (:data:`SEARCH_DEPTH` deep), with its
    state, and the state of Python's and numpy's global generators (Note [Generators of a recomputed layer]);
    :func:`set_states` puts them back."""
    states: dict[int, tuple[Any, Any]] = {id(random): (random, _state(random)), id(np.random): (np.random, _state(np.random))}
    own = list(layer.modules())
    seen = dict.fromkeys(map(id, own), SEARCH_DEPTH + 1)  # walked here, not again through another one's _modules
    for value in [*(value for module in own for value in vars(module).values()), *args, *(kwargs or {}).values()]:
        _collect(value, states, SEARCH_DEPTH, seen)
    _collect_code_named(own, states, seen)
    return states


def held_generator_states(modules: list[nn.Module], known: dict[int, tuple[Any, Any]]) -> dict[int, tuple[Any, Any]]:
    """Each generator held by ``modules`` (those outside a recomputed layer that its first call runs, each taken before
    its first call there) that ``known`` does not hold, with its state (Note [Generators of a recomputed layer])."""
    states: dict[int, tuple[Any, Any]] = {}
    seen = dict.fromkeys(map(id, modules), SEARCH_DEPTH + 1)
    for value in [value for module in modules for value in vars(module).values()]:
        _collect(value, states, SEARCH_DEPTH, seen)
    _collect_code_named(modules, states, seen)
    return {key: state for key, state in states.items() if key not in known}


@contextlib.contextmanager
def unknown_draws_refused(layer: nn.Module, args: tuple, kwargs: dict, known: dict[int, tuple[Any, Any]]) -> Iterator[None]:
    """Around ``layer``'s recomputation: raise :class:`TbaError` when it drew from a generator that its first call's
    search did not find (``known``).

    Note: [A generator bound after the first call is refused]
    The search finds a generator by what holds it (a module-level name, a dict, a config's attribute) when the first
    call starts. One bound there later (``NOISE = torch.Generator().manual_seed(...)`` between forward and backward, by
    the program or another layer, or made lazily by the first call) was drawn from by the recomputation, at a state
    the first call never had: other numbers, and gradients other than those of training without tba, silently
    (helper-121). The recomputation searches again, with its layer's state put back, and raises when one it finds
    that the first call's search did not has moved by its end: the numbers it drew are not the first call's. One the
    recomputation does not draw from is let be: a forward that binds a new generator at every call (``global NOISE;
    NOISE = torch.Generator().manual_seed(seed)``) finds the first call's at the start and draws from its own.
    """
    unknown = {key: state for key, state in generator_states(layer, args, kwargs).items() if key not in known}
    try:
        yield
    finally:
        for generator, state in unknown.values():
            if not _same_state(state, _state(generator)):
                raise TbaError(
                    f"a recomputed layer ({type(layer).__name__}) drew, in its recomputation, from a random generator "
                    f"({type(generator).__name__}) its first call's search did not find: one bound to a name, an item or "
                    "an attribute its code or its modules use between its forward and backward, or made by its first "
                    "call, so the recomputation drew other numbers than its forward did. Bind it before the forward, "
                    "or keep or offload this layer (Note [A generator bound after the first call is refused])")


def _same_state(a: Any, b: Any) -> bool:
    """Whether two states of a generator are equal: torch's a tensor, numpy's with arrays in tuples and dicts."""
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return np.array_equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_state(a[key], b[key]) for key in a)
    if isinstance(a, tuple):
        return len(a) == len(b) and all(map(_same_state, a, b))
    return a == b


def _collect_code_named(modules: list[nn.Module], states: dict[int, tuple[Any, Any]], seen: dict[int, int]) -> None:
    """The generators the ``forward`` of each class of ``modules`` names (Note [Generators a layer's code names] in
    ``tba/runtime/_code_named.py``); torch's modules draw from what they are given."""
    for cls in {type(module) for module in modules}:
        for value in class_code_named(cls):
            _collect(value, states, SEARCH_DEPTH, seen)


SEARCH_DEPTH = 3
"""Containers (dict, list, tuple) and plain objects searched for generators, nested in one another up to this deep."""


def _collect(value: Any, states: dict[int, tuple[Any, Any]], depth: int, seen: dict[int, int]) -> None:
    """Collect the generators ``value`` is or holds, ``depth`` deep; ``seen`` holds the objects searched and how deep
    (Note [Generators a layer's code names] in ``tba/runtime/_code_named.py``: one reached again with more depth left
    is searched again)."""
    if is_generator(value):  # Note [A generator is told by its type] in tba/runtime/_code_named.py
        if id(value) not in states:
            states[id(value)] = (value, _state(value))
    elif depth and isinstance(value, (dict, list, tuple)):
        items = held_items(value)
        if not _only_leaves(items):  # Note [The generator search skips containers of plain values]
            for item in items:
                _collect(item, states, depth - 1, seen)
    elif not depth or seen.get(id(value), -1) >= depth:  # a config every block holds is searched once
        return
    elif isinstance(value, types.ModuleType):  # Note [A module held as a value is searched for its generators only]
        seen[id(value)] = depth
        for item in _module_generators(value):
            _collect(item, states, depth - 1, seen)
    elif plain_object(value):
        seen[id(value)] = depth
        for _, item in fields(value):
            _collect(item, states, depth - 1, seen)
    elif isinstance(value, nn.Module):  # a module passed in, or held in a list
        seen[id(value)] = depth
        for item in [*vars(value).values(), *class_code_named(type(value))]:
            _collect(item, states, depth - 1, seen)
    elif isinstance(value, _CALLABLES):  # a noise function passed to every block
        seen[id(value)] = depth
        for item in _held_by_callable(value):
            _collect(item, states, depth - 1, seen)


_LEAVES = (*PLAIN, torch.Tensor, np.ndarray)
"""What the search never looks into: plain values, tensors and numpy arrays."""


def _only_leaves(items: Any) -> bool:
    """Whether ``items`` (a container's) are :data:`_LEAVES` only, or containers of them (:data:`SEARCH_DEPTH` deep), by
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
    for _ in range(SEARCH_DEPTH):
        every = set(map(type, items))
        kinds = {kind for kind in every if not issubclass(kind, _LEAVES)}
        if not kinds:
            return True
        if not all(issubclass(kind, (dict, list, tuple)) or _fields_in_dict(kind) for kind in kinds):
            return False
        if kinds != every:  # the next level's items, without the leaves
            items = [item for item in items if type(item) in kinds]
        if all(issubclass(kind, dict) for kind in kinds):
            items = list(itertools.chain.from_iterable(map(dict.values, items)))
        elif all(issubclass(kind, (list, tuple)) for kind in kinds):
            items = list(itertools.chain.from_iterable(items))
        elif all(map(_fields_in_dict, kinds)):  # dataclass rows
            items = list(itertools.chain.from_iterable(map(dict.values, map(_DICT, items))))
        else:
            items = [item for held in items for item in (held_items(held) if isinstance(held, (dict, list, tuple))
                                                         else dict(fields(held)).values())]
    return False


_DICT = operator.attrgetter("__dict__")


@functools.lru_cache(maxsize=1024)
def _fields_in_dict(kind: type) -> bool:
    """Whether a plain object of ``kind`` holds its fields in its ``__dict__`` only, read as is (no slots, no
    ``__getattribute__`` of its own: Note [An object's fields are read without its __getattr__])."""
    return kind_of(kind) == 1 and not slots(kind) and kind.__getattribute__ is object.__getattribute__


def _module_generators(module: types.ModuleType) -> list[Any]:
    """The generators ``module`` holds itself, none if it is a library's.

    Note: [A module held as a value is searched for its generators only]
    A module a config holds (``BACKENDS.torch``), or a dict, or an attribute of the layer, was searched as a plain
    object, every attribute and, through its submodules, theirs: torch held by a module-level config that a forward
    names cost 11,000 calls of the search (60 ms) at every call of the layer, and the deprecated attributes it touched
    warned, an error out of the forward under ``-W error`` (helper-121). A module is searched for the generators it
    holds itself (a noise library's ``G``); one of torch, numpy, tba or the standard library (whose global generators
    are taken as the process's) not at all. A module the code names is searched under the names it uses instead (Note
    [Generators a layer's code names] in ``tba/runtime/_code_named.py``).
    """
    if library_module(module):
        return []
    return [item for item in list(vars(module).values()) if is_generator(item)]


_CALLABLES = (types.FunctionType, types.MethodType, functools.partial)


def _held_by_callable(value: Any) -> list[Any]:
    """What a function's closure cells, a bound method's object or a ``functools.partial``'s function and arguments
    hold."""
    if isinstance(value, functools.partial):
        return [value.func, *value.args, *value.keywords.values()]
    if isinstance(value, types.MethodType):
        function, owner = value.__func__, value.__self__
        cls = owner if isinstance(owner, type) else type(owner)  # a classmethod's is the class
        return [owner, *(code_named(function, cls) if user_code(function) else ())]
    held = closure_contents(value)
    if user_code(value):
        held += code_named(value)
    return held


def states_now(states: dict[int, tuple[Any, Any]]) -> dict[int, tuple[Any, Any]]:
    """The current state of each generator in ``states``."""
    return {key: (generator, _state(generator)) for key, (generator, _) in states.items()}


def set_states(states: dict[int, tuple[Any, Any]]) -> None:
    """Put back the generator states :func:`generator_states` took."""
    for generator, state in states.values():
        if isinstance(generator, np.random.Generator):
            generator.bit_generator.state = state
        elif hasattr(generator, "set_state"):  # torch's, numpy's RandomState and the np.random module
            generator.set_state(state)
        else:  # Python's: the random module, a random.Random
            generator.setstate(state)


def _state(generator: Any) -> Any:
    if isinstance(generator, np.random.Generator):
        return generator.bit_generator.state
    return generator.get_state() if hasattr(generator, "get_state") else generator.getstate()
