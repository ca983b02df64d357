"""The random generators a recomputed layer draws from, their states taken and put back.

Note: [Generators of a recomputed layer]
Checkpoint preserves torch's global RNG states only. A layer that draws from a generator of its
own (a ``torch.Generator``, ``random.Random``, numpy ``Generator`` or ``RandomState``, held as an
attribute of one of its modules or passed in its call's arguments, as diffusers-style code passes
``generator=``, directly or in dicts, lists, tuples and plain objects' attributes (their classes' too) up to three deep),
or from Python's ``random`` or numpy's global generator (stochastic depth written with ``random.random()``), would
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
import random
import types
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch import nn

from tba.errors import TbaError
from tba.runtime._code_named import (
    class_code_named,
    closure_contents,
    code_named,
    is_generator,
    library_module,
    partial_parts,
    user_code,
)
from tba.runtime._layer_state import held_items
from tba.runtime._plain_containers import only_leaves
from tba.runtime._search_reads import UNRECORDED, KeptSearch, Reads, Unrecorded
from tba.runtime._state_objects import fields, kind_of, plain_object


def generator_states(layer: nn.Module, args: tuple = (), kwargs: dict | None = None,
                     kept: KeptSearch | None = None) -> dict[int, tuple[Any, Any]]:
    """Each generator (:data:`GENERATOR_TYPES`) held by ``layer``'s modules or passed in the call's arguments,
    directly or in dicts, lists, tuples, plain objects and other modules (:data:`SEARCH_DEPTH` deep), with its
    state, and the state of Python's and numpy's global generators (Note [Generators of a recomputed layer]);
    :func:`set_states` puts them back. The search of the layer is ``kept``'s last one where what it read holds (Note
    [A generator search is reused while what it read holds] in ``tba/runtime/_search_reads.py``)."""
    states: dict[int, tuple[Any, Any]] = {id(random): (random, _state(random)), id(np.random): (np.random, _state(np.random))}
    generators, seen = (kept.reuse(layer) if kept is not None else None) or _layer_generators(layer, kept)
    for generator in generators:
        if id(generator) not in states:
            states[id(generator)] = (generator, _state(generator))
    for value in [*args, *(kwargs or {}).values()]:  # a call's own: searched at every call
        _collect(value, states, SEARCH_DEPTH, seen, UNRECORDED)
    return states


def _layer_generators(layer: nn.Module, kept: KeptSearch | None) -> tuple[list[Any], dict[int, int]]:
    """The generators ``layer``'s modules hold and its code names, and the objects searched and how deep; kept in
    ``kept`` with the search's reads."""
    recorded = kept is not None and kept.records()
    reads = Reads(layer) if recorded else UNRECORDED
    found: dict[int, tuple[Any, Any]] = {}
    own = reads.values(_modules_of, layer)
    seen = dict.fromkeys(map(id, own), SEARCH_DEPTH + 1)  # walked here, not again through another one's _modules
    for value in [value for module in own for value in reads.items(reads.attr(module, "__dict__"))]:
        _collect(value, found, SEARCH_DEPTH, seen, reads)
    _collect_code_named(own, found, seen, reads)
    generators = [generator for generator, _ in found.values()]
    if recorded:
        kept.keep(reads, generators, seen)
    return generators, seen


def _modules_of(layer: nn.Module) -> list[nn.Module]:
    return list(layer.modules())


def held_generator_states(modules: list[nn.Module], known: dict[int, tuple[Any, Any]]) -> dict[int, tuple[Any, Any]]:
    """Each generator held by ``modules`` (those outside a recomputed layer that its first call runs, each taken before
    its first call there) that ``known`` does not hold, with its state (Note [Generators of a recomputed layer])."""
    states: dict[int, tuple[Any, Any]] = {}
    seen = dict.fromkeys(map(id, modules), SEARCH_DEPTH + 1)
    for value in [value for module in modules for value in vars(module).values()]:
        _collect(value, states, SEARCH_DEPTH, seen, UNRECORDED)
    _collect_code_named(modules, states, seen, UNRECORDED)
    return {key: state for key, state in states.items() if key not in known}


@contextlib.contextmanager
def unknown_draws_refused(layer: nn.Module, args: tuple, kwargs: dict, known: dict[int, tuple[Any, Any]],
                          kept: KeptSearch | None = None) -> Iterator[None]:
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
    unknown = {key: state for key, state in generator_states(layer, args, kwargs, kept).items() if key not in known}
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


