"""What the forwards of each recomputed layer were seen to do to its state tensors, per layer, while it lives.

A recomputed layer's snapshot copies a state tensor's bytes unless a watched forward left it alone
(Note [Side effects of a recomputed forward] in ``tba/runtime/_layer_state.py``); this module keeps that
knowledge per layer.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import weakref

from torch import nn

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


_learned: dict[int, tuple[weakref.ref, Learned]] = {}
_learned_lock = [threading.Lock(), os.getpid()]


def learned_for(layer: nn.Module) -> Learned:
    """The :class:`Learned` of ``layer``, kept while it lives (plain weak references, no callbacks).

    Backward may recompute on another thread (a GPU's autograd worker) while forward runs: the dict is
    rebuilt under a lock and swapped in, never changed in place, as in Note [A registry that threads
    and the collector can share] in ``tba/_weak.py``.
    """
    global _learned
    found = _learned.get(id(layer))
    if found is not None and found[0]() is layer:
        return found[1]
    if _learned_lock[1] != os.getpid():  # a fork's child: the parent's lock may be held for good
        _learned_lock[:] = [threading.Lock(), os.getpid()]
    with _learned_lock[0]:
        found = _learned.get(id(layer))
        if found is not None and found[0]() is layer:
            return found[1]
        learned = Learned()
        fresh = {key: value for key, value in _learned.items() if value[0]() is not None}
        fresh[id(layer)] = (weakref.ref(layer), learned)
        _learned = fresh
    return learned
