"""What the code of a layer's classes names: the values a generator search takes from its globals, its class and the
functions it reaches (Note [Generators a layer's code names]); the search itself is ``tba/runtime/_generators.py``'s."""

from __future__ import annotations

import functools
import random
import sys
import types
from typing import Any

import numpy as np
import torch
from torch import nn

MISSING = object()
"""What a read of a name not there gives (``Reads.get`` in ``tba/runtime/_search_reads.py``)."""

GENERATOR_TYPES = (torch.Generator, random.Random, np.random.Generator, np.random.RandomState)
"""What a layer's modules may hold, or its call pass, that ``tba/runtime/_generators.py`` replays."""


def is_generator(value: Any) -> bool:
    """``isinstance(value, GENERATOR_TYPES)``, decided by the value's type.

    Note: [A generator is told by its type]
    ``torch.Generator``'s metaclass answers ``isinstance`` in Python (torch's ``OpaqueBaseMeta``, which also looks
    for script-object wrappers): 0.5 us for every value the generator search meets, most of its cost. A recomputed
    Llama block met about 430 values per call, so its search took about 0.7 ms, at every call of the layer. The
    search asks of the value's type instead, once per type (``issubclass`` does not go through that metaclass).
    """
    return _generator_type(type(value))


@functools.lru_cache(maxsize=1024)
def _generator_type(cls: type) -> bool:
    return issubclass(cls, GENERATOR_TYPES)


def class_code_named(cls: type, reads: Any) -> list[Any]:
    """What the code of the ``forward`` of ``cls`` names, each of its definitions along the class's bases; each read
    through ``reads`` (Note [A generator search is reused while what it read holds] in ``tba/runtime/_search_reads.py``)."""
    methods: set[int] = set()
    found: list[Any] = []
    for function in class_named(cls, "forward", reads):
        if not reads.equal(user_code, function):
            found.append(function)  # a partial's arguments, torch's forward (whose closure is searched only)
        elif id(function) not in methods:
            methods.add(id(function))
            found += code_named(function, reads, cls, methods)
    return found


def code_named(function: Any, reads: Any, cls: type | None = None, _methods: set[int] | None = None) -> list[Any]:
    """What the code of ``function`` (a method of ``cls``, if given) names (Note [Generators a layer's code names]),
    each read through ``reads``.

    Note: [Generators a layer's code names]
    A layer that draws from a generator made at module level (``torch.rand(shape, generator=NOISE)`` in ``forward``, or
    in a module-level helper that ``forward`` calls) or held by its class (``rng = torch.Generator()`` in the class
    body, drawn as ``self.rng``) holds it in no attribute of its modules and gets it in no argument: the search found
    none of these, and the recomputation drew the next numbers, silently (the adaptive default recomputes such layers
    too). So the search also takes what the code of each of the layer's classes' ``forward`` names: the globals among
    its names (and its nested functions' and comprehensions'), what a module or a class among those globals holds under
    one of its names, and so on (``noise_lib.G``, ``Noise.rng`` of a class used as a namespace, ``noise_config.TABLE``,
    ``package.Settings.table``; of torch's, numpy's, tba's or the standard library's, only generators and functions) and
    a user's class's ``forward`` (a custom ``torch.autograd.Function``'s, which ``Noise.apply`` runs), and the class
    attributes of the names that the class and its bases but ``nn.Module`` define (a method, a property's getter, a
    generator; a mixin's after ``nn.Module`` in the bases too), every base's definition of a name, as
    ``super().forward()`` reaches the base's. A function is unwrapped: a ``staticmethod``, ``classmethod``,
    ``functools.partialmethod`` or ``partial`` to its function (and the partial's arguments), a decorated one to what
    ``__wrapped__`` (``functools.wraps``: ``torch.autocast``'s, a user's) or its closure holds, searched as a method of
    the class. helper-121 found a ``super().forward()``, a decorated ``forward`` (without ``functools.wraps`` too), a
    class used as a namespace, a dict of generators a user's module holds, a mixin after ``nn.Module``, a custom
    autograd function and a ``partialmethod`` or ``partial`` forward all drawing again in the recomputation, silently.
    Functions found so, and those passed in (a noise function), are searched the same way, ``SEARCH_DEPTH`` deep in
    ``tba/runtime/_generators.py`` (one reached again with more depth left is searched again: reached first at the end
    of a longer chain, a helper's own helpers were left out), except those of torch, numpy, tba and the standard
    library, which draw only from what they are given. The names of a code object are taken once (:func:`_names`); the
    values are looked up at every call, or the lookups replayed (Note [A generator search is reused while what it read
    holds] in ``tba/runtime/_search_reads.py``), so a global rebound before a forward is seen (one rebound between
    forward and backward: Note [A generator bound after the first call is refused] in ``tba/runtime/_generators.py``).
    A function's default arguments are what its code uses too (``def forward(self, x, noise=G)``, a helper's
    ``generator=G``): left out, one bound there drew again in the recomputation, silently (helper-137).
    """
    names = reads.equal(_names, reads.attr(function, "__code__"))
    methods = _methods if _methods is not None else {id(function)}
    found: list[Any] = list(reads.values(default_values, function))
    globals_ = reads.attr(function, "__globals__")
    pending = [value for value in (reads.get(globals_, name) for name in names) if value is not MISSING]
    expanded: set[int] = set()
    while pending:
        value = pending.pop()
        if not isinstance(value, (types.ModuleType, type)):
            found.append(value)
        elif id(value) not in expanded:  # a module, or a class used as a namespace, and those they hold (pkg.sub.G)
            expanded.add(id(value))
            pending += _held_under(value, names, reads)
    if cls is None:
        return found + closure_functions(function, reads)
    named = (value for name in names for value in class_named(cls, name, reads))
    for value in [*closure_functions(function, reads), *named]:
        if reads.equal(user_code, value):  # a method of the class, or what its decorator wraps: its names are the class's
            if id(value) not in methods:
                methods.add(id(value))
                found += code_named(value, reads, cls, methods)
        else:
            found.append(value)
    return found


