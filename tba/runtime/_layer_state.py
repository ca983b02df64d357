"""The state a recomputed layer's forward reads and changes besides its inputs, copied and put back.

``tba/runtime/_recompute.py`` runs a recomputed layer's forward a second time in backward. That
forward must compute what the first one computed, from the same state, and leave the model as one
forward would. This module holds what that takes: :func:`snapshot` copies the state of a layer's
modules, :func:`restore` puts a copy back, :class:`FirstCall` keeps what the first call started from
and checks before the recomputation that nothing it did not keep has moved, and
:mod:`tba.runtime._generators` finds the generators it draws from.

The state of a module, for this purpose, is its buffers, its public attributes that hold a tensor,
a numpy array, a plain value (number, string, bytes, tuple, None) or a list, dict, set or deque of
any kind (``defaultdict`` too; copied one level deep: the container, which objects it holds, and
the bytes of the tensors among them), and the generators it holds. A container nested in a
container is not copied: its changes are replayed twice, silently, as under plain checkpoint. Its
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
mask of a 1024-token model is 4 MiB per layer, and comparing it would synchronise a GPU).
The recomputation then copies the state as it is, loads the state the first call
started from, runs the forward, and restores what it copied, bit for bit: each tensor and container
goes back into the same object the module held, so other references to it see the values too. The
copy back keeps each tensor's version counter: the recomputed forward's in-place update already
bumped it, and nodes it built (under ``create_graph``) saved the tensor at that version; another bump
would make their unpack raise the in-place error on a program torch runs.

Note: [A recomputed layer's parameters must not change before backward]
Without tba, a parameter autograd saved and the optimiser (or the user) changed in place before
backward makes unpack raise torch's in-place error; one it did not save is not read again. A
recomputation reads every parameter of the layer again, so a change between forward and backward
would silently give the gradients of another forward. :class:`FirstCall` records each parameter's
version counter (and each state tensor's that the first call left unchanged, whose value it does not
keep) when the first call ends, and before the recomputation raises :class:`~tba.errors.TbaError`
naming the tensor when one moved. Loud where torch may be silent (a weight that no saved tensor
aliases), never wrong.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.autograd.grad_mode import _unsafe_preserve_version_counter

from tba.errors import TbaError
from tba.runtime._learned import Key, Learned

_PLAIN_TYPES = (int, float, bool, str, bytes, tuple, type(None))
_CONTAINER_TYPES = (list, dict, set, collections.deque)

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
    """numpy array attributes, always copied (they have no version counter to watch)."""
    training: bool
    """The module's mode when the state was taken: part of each tensor's :data:`Key`."""


NOT_COPIED = torch.empty(0)
"""Stands for the bytes of a tensor that was not copied: one the layer's forward is known to leave alone."""


def snapshot(layer: nn.Module, learned: Learned) -> list[ModuleState]:
    """The state of each of ``layer``'s modules (Note [Side effects of a recomputed forward])."""
    states = []
    for module in layer.modules():
        mode = module.training
        tensors = {}
        for name, value in module._buffers.items():
            if value is not None and not value.is_inference():  # one made under inference_mode cannot change in place
                tensors[name] = _copy(value, learned.copies((id(module), name, mode)), True)
        plain, containers, items, arrays = {}, {}, [], {}
        for name, value in vars(module).items():
            if name.startswith("_"):
                continue
            if isinstance(value, torch.Tensor):
                if not value.is_inference():
                    tensors[name] = _copy(value, learned.copies((id(module), name, mode)), False)
            elif isinstance(value, _PLAIN_TYPES):
                plain[name] = value
            elif isinstance(value, _CONTAINER_TYPES):
                containers[name] = (value, copy.copy(value))
                for index, item in enumerate(held_items(value)):
                    if isinstance(item, torch.Tensor) and not item.is_inference():
                        key = (id(module), f"{name}[{index}]", mode)
                        items.append((key, _copy(item, learned.copies(key), False)))
            elif isinstance(value, np.ndarray) and value.flags.writeable:  # a read-only one cannot change in place
                arrays[name] = (value, value.copy())
        none_buffers = {name for name, value in module._buffers.items() if value is None}
        states.append(ModuleState(module, tensors, set(module._buffers), none_buffers, plain, containers, items, arrays,
                                  mode))
    return states


def _copy(tensor: torch.Tensor, copies: bool, is_buffer: bool) -> TensorCopy:
    return TensorCopy(tensor, tensor.detach().clone() if copies else NOT_COPIED, tensor._version, is_buffer)


