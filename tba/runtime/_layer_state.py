"""The state a recomputed layer's forward reads and changes besides its inputs, copied and put back.

``tba/runtime/_recompute.py`` runs a recomputed layer's forward a second time in backward. That
forward must compute what the first one computed, from the same state, and leave the model as one
forward would. This module holds what that takes: :func:`snapshot` copies the state of a layer's
modules, :func:`~tba.runtime._layer_restore.restore` (``tba/runtime/_layer_restore.py``) puts a copy
back (``tba/runtime/_first_call.py`` keeps what the first call started from and checks before the
recomputation that nothing it did not keep has moved), and :mod:`tba.runtime._generators` finds the
generators it draws from.

The state of a module, for this purpose, is its buffers, its public attributes that hold a tensor,
a numpy array, a plain value (number, string, bytes, tuple, None) or a list, dict, set, deque, bytearray or
``array.array`` of any kind (``defaultdict`` and ``Counter`` too: Note [A container refilled in place] in
``tba/runtime/_state_objects.py``; copied one level deep: the container, which objects it holds, and
the bytes of the tensors and writeable numpy arrays among them, and among a tuple's items), and the
generators it holds. A container nested in a
container or a tuple, or a plain object's attributes, is not copied here: its items are put back by identity
(Note [Nested state a recomputation is given back] in ``tba/runtime/_private_state.py``; its
changes were replayed twice, silently). Its
parameters are checked, not copied. Private attributes (``_name``) are left alone: modules and the
frameworks around them (FSDP, torch.compile, hooks) keep their own bookkeeping there; a forward that
changes them raises instead (Note [Private state of a recomputed layer] in
``tba/runtime/_private_state.py``).

Note: [Side effects of a recomputed forward]
The recomputation must run the forward the first call ran, and must not change the model a second
time. A forward may update buffers or tensor attributes in place (BatchNorm's running statistics,
spectral norm's power iteration vectors, an exponential average it then subtracts), assign plain
attributes (a call counter) and append to a list; when it also *reads* them, a recomputation from
the state the first call left computes another forward, and gradients differ from training without
tba. So the wrapper tells the first call of ``forward`` from the recomputation (checkpoint calls the
same function again during backward). Before the first call it copies the layer's state; right
after it, the copies of tensors the call did not change (same object, same version counter and same
bytes: BatchNorm's kernel updates its running statistics without bumping their version, and so does
any update through ``.data``) are dropped, so only what the forward updates (usually a few small
vectors) is held until backward. What a layer's first watched forward left alone (a causal mask,
say) is remembered (:class:`Learned`, for as long as the layer lives, per training mode: a norm
layer validated in eval mode first leaves its statistics alone only there) and not copied again:
later steps copy only what a forward was seen to change, and watch the rest through its version counter,
raising :class:`~tba.errors.TbaError` when a forward changes it after all (there is no copy to
recompute from; the next forward copies it). A change of such a tensor that bumps no version goes
unseen: the price of not copying every buffer of every recomputed layer every step (a float causal
mask of a 1024-token model is 4 MiB per layer, and comparing it would synchronise a GPU). So that
applies to large tensors only: one of at most
:data:`~tba.defaults.RECOMPUTE_STATE_ALWAYS_COPIED_BYTES` (running statistics, counters, scales) is
copied before every forward and put back for the recomputation, never compared: a forward that
updates it only on some inputs, through a kernel that bumps no version (``F.batch_norm`` on the
layer's own buffers once the batch is large enough; a review found its statistics updated twice,
silently), recomputes exactly too.
The recomputation then copies the state as it is, loads the state the first call
started from, runs the forward, and restores what it copied, bit for bit: each tensor and container
goes back into the same object the module held, so other references to it see the values too. The
copy back keeps each tensor's version counter: the recomputed forward's in-place update already
bumped it, and nodes it built (under ``create_graph``) saved the tensor at that version; another bump
would make their unpack raise the in-place error on a program torch runs.
"""

from __future__ import annotations

import array
import collections
import copy
import dataclasses
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch
from torch import nn

