"""Putting a recomputed layer's state back: the copies :func:`~tba.runtime._layer_state.snapshot` took, written
into the objects the layer holds, or into new ones where tba may not write (Note [Side effects of a recomputed
forward] in ``tba/runtime/_layer_state.py`` says what is copied and when this runs).

Note: [A rebound tensor is not written back]
A forward may rebind a state tensor rather than update it (``self.gate = self.gate * 0.99``): the
state the first call started from then holds an object the layer no longer holds, often the user's
own (``block.gate = my_gate``). Loading that state wrote the old bytes into that object, and the copy
back after the recomputation covers only what the layer holds now: a change the user made to their
tensor between forward and backward was silently undone (helper-93 found ``my_gate.fill_(7)`` ending
as ones under ``recompute``). So :func:`restore` writes only into a tensor or numpy array whose
present bytes it copied and writes back after the recomputation; in place of any other it puts a new
one holding the old bytes (in the attribute, buffer, container or tuple that held it; one per
object, ``requires_grad`` kept), which the recomputation reads, and the object is left alone.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.autograd.grad_mode import _unsafe_preserve_version_counter

from tba.errors import TbaError
from tba.runtime._layer_state import NOT_COPIED, ModuleState, TensorCopy
from tba.runtime._state_objects import refill


def restore(current: list[ModuleState], target: list[ModuleState]) -> None:
    """Put ``target``'s state back into its modules; ``current`` is a snapshot of the state now. A tensor or numpy
    array that ``current`` does not write back goes back as a copy (Note [A rebound tensor is not written back])."""
    now_of = {id(state.module): state for state in current}
    kept = _kept_now(current)
    with torch.no_grad():
        fresh = _fresh_copies(target, kept)
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
                _put_tensor(module, name, copied, fresh)
            for name, value in then.plain.items():
                setattr(module, name, _swapped_tuple(value, fresh) if isinstance(value, tuple) and fresh else value)
            for name, (container, contents) in then.containers.items():
                if getattr(module, name, None) is not container:
                    setattr(module, name, container)
                # Note [A container refilled in place] in tba/runtime/_state_objects.py
                refill(container, [(key, fresh.get(id(item), item)) for key, item in contents.items()]
                       if isinstance(container, dict) else [fresh.get(id(item), item) for item in contents])
            for (_, name, _), copied in then.items:
                if id(copied.tensor) not in fresh:
                    _put_bytes(copied, f"tensor {name} of {type(module).__name__}")
            for name, (array, contents) in then.arrays.items():
                if id(array) in fresh:  # Note [A rebound tensor is not written back]
                    if not name.endswith("]"):
                        setattr(module, name, fresh[id(array)])
                    continue
                if name.endswith("]"):  # held in a container, put back above: its bytes go back in place
                    array[...] = contents
                    continue
                if getattr(module, name, None) is not array:
                    setattr(module, name, array)
                if array.shape == contents.shape and array.dtype == contents.dtype:
                    array[...] = contents
                else:
                    setattr(module, name, contents.copy())


def _kept_now(current: list[ModuleState]) -> set[int]:
    """The identities of the tensors whose bytes ``current`` keeps a copy of, and of its numpy arrays (all copied):
    those that restoring ``current`` writes back."""
    kept = {id(array) for state in current for array, _ in state.arrays.values()}
    for state in current:
        for copied in [*state.tensors.values(), *(copied for _, copied in state.items)]:
            if copied.value is not NOT_COPIED:
                kept.add(id(copied.tensor))
    return kept


def _fresh_copies(target: list[ModuleState], kept: set[int]) -> dict[int, Any]:
    """By identity, a new tensor or array holding the bytes ``target`` keeps of each one whose bytes now tba would
    not write back (not in ``kept``; Note [A rebound tensor is not written back]); one per object, so what held the
    same object holds the same copy."""
    fresh: dict[int, Any] = {}
    for state in target:
        for copied in [*state.tensors.values(), *(copied for _, copied in state.items)]:
            if copied.value is not NOT_COPIED and id(copied.tensor) not in kept and id(copied.tensor) not in fresh:
                fresh[id(copied.tensor)] = _fresh(copied)
        for array, contents in state.arrays.values():
            if id(array) not in kept and id(array) not in fresh:
                fresh[id(array)] = contents.copy()
    return fresh


def _fresh(copied: TensorCopy) -> torch.Tensor:
    """A new tensor holding ``copied``'s bytes, to stand for a tensor tba may not write into."""
    tensor = copied.value.clone()
    return tensor.requires_grad_() if copied.tensor.requires_grad else tensor


def _swapped_tuple(value: tuple, fresh: dict[int, Any]) -> tuple:
    """``value`` with each item in ``fresh`` (by identity) replaced, or ``value`` itself when none is."""
    if not any(id(item) in fresh for item in value):
        return value
    items = [fresh.get(id(item), item) for item in value]
    return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)


def _attribute_tensors(state: ModuleState) -> set[str]:
    return {name for name, copied in state.tensors.items() if not copied.is_buffer}


def _put_tensor(module: nn.Module, name: str, copied: TensorCopy, fresh: dict[int, Any]) -> None:
    kind = "buffer" if copied.is_buffer else "tensor attribute"
    tensor = fresh.get(id(copied.tensor))  # Note [A rebound tensor is not written back]
    if tensor is None:
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
