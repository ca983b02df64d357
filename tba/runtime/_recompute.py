"""Recompute chosen layers in backward with non-reentrant ``torch.utils.checkpoint``.

A recomputed layer saves only its inputs during forward; its internals are computed again in
backward. Non-reentrant checkpoint installs its own saved-tensor hooks inside the layer, which
take precedence over tba's, so nothing inside a recomputed layer reaches the offloader, while the
layer's input is still saved through tba (and may be offloaded). RNG state is preserved, so
dropout masks are identical in the recomputation.

Note: [Side effects of a recomputed forward]
The second forward must not change the model a second time. Buffers a forward updates in place
(BatchNorm's running statistics and ``num_batches_tracked``) and plain attributes it assigns (a
call counter) would otherwise end as after two forwards. So the wrapper tells the first call of
``forward`` from the recomputation (checkpoint calls the same function again during backward);
around the recomputation it snapshots every buffer and every plain attribute of the layer's
modules, and restores them afterwards, bit for bit. The recomputed outputs are unaffected: in
training mode BatchNorm normalises with the batch's statistics, not the running ones.

Note: [Generators of a recomputed layer]
Checkpoint preserves the global RNG states only. A layer that draws from a ``torch.Generator`` of
its own (held as an attribute of one of its modules) would draw a different mask in the
recomputation, so its gradients would be those of another forward, and the generator would end
advanced twice. The wrapper records each such generator's state before the first forward, sets it
back before the recomputation and, afterwards, restores the state the first forward left.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from tba.errors import TbaConfigError

_PLAIN_TYPES = (int, float, bool, str, bytes, type(None))


class RecomputeLayers:
    """Wraps ``layers``' forward with checkpoint until :meth:`remove` (or the ``with`` block ends).

    Raises:
        TbaConfigError: a layer already has a ``forward`` attribute of its own (patched by hand or by
            another tool): wrapping it would hide that one.
    """

    def __init__(self, layers: Iterable[nn.Module], indices: Iterable[int] | None = None) -> None:
        layers = list(layers)
        indices = list(indices) if indices is not None else list(range(len(layers)))
        for index, layer in zip(indices, layers):
            if "forward" in vars(layer):
                raise TbaConfigError(
                    f"layer {index} ({type(layer).__name__}) has a forward set on the instance, which the plan "
                    "would recompute: tba wraps the class's forward for recomputation and cannot wrap a patched "
                    "one; remove the instance attribute (del layer.forward), or keep or offload that layer")
        self.layers = layers
        for layer in self.layers:
            layer.forward = _checkpointed(layer, layer.forward)

    def remove(self) -> None:
        for layer in self.layers:
            if "forward" in vars(layer):
                del layer.forward
        self.layers = []

    def __enter__(self) -> RecomputeLayers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def _checkpointed(layer: nn.Module, forward: Any) -> Any:
    def first_or_again(calls: list[int], first_states: dict[int, tuple[torch.Generator, torch.Tensor]],
                       *args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == 1:
            first_states.update(_generator_states(layer))
            return forward(*args, **kwargs)
        saved = _snapshot(layer)
        after = _generator_states(layer)
        for generator, state in first_states.values():
            generator.set_state(state)
        try:
            return forward(*args, **kwargs)
        finally:
            _restore(layer, saved)
            for generator, state in after.values():
                generator.set_state(state)

    def run(*args: Any, **kwargs: Any) -> Any:
        calls: list[int] = [0]
        first_states: dict[int, tuple[torch.Generator, torch.Tensor]] = {}
        return checkpoint(first_or_again, calls, first_states, *args, use_reentrant=False, **kwargs)

    return run


def _generator_states(layer: nn.Module) -> dict[int, tuple[torch.Generator, torch.Tensor]]:
    """Each ``torch.Generator`` held by ``layer``'s modules, with its state (Note [Generators of a recomputed layer])."""
    states = {}
    for module in layer.modules():
        for value in vars(module).values():
            if isinstance(value, torch.Generator) and id(value) not in states:
                states[id(value)] = (value, value.get_state())
    return states


def _snapshot(layer: nn.Module) -> list[tuple[nn.Module, dict[str, torch.Tensor], dict[str, Any]]]:
    """Every buffer's bytes and every plain attribute of ``layer``'s modules (Note [Side effects of a recomputed forward])."""
    saved = []
    for module in layer.modules():
        buffers = {name: value.detach().clone() for name, value in module._buffers.items() if value is not None}
        plain = {name: copy.copy(value) for name, value in vars(module).items()
                 if not name.startswith("_") and isinstance(value, _PLAIN_TYPES)}
        saved.append((module, buffers, plain))
    return saved


def _restore(layer: nn.Module, saved: list[tuple[nn.Module, dict[str, torch.Tensor], dict[str, Any]]]) -> None:
    with torch.no_grad():
        for module, buffers, plain in saved:
            for name, value in buffers.items():
                current = module._buffers.get(name)
                if current is not None and current.shape == value.shape:
                    current.copy_(value)
                else:
                    module._buffers[name] = value
            for name, value in plain.items():
                setattr(module, name, value)