from tba import defaults
from tba.runtime._learned import Key, Learned
from tba.runtime._state_objects import fields, plain_object

_PLAIN_TYPES = (int, float, bool, str, bytes, tuple, type(None))
_CONTAINER_TYPES = (list, dict, set, collections.deque, bytearray, array.array)  # Note [A container refilled in place]

@dataclasses.dataclass
class TensorCopy:
    """One state tensor of a module: the object, a copy of its bytes (:data:`NOT_COPIED` when none was taken), its
    version counter then, and whether it is a buffer (else a plain attribute)."""

    tensor: torch.Tensor
    value: torch.Tensor
    version: int
    is_buffer: bool


@dataclasses.dataclass
class ModuleState:
    """The state of one module (the module's docstring says what counts)."""

    module: nn.Module
    tensors: dict[str, TensorCopy]
    buffer_names: set[str]
    """Every name registered as a buffer then, ``None`` ones included."""
    none_buffers: set[str]
    """The buffers registered as ``None`` then."""
    plain: dict[str, Any]
    containers: dict[str, tuple[Any, Any]]
    """Name to ``(container, shallow copy of its contents)``."""
    items: list[tuple[Key, TensorCopy]]
    """Tensors held in those containers (one level), restored in place."""
    arrays: dict[str, tuple[np.ndarray, np.ndarray]]
    """numpy array attributes, always copied (they have no version counter to watch); an array held in those
    containers (one level) is in it too, under ``name[index]``, and goes back in place (Note [Side effects of a
    recomputed forward])."""
    training: bool
    """The module's mode when the state was taken: part of each tensor's :data:`Key`."""


NOT_COPIED = torch.empty(0, device="cpu")
"""Stands for the bytes of a tensor that was not copied: one the layer's forward is known to leave alone. On the CPU
whatever the default device at import: on a CUDA default device, importing tba would have started CUDA."""


def snapshot(modules: Iterable[nn.Module], learned: Learned) -> list[ModuleState]:
    """The state of each of ``modules`` (a layer's ``modules()``; Note [Side effects of a recomputed forward])."""
    states = []
    for module in modules:
        mode = module.training
        tensors = {}
        for name, value in module._buffers.items():
            if value is not None and not value.is_inference():  # one made under inference_mode cannot change in place
                tensors[name] = _copy(value, learned, (id(module), name, mode), True)
        plain, containers, items, arrays = {}, {}, [], {}
        for name, value in vars(module).items():
            if name.startswith("_"):
                continue
            if isinstance(value, torch.Tensor):
                if not value.is_inference():
                    tensors[name] = _copy(value, learned, (id(module), name, mode), False)
            elif isinstance(value, _PLAIN_TYPES):
                plain[name] = value
                if isinstance(value, tuple):  # it cannot change, a tensor or an array it holds can
                    _held_arrays(module, name, value, learned, items, arrays)
            elif isinstance(value, _CONTAINER_TYPES):
                containers[name] = (value, copy.copy(value))
                _held_arrays(module, name, held_items(value), learned, items, arrays)
            elif isinstance(value, np.ndarray) and value.flags.writeable:  # a read-only one cannot change in place
                arrays[name] = (value, value.copy())
        none_buffers = {name for name, value in module._buffers.items() if value is None}
        states.append(ModuleState(module, tensors, set(module._buffers), none_buffers, plain, containers, items, arrays,
                                  mode))
    return states


