"""An input shape: the shapes and dtypes of the tensors a step's first layer is given (:func:`signature`), and
whether one covers another (:func:`covers`); :class:`~tba.runtime._input_shapes.InputShapes` plans per shape."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["CONTAINER_DEPTH", "covers", "signature", "tensors_in"]


def _entry(tensor: torch.Tensor) -> tuple:
    """A tensor's shape and dtype. A nested tensor has no ``shape`` (an encoder's fast path in eval hands one to its
    layers): its entry is its number of pieces and their largest size in each dimension, with a dtype entry that
    tells it from a plain tensor's, so that :func:`covers` never compares the two."""
    if not tensor.is_nested:
        return tuple(tensor.shape), tensor.dtype
    sizes = [tuple(piece.shape) for piece in tensor.unbind()]
    return (len(sizes), *(max(dims) for dims in zip(*sizes))), ("nested", tensor.dtype)


CONTAINER_DEPTH = 4
"""How deep :func:`signature` looks into the tuples, lists, dicts and dataclasses a layer is given."""


def tensors_in(value: Any, depth: int = CONTAINER_DEPTH) -> Iterator[torch.Tensor]:
    """The tensors in ``value``: itself, or those in the tuples, lists, dicts and dataclasses it holds (``depth`` deep)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif depth <= 0:
        return
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from tensors_in(item, depth - 1)
    elif isinstance(value, dict):
        for item in value.values():
            yield from tensors_in(item, depth - 1)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            yield from tensors_in(getattr(value, field.name, None), depth - 1)


def signature(args: tuple, kwargs: dict[str, Any]) -> tuple:
    """The shapes and dtypes of the tensors among a layer's arguments, in order: the step's input shape.

    Note: [An input shape is read inside containers]
    Only the top-level tensor arguments were read, so blocks chained by ``nn.Sequential`` with a
    ``(hidden, mask)`` tuple, or given a list, a dict or a dataclass of tensors, had the shape ``()`` at
    every batch size: the plan made for the profiled batch ran as its own at any larger one, keeping
    everything it kept there, past a memory budget planned for the smaller batch. The tensors in such
    containers (:data:`CONTAINER_DEPTH` deep) count too, in their order.
    """
    values = [*args, *(kwargs[name] for name in sorted(kwargs))]
    return tuple(_entry(tensor) for value in values for tensor in tensors_in(value))


def covers(big: tuple, small: tuple) -> bool:
    """Whether input shape ``big`` is at least ``small`` in every dimension of every tensor (the same
    tensors, dtypes and ranks)."""
    return len(big) == len(small) and all(
        big_dtype == small_dtype and len(big_size) == len(small_size) and all(b >= s for b, s in zip(big_size, small_size))
        for (big_size, big_dtype), (small_size, small_dtype) in zip(big, small))