def _held_under(holder: types.ModuleType | type, names: tuple[str, ...], reads: Any) -> list[Any]:
    """What a module, or a class and its bases, holds under ``names``, unwrapped as :func:`class_named` does: anything
    a user's holds (a dict of generators), only generators and functions a library's (``sys.modules`` is no one's)."""
    if isinstance(holder, types.ModuleType):
        attributes = reads.attr(holder, "__dict__")
        held = [value for value in (reads.get(attributes, name) for name in names) if value is not MISSING]
        library = reads.equal(library_module, holder)
    else:  # and a user's class's forward: a custom autograd function's that ``Noise.apply`` runs, a module's made here
        held = [item for name in (*names, "forward") for item in class_named(holder, name, reads)]
        library = not reads.equal(_user_class, holder)
    return [item for item in held if is_generator(item) or isinstance(item, types.FunctionType)] if library else held


def class_named(cls: type, name: str, reads: Any) -> list[Any]:
    """The attribute ``name`` of ``cls`` and of each base but ``nn.Module`` and ``object`` (a mixin after ``nn.Module``
    too), unwrapped to its function(s)."""
    found: list[Any] = []
    for klass in reads.items(reads.attr(cls, "__mro__")):
        if klass is nn.Module or klass is object:
            continue
        value = reads.get(reads.attr(klass, "__dict__"), name)
        if value is not None and value is not MISSING:
            found += unwrapped(value, reads)
    return found


def unwrapped(value: Any, reads: Any) -> list[Any]:
    """``value`` and, for a method wrapper or a decorated function, what it wraps (Note [Generators a layer's code
    names])."""
    if isinstance(value, (staticmethod, classmethod)):
        return unwrapped(reads.attr(value, "__func__"), reads)
    if isinstance(value, property):
        getter = reads.attr(value, "fget")
        return unwrapped(getter, reads) if getter is not None else []
    if isinstance(value, (functools.partialmethod, functools.partial)):
        function, *held = reads.values(partial_parts, value)
        return [*unwrapped(function, reads), *held]
    found, seen = [value], {id(value)}
    while isinstance(value, types.FunctionType):
        inner = reads.get(reads.attr(value, "__dict__"), "__wrapped__")
        if inner is MISSING or inner is None or id(inner) in seen:
            break
        seen.add(id(inner))
        found.append(inner)
        value = inner
    return found


def partial_parts(value: functools.partial | functools.partialmethod) -> list[Any]:
    """A partial's function, then its arguments."""
    return [value.func, *value.args, *value.keywords.values()]


def closure_functions(function: Any, reads: Any) -> list[Any]:
    """The functions a decorator's wrapper (``function``, user code) closes over: the one it wraps."""
    if not reads.equal(user_code, function):
        return []
    return [value for value in reads.values(closure_contents, function) if isinstance(value, types.FunctionType)]


def default_values(function: types.FunctionType) -> list[Any]:
    """The default values of ``function``'s arguments, positional then keyword-only."""
    return [*(getattr(function, "__defaults__", None) or ()), *(getattr(function, "__kwdefaults__", None) or {}).values()]


def closure_contents(function: types.FunctionType) -> list[Any]:
    """What the closure cells of ``function`` hold (a cell not set yet left out)."""
    held = []
    for cell in function.__closure__ or ():
        try:
            held.append(cell.cell_contents)
        except ValueError:  # a cell not set yet
            continue
    return held


@functools.lru_cache(maxsize=4096)
def _names(code: types.CodeType) -> tuple[str, ...]:
    """The names ``code`` and the code objects nested in it read (globals, attributes, methods)."""
    names: set[str] = set()
    stack = [code]
    while stack:
        current = stack.pop()
        names.update(current.co_names)
        stack += [const for const in current.co_consts if isinstance(const, types.CodeType)]
    return tuple(sorted(names))


_LIBRARY_ROOTS = frozenset({"torch", "numpy", "tba", *sys.stdlib_module_names})
"""Top-level packages whose functions the search does not follow (Note [Generators a layer's code names])."""


def user_code(function: Any) -> bool:
    """Whether ``function`` is Python code outside torch, numpy, tba and the standard library."""
    if not isinstance(function, types.FunctionType):
        return False
    return _user_name(function.__globals__.get("__name__"))


def library_module(module: types.ModuleType) -> bool:
    """Whether ``module`` is torch's, numpy's, tba's or the standard library's (its ``__dict__``'s name, no
    ``__getattr__``)."""
    return not _user_name(vars(module).get("__name__"))


def _user_class(cls: type) -> bool:
    """Whether ``cls`` was defined outside torch, numpy, tba and the standard library (by its namespace's
    ``__module__``)."""
    return _user_name(vars(cls).get("__module__"))


def _user_name(name: Any) -> bool:
    return not isinstance(name, str) or name.partition(".")[0] not in _LIBRARY_ROOTS
