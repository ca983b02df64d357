"""Recompute chosen layers in backward with non-reentrant ``torch.utils.checkpoint``.

A recomputed layer saves only its inputs during forward; its internals are computed again in
backward. Non-reentrant checkpoint installs its own saved-tensor hooks inside the layer, which
take precedence over tba's, so nothing inside a recomputed layer reaches the offloader, while the
layer's input is still saved through tba (and may be offloaded). RNG state is preserved, so
dropout masks are identical in the recomputation.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn
from torch.utils.checkpoint import checkpoint


class RecomputeLayers:
    """Wraps ``layers``' forward with checkpoint until :meth:`remove` (or the ``with`` block ends)."""

    def __init__(self, layers: Iterable[nn.Module]) -> None:
        self.layers = list(layers)
        for layer in self.layers:
            if "forward" in vars(layer):
                raise ValueError(f"{type(layer).__name__} already has a patched forward; remove that first")
            original = layer.forward
            layer.forward = _checkpointed(original)

    def remove(self) -> None:
        for layer in self.layers:
            if "forward" in vars(layer):
                del layer.forward
        self.layers = []

    def __enter__(self) -> RecomputeLayers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def _checkpointed(forward):
    def run(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run
