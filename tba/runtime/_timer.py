"""Per-layer timings of a real step, for the adaptive policy's profile (``tba.policy.Profile``).

Hooks that change nothing:

* forward: a forward pre-hook and a forward hook on every layer take ``time.perf_counter()``;
* backward (measured, not estimated): the pre-hook puts a gradient hook on the layer's input and
  the forward hook one on its output; ``b_i`` is the time between the gradient reaching the
  layer's output and reaching its input. Where a layer's input or output does not require grad,
  nothing is measured and the profile says so (``backward_measured=False``).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn


def tensor_bytes(values: Sequence[Any]) -> int:
    """Bytes of the distinct storages of the tensors among ``values``."""
    seen: dict[int, int] = {}
    for value in values:
        if isinstance(value, torch.Tensor):
            storage = value.untyped_storage()
            seen[storage._cdata] = storage.nbytes()
    return sum(seen.values())


class LayerTimer:
    """Forward and backward wall-clock time and input bytes of each layer, for one step at a time."""

    def __init__(self, layers: Sequence[nn.Module]) -> None:
        self._layer_refs = [weakref.ref(layer) for layer in layers]
        self._handles: list[Any] = []
        self.reset()

    def reset(self) -> None:
        count = len(self._layer_refs)
        self.forward_s: list[float | None] = [None] * count
        self.input_bytes = [0] * count
        self._started = [0.0] * count
        self._grad_at_output: list[float | None] = [None] * count
        self._grad_at_input: list[float | None] = [None] * count

    def attach(self) -> None:
        for index, ref in enumerate(self._layer_refs):
            layer = ref()
            if layer is None:
                continue
            self._handles.append(layer.register_forward_pre_hook(self._pre(index)))
            self._handles.append(layer.register_forward_hook(self._post(index)))

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _pre(self, index: int):
        def hook(module: nn.Module, args: tuple) -> None:
            self.input_bytes[index] = tensor_bytes(args)
            first = next((a for a in args if isinstance(a, torch.Tensor)), None)
            if first is not None and first.requires_grad:
                first.register_hook(self._stamp(self._grad_at_input, index))
            self._started[index] = time.perf_counter()

        return hook

    def _post(self, index: int):
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            self.forward_s[index] = time.perf_counter() - self._started[index]
            first = output if isinstance(output, torch.Tensor) else None
            if isinstance(output, (tuple, list)):
                first = next((o for o in output if isinstance(o, torch.Tensor)), None)
            if first is not None and first.requires_grad:
                first.register_hook(self._stamp(self._grad_at_output, index))

        return hook

    @staticmethod
    def _stamp(slots: list, index: int):
        def hook(grad: torch.Tensor) -> None:
            if slots[index] is None:
                slots[index] = time.perf_counter()

        return hook

    def backward_s(self) -> list[float | None]:
        """Per layer: seconds from the gradient reaching its output to reaching its input, or None."""
        out = []
        for at_output, at_input in zip(self._grad_at_output, self._grad_at_input):
            out.append(at_input - at_output if at_output is not None and at_input is not None else None)
        return out
