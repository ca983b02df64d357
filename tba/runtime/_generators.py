"""The random generators a recomputed layer draws from, their states taken and put back.

Note: [Generators of a recomputed layer]
Checkpoint preserves torch's global RNG states only. A layer that draws from a ``torch.Generator``
of its own (held as an attribute of one of its modules, or in a dict, list or tuple attribute, or
passed in its call's arguments, as diffusers-style code passes ``generator=``), or from Python's
``random`` or numpy's global generator (stochastic depth written with ``random.random()``), would
draw differently in the recomputation, so its gradients would be those of another forward (a
review found the adaptive default recomputing such layers: ``SSSK``), and the generator would end
advanced twice. The wrapper records each such generator's state before the first forward, sets it
back before the recomputation and, afterwards, restores the state the recomputation started from.
A generator the layer reaches any other way (a module-level ``torch.Generator``) is not found, nor
is any other state outside the layer's modules: as under plain checkpoint, keep or offload such a
layer instead of recomputing it.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from torch import nn

from tba.runtime._layer_state import held_items


def generator_states(layer: nn.Module, args: tuple = (), kwargs: dict | None = None) -> dict[int, tuple[Any, Any]]:
    """Each ``torch.Generator`` held by ``layer``'s modules, directly or in a dict, list or tuple attribute,
    or passed in the call's arguments (directly or in such a container), with its state, and the state of
    Python's and numpy's global generators (Note [Generators of a recomputed layer]); :func:`set_states`
    puts them back."""
    states: dict[int, tuple[Any, Any]] = {id(random): (random, _state(random)), id(np.random): (np.random, _state(np.random))}
    values = [value for module in layer.modules() for value in vars(module).values()]
    for value in [*values, *args, *(kwargs or {}).values()]:
        for item in held_items(value) if isinstance(value, (dict, list, tuple)) else (value,):
            if isinstance(item, torch.Generator) and id(item) not in states:
                states[id(item)] = (item, item.get_state())
    return states


def states_now(states: dict[int, tuple[Any, Any]]) -> dict[int, tuple[Any, Any]]:
    """The current state of each generator in ``states``."""
    return {key: (generator, _state(generator)) for key, (generator, _) in states.items()}


def moved(states: dict[int, tuple[Any, Any]]) -> dict[int, tuple[Any, Any]]:
    """The entries of ``states`` whose generator has drawn since (a forward that drew nothing needs no
    replay: the recomputation then neither reads nor sets a state, about 80 µs less per layer, most of it numpy's)."""
    return {key: (generator, state) for key, (generator, state) in states.items() if not _same(_state(generator), state)}


def set_states(states: dict[int, tuple[Any, Any]]) -> None:
    """Put back the generator states :func:`generator_states` took."""
    for generator, state in states.values():
        if generator is random:
            random.setstate(state)
        elif generator is np.random:
            np.random.set_state(state)
        else:
            generator.set_state(state)


def _state(generator: Any) -> Any:
    if generator is random:
        return random.getstate()
    if generator is np.random:
        return np.random.get_state()
    return generator.get_state()


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, tuple) and a and a[0] == "MT19937":  # numpy's: (name, key array, position, has_gauss, gauss)
        return a[2:] == b[2:] and np.array_equal(a[1], b[1])
    return a == b
