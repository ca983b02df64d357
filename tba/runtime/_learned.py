"""What the forwards of each recomputed layer were seen to do to its state tensors, per layer, while it lives.

A recomputed layer's snapshot copies a state tensor's bytes unless a watched forward left it alone
(Note [Side effects of a recomputed forward] in ``tba/runtime/_layer_state.py``); this module keeps that
knowledge per layer.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from tba._weak import WeakRegistry

Key = tuple[int, str, bool]
"""A state tensor: the identity of its module, its name there, and whether the module was training (a norm layer
updates its statistics in training mode only)."""


@dataclasses.dataclass
class Learned:
    """What the forwards of one recomputed layer were seen to do to its state tensors (Note [Side effects of a
    recomputed forward] in ``tba/runtime/_layer_state.py``); empty until its first forward has been watched."""

    changed: set[Key] = dataclasses.field(default_factory=set)
    unchanged: set[Key] = dataclasses.field(default_factory=set)

    def copies(self, key: Key) -> bool:
        """Whether a snapshot copies this tensor's bytes: unless a forward was seen to leave it alone."""
        return key not in self.unchanged


_learned = WeakRegistry()


def learned_for(layer: nn.Module) -> Learned:
    """The :class:`Learned` of ``layer``, kept while it lives (plain weak references, no callbacks).

    Backward may recompute on another thread (a GPU's autograd worker) while forward runs; the
    registry is safe for that (Note [A registry that threads and the collector can share] in
    ``tba/_weak.py``).
    """
    return _learned.value_for(layer, Learned)