def _held_arrays(module: nn.Module, name: str, held: Any, learned: Learned, items: list[tuple[Key, TensorCopy]],
                 arrays: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
    """Copy, into ``items`` and ``arrays``, the tensors and writeable numpy arrays among ``held`` (what the public
    attribute ``name`` holds, one level)."""
    for index, item in enumerate(held):
        if isinstance(item, torch.Tensor) and not item.is_inference():
            key = (id(module), f"{name}[{index}]", module.training)
            items.append((key, _copy(item, learned, key, False)))
        elif isinstance(item, np.ndarray) and item.flags.writeable:
            arrays[f"{name}[{index}]"] = (item, item.copy())


def _copy(tensor: torch.Tensor, learned: Learned, key: Key, is_buffer: bool) -> TensorCopy:
    copies = learned.copies(key) or always_copied(tensor)
    return TensorCopy(tensor, tensor.detach().clone() if copies else NOT_COPIED, tensor._version, is_buffer)


def always_copied(tensor: torch.Tensor) -> bool:
    """Whether a state tensor is copied before every forward, whatever earlier forwards did to it: a small one, or one
    that is not strided.

    Note: [A sparse state tensor is always copied]
    A sparse tensor held as state (a graph's adjacency matrix as a buffer) has no ``nbytes`` in torch (a COO one
    refuses it) and no ``torch.equal``, which the comparison of a large tensor the first forward may have left alone
    needs: every plan that recomputed such a layer failed its first forward with torch's ``RuntimeError: nbytes is not
    defined for sparse tensors`` (helper-117 found it). Any tensor whose layout is not strided is copied before every
    forward and put back for the recomputation, as a small one is: exact, for the price of one copy per call.
    """
    return tensor.layout is not torch.strided or tensor.nbytes <= defaults.RECOMPUTE_STATE_ALWAYS_COPIED_BYTES


def held_tensors(module: nn.Module) -> set[int]:
    """The identities of the tensors ``module`` holds now, in its buffers, its public attributes and the containers and
    tuples among them (one level)."""
    held = {id(value) for value in module._buffers.values()}
    for name, value in vars(module).items():
        if not name.startswith("_"):
            held.add(id(value))
            if isinstance(value, (*_CONTAINER_TYPES, tuple)):
                held.update(id(item) for item in held_items(value))
    return held


def held_iterator(layer: nn.Module) -> str | None:
    """The label of an iterator that a module of ``layer`` holds (in an attribute, public or private, or in a list, tuple
    or dict one level down), else None.

    Note: [An iterator a layer holds is not put back]
    A forward that draws from an iterator it holds (``next(self.step)`` of an ``itertools.count``, a generator, an
    ``iter()`` over a schedule) changes state that tba can neither copy nor compare: a generator cannot be copied, and an
    iterator's position is not readable in general. Its recomputation drew the next value, another forward than the first
    call's, and the adaptive default planned such layers for recomputation (``SSK``, ``RRK``: every planned step's
    gradients wrong, silently); so it was with an iterator passed to the call, or held by a config object. So the
    profiled steps mark a layer whose modules hold an iterator (one level down, a plain object's fields too), or that is
    passed one, not recomputable
    (``tba/runtime/_timer.py``), whether or not its forward draws from it; a plan that pins its recomputation
    recomputes it from the iterator as it is then, as plain checkpoint does (docs/api.md says so).
    """
    for module in layer.modules():
        label = _iterator_in(vars(module).items())
        if label is not None:
            return f"{type(module).__name__}.{label}"
    return None


def passed_iterator(args: tuple, kwargs: dict) -> str | None:
    """The label of an iterator passed to a layer's call (an argument, or in a list, tuple or dict one level down), else
    None (Note [An iterator a layer holds is not put back]: one passed is drawn from again by the recomputation too)."""
    return _iterator_in([*enumerate(args), *kwargs.items()])


def _iterator_in(named: Iterable[tuple[Any, Any]]) -> str | None:
    """The label of an iterator among ``named``'s values, in a list, tuple or dict among them or among a plain object's
    fields (a config object holding a schedule), one level down."""
    for name, value in named:
        if plain_object(value):
            inner = next((key for key, item in fields(value) if isinstance(item, Iterator)), None)
            if inner is not None:
                return f"{name}.{inner}"
            continue
        for key, item in value.items() if isinstance(value, dict) else enumerate(value) if isinstance(
                value, (list, tuple)) else ((None, value),):
            if isinstance(item, Iterator):
                return f"{name}{'' if key is None else f'[{key!r}]'}"
    return None


def held_items(container: Any) -> Any:
    """What a container attribute holds: a dict's values, else its items."""
    return container.values() if isinstance(container, dict) else container