def _collect_code_named(modules: list[nn.Module], states: dict[int, tuple[Any, Any]], seen: dict[int, int],
                        reads: Reads | Unrecorded) -> None:
    """The generators the ``forward`` of each class of ``modules`` names (Note [Generators a layer's code names] in
    ``tba/runtime/_code_named.py``); torch's modules draw from what they are given."""
    for cls in {reads.values(_type_of, module)[0] for module in modules}:
        for value in class_code_named(cls, reads):
            _collect(value, states, SEARCH_DEPTH, seen, reads)


SEARCH_DEPTH = 3
"""Containers (dict, list, tuple) and plain objects searched for generators, nested in one another up to this deep."""


def _collect(value: Any, states: dict[int, tuple[Any, Any]], depth: int, seen: dict[int, int],
             reads: Reads | Unrecorded) -> None:
    """Collect the generators ``value`` is or holds, ``depth`` deep; ``seen`` holds the objects searched and how deep
    (Note [Generators a layer's code names] in ``tba/runtime/_code_named.py``: one reached again with more depth left
    is searched again); each read of what a value holds goes through ``reads`` (Note [A generator search is reused
    while what it read holds] in ``tba/runtime/_search_reads.py``)."""
    if is_generator(value):  # Note [A generator is told by its type] in tba/runtime/_code_named.py
        if id(value) not in states:
            states[id(value)] = (value, _state(value))
    elif depth and isinstance(value, (dict, list, tuple)):
        items = held_items(value)
        if not only_leaves(items, SEARCH_DEPTH):  # Note [The generator search skips containers of plain values]
            for item in reads.items(value):  # in tba/runtime/_plain_containers.py
                _collect(item, states, depth - 1, seen, reads)
        else:
            reads.skipped(value, items, SEARCH_DEPTH)
    elif not depth or seen.get(id(value), -1) >= depth:  # a config every block holds is searched once
        return
    elif isinstance(value, types.ModuleType):  # Note [A module held as a value is searched for its generators only]
        seen[id(value)] = depth
        for item in reads.values(_module_generators, value):
            _collect(item, states, depth - 1, seen, reads)
    elif plain_object(value):
        seen[id(value)] = depth
        for item in reads.values(_field_values, value):
            _collect(item, states, depth - 1, seen, reads)
    elif isinstance(value, nn.Module):  # a module passed in, or held in a list
        seen[id(value)] = depth
        for item in [*reads.items(reads.attr(value, "__dict__")), *class_code_named(reads.values(_type_of, value)[0], reads)]:
            _collect(item, states, depth - 1, seen, reads)
    elif isinstance(value, _CALLABLES):  # a noise function passed to every block
        seen[id(value)] = depth
        for item in _held_by_callable(value, reads):
            _collect(item, states, depth - 1, seen, reads)


def _type_of(value: Any) -> list[type]:
    return [type(value)]


def _field_values(value: Any) -> list[Any]:
    """A plain object's fields, and the generators, containers and plain objects its class and bases hold
    (``self.config.rng`` where the config's class sets ``rng``, for every config that sets none of its own): left out,
    one bound there drew again in the recomputation, silently (helper-137; in a class's dict, helper-141)."""
    held = [item for _, item in fields(value)]
    for klass in type(value).__mro__[:-1]:  # object holds none
        held += [item for name, item in list(vars(klass).items())
                 if is_generator(item) or (not name.startswith("__") and _class_value(type(item)))]
    return held


@functools.lru_cache(maxsize=4096)
def _class_value(kind: type) -> bool:
    """Whether a class attribute of type ``kind`` is a value the search enters: a container or a plain object, not a
    descriptor (a function, property or classmethod is the class's code, read where the code is named, never called)."""
    return kind_of(kind) != 0 and not any("__get__" in vars(base) for base in kind.__mro__)


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


def _held_by_callable(value: Any, reads: Reads | Unrecorded) -> list[Any]:
    """What a function's closure cells, a bound method's object or a ``functools.partial``'s function and arguments
    hold."""
    if isinstance(value, functools.partial):
        return list(reads.values(partial_parts, value))
    if isinstance(value, types.MethodType):
        function, owner = reads.attr(value, "__func__"), reads.attr(value, "__self__")
        cls = owner if isinstance(owner, type) else reads.values(_type_of, owner)[0]  # a classmethod's is the class
        return [owner, *(code_named(function, reads, cls) if reads.equal(user_code, function) else ())]
    held = list(reads.values(closure_contents, value))
    if reads.equal(user_code, value):
        held += code_named(value, reads)
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