def restore(current: list[ModuleState], target: list[ModuleState]) -> None:
    """Put ``target``'s state back into its modules; ``current`` is a snapshot of the state now."""
    now_of = {id(state.module): state for state in current}
    with torch.no_grad():
        for then in target:
            module, now = then.module, now_of.get(id(then.module))
            if now is not None:
                for name in (now.plain.keys() | now.containers.keys() | _attribute_tensors(now)) - (
                        then.plain.keys() | then.containers.keys() | _attribute_tensors(then)):
                    delattr(module, name)  # set by the forward after ``target`` was taken
            for name in [name for name in module._buffers if name not in then.buffer_names]:
                del module._buffers[name]  # registered by the forward after ``target`` was taken
            for name in then.none_buffers:
                module._buffers[name] = None
            for name, copied in then.tensors.items():
                _put_tensor(module, name, copied)
            for name, value in then.plain.items():
                setattr(module, name, value)
            for name, (container, contents) in then.containers.items():
                if getattr(module, name, None) is not container:
                    setattr(module, name, container)
                container.clear()
                if isinstance(container, (dict, set)):
                    container.update(contents)
                else:
                    container.extend(contents)
            for (_, name, _), copied in then.items:
                _put_bytes(copied, f"tensor {name} of {type(module).__name__}")
            for name, (array, contents) in then.arrays.items():
                if getattr(module, name, None) is not array:
                    setattr(module, name, array)
                if array.shape == contents.shape and array.dtype == contents.dtype:
                    array[...] = contents
                else:
                    setattr(module, name, contents.copy())


def _attribute_tensors(state: ModuleState) -> set[str]:
    return {name for name, copied in state.tensors.items() if not copied.is_buffer}


def _put_tensor(module: nn.Module, name: str, copied: TensorCopy) -> None:
    kind = "buffer" if copied.is_buffer else "tensor attribute"
    tensor = _put_bytes(copied, f"{kind} {name!r} of {type(module).__name__}")
    if copied.is_buffer:
        module._buffers[name] = tensor
    else:
        setattr(module, name, tensor)


def _put_bytes(copied: TensorCopy, what: str) -> torch.Tensor:
    """Copy ``copied``'s bytes back into its tensor (keeping its version counter); the tensor that holds them."""
    tensor, value = copied.tensor, copied.value
    if value is NOT_COPIED:
        if tensor._version != copied.version:  # left alone by earlier forwards, changed by this one
            raise TbaError(f"{what} was changed by a recomputation although the layer's first forward left it alone, "
                           "and tba kept no copy to restore; keep or offload this layer instead of recomputing it")
        return tensor
    if tensor.shape != value.shape or tensor.dtype != value.dtype:
        return value.clone()  # resized in place: a new tensor holds the bytes
    # Note [Side effects of a recomputed forward]: the copy keeps the version counter.
    with _unsafe_preserve_version_counter(tensor):
        tensor.copy_(value)
    return tensor


def held_items(container: Any) -> Any:
    """What a container attribute holds: a dict's values, else its items."""
    return container.values() if isinstance(container, dict) else container


