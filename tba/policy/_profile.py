"""What the planner knows about a model: per-layer costs and the disk's bandwidth.

A :class:`Profile` is plain data (JSON round-trip): per layer ``i`` its forward time ``f_i``, the
bytes of distinct storages it saves for backward ``s_i`` (after dedup, as tba would write them),
the bytes of its inputs ``x_i`` (what a recomputed layer still holds) and its backward time
``b_i``; plus the engine's write and read bandwidth and the largest single storage.

:class:`LayerTimer` measures the timings during a real step, with hooks that change nothing:

* forward: a forward pre-hook and a forward hook on every layer take ``time.perf_counter()``;
* backward (measured, not estimated): the pre-hook puts a gradient hook on the layer's input and
  the forward hook one on its output; ``b_i`` is the time between the gradient reaching the
  layer's output and reaching its input. Where a layer's input or output does not require grad,
  ``b_i`` is estimated as ``2 * f_i`` and the profile says so (``backward_measured=False``).

Times are wall-clock on the host; on CUDA they are only meaningful after a synchronising step and
count launch time, not kernel time (a known limitation). The bytes come from the offloader's own
accounting (``Offloader.layer_saved_bytes``) and the bandwidths from its stats.
"""

from __future__ import annotations

import dataclasses
import json
import time
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from tba.defaults import POLICY_MAX_WINDOW_BYTES

BACKWARD_ESTIMATE_FACTOR = 2.0


@dataclasses.dataclass(frozen=True)
class LayerProfile:
    """One layer's costs. Times in seconds, sizes in bytes."""

    forward_s: float
    saved_bytes: int
    input_bytes: int = 0
    backward_s: float | None = None
    backward_measured: bool = False

    def __post_init__(self) -> None:
        if self.backward_s is None:
            object.__setattr__(self, "backward_s", BACKWARD_ESTIMATE_FACTOR * self.forward_s)
            object.__setattr__(self, "backward_measured", False)


@dataclasses.dataclass(frozen=True)
class Profile:
    """Per-layer costs in forward order, and the I/O engine's speed.

    Attributes:
        layers: One :class:`LayerProfile` per layer, in forward order.
        write_bytes_per_s / read_bytes_per_s: Engine bandwidth to and from the spill file.
        max_storage_bytes: The largest single saved storage (a prefetch window must hold one).
        prefetch_depth_layers: Layers read ahead in backward, as configured on the offloader.
        max_window_bytes: The offloader's prefetch budget; a plan never sets a larger window.
    """

    layers: tuple[LayerProfile, ...]
    write_bytes_per_s: float
    read_bytes_per_s: float
    max_storage_bytes: int = 0
    prefetch_depth_layers: int = 1
    max_window_bytes: int = POLICY_MAX_WINDOW_BYTES

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))
        if not self.layers:
            raise ValueError("a profile needs at least one layer")
        if self.write_bytes_per_s <= 0 or self.read_bytes_per_s <= 0:
            raise ValueError("write_bytes_per_s and read_bytes_per_s must be > 0")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Profile:
        fields = dict(data)
        fields["layers"] = tuple(LayerProfile(**layer) for layer in fields["layers"])
        return cls(**fields)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_json(cls, text: str) -> Profile:
        return cls.from_dict(json.loads(text))


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