class FirstCall:
    """What the first call of a recomputed layer's forward left for its recomputation: the generators' states and
    the state it started from (Note [Side effects of a recomputed forward]), and the versions to check (Note [A
    recomputed layer's parameters must not change before backward])."""

    __slots__ = ("generators", "before", "versions", "changed")

    def __init__(self) -> None:
        self.generators: dict[int, tuple[Any, Any]] = {}
        self.before: list[ModuleState] = []
        self.versions: list[tuple[str, torch.Tensor, int]] = []
        self.changed: list[tuple[str, torch.Tensor, torch.Tensor]] = []
        """``(name, parameter, its value after the first call)`` for each parameter that call changed in place."""

    def note_parameters(self, before: list[tuple[str, torch.Tensor, int]]) -> None:
        """After the first call: keep the values of the parameters it changed in place (``before``: name, parameter,
        version before the call; Note [A recomputed layer that changes its own parameters])."""
        self.changed = [(name, p, p.detach().clone()) for name, p, version in before if p._version != version]

    def check_recomputed_parameters(self, layer: nn.Module) -> None:
        """After the recomputation: raise :class:`TbaError` when it left a parameter the first call changed at
        another value, which it then computed with; that value is put back first.

        Note: [A recomputed layer that changes its own parameters]
        A forward may change its own weights in place before using them: a clamp, a max-norm
        constraint that divides a weight, ``nn.Embedding(max_norm=...)``, which renormalises the rows
        it looks up. The recomputation starts from the weights the first call left, and changes them
        again. When the second change leaves every value as it was (a clamp), the recomputation
        computes with the values the first call computed with, and gradients are exact; when it does
        not (a weight divided by its norm times 1.01, or an embedding row whose renormalised norm
        rounds to just above ``max_norm``), it computes another forward, and gradients were wrong
        without a word. The first call copies only the parameters it changed, and the recomputation
        compares them when it is done. The adaptive default never plans to recompute such a layer
        (its profiled steps see the change: ``tba/runtime/_timer.py``).
        """
        for name, parameter, value in self.changed:
            if not torch.equal(parameter, value):
                with torch.no_grad(), _unsafe_preserve_version_counter(parameter):
                    parameter.copy_(value)
                raise TbaError(
                    f"the forward of a recomputed layer ({type(layer).__name__}) changes its parameter {name!r} in "
                    "place, and its recomputation changed it to another value than the first forward did (a max-norm "
                    "constraint that is not idempotent, say): it would compute another forward than the one being "
                    "differentiated; keep or offload this layer instead of recomputing it")

    def settle(self, layer: nn.Module, learned: Learned) -> None:
        """After the first call: learn what it changed, keep copies of that only, and record the versions to check.

        Raises:
            TbaError: the call added or removed submodules, or changed a state tensor earlier forwards left alone.
        """
        if [id(m) for m in layer.modules()] != [id(state.module) for state in self.before]:
            raise TbaError(f"the forward of a recomputed layer ({type(layer).__name__}) added or removed submodules: "
                           "its recomputation would run another model; keep or offload this layer, or run one forward "
                           "of the model before offloading with a plan that recomputes it")
        for state in self.before:
            module = state.module
            found = [((module._buffers.get(name) if copied.is_buffer else vars(module).get(name)), copied,
                      (id(module), name, state.training), f"{'buffer' if copied.is_buffer else 'tensor attribute'} {name!r}")
                     for name, copied in state.tensors.items()]
            found += [(copied.tensor, copied, key, f"tensor {key[1]}") for key, copied in state.items]
            for now, copied, key, what in found:
                # Some kernels update a tensor without bumping its version (BatchNorm's running statistics, and any
                # update through ``.data``), so the bytes are compared too, on the first forward watched.
                same = now is copied.tensor and now._version == copied.version
                if copied.value is NOT_COPIED:
                    if not same:
                        learned.unchanged.discard(key)
                        raise TbaError(f"{what} of a recomputed layer ({type(layer).__name__}) was changed by this "
                                       "forward, which earlier forwards left alone, and tba kept no copy to recompute "
                                       "from; from the next forward on tba copies it: run the step again (with a new "
                                       "Offloader, since this block raised), or keep or offload the layer")
                    self.versions.append((f"{what} of {type(module).__name__}", now, copied.version))
                elif key in learned.changed:
                    continue
                elif same and torch.equal(now, copied.value):
                    learned.unchanged.add(key)
                    self.versions.append((f"{what} of {type(module).__name__}", now, copied.version))
                    copied.value = NOT_COPIED
                else:
                    learned.changed.add(key)
        self.versions += [(f"parameter {name!r}", p, p._version) for name, p in layer.named_parameters()]

    def check_unchanged(self, layer: nn.Module) -> None:
        """Raise :class:`TbaError` when a parameter (or a state tensor whose value was not kept) changed in place
        since the first call (Note [A recomputed layer's parameters must not change before backward])."""
        for what, tensor, version in self.versions:
            if tensor._version != version:
                raise TbaError(
                    f"{what} of a recomputed layer ({type(layer).__name__}) was modified in place after its "
                    f"forward (version {version}, now {tensor._version}): recomputing the layer in backward would "
                    "give the gradients of another forward. Change it after backward (optimizer.step() after "
                    "loss.backward()), or keep or offload this layer instead of recomputing it")

    def recomputed(self) -> None:
        """After a recomputation: what it bumped itself (an embedding's ``max_norm`` renormalises its weight in every
        forward) is not a change made outside, which only a later recomputation (``retain_graph``) would check."""
        self.versions = [(what, tensor, tensor._version) for what, tensor, _ in self.versions]
