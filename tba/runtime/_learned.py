"""What the forwards of each recomputed layer were seen to do to its state tensors, per layer, while it lives.

A recomputed layer's snapshot copies a state tensor's bytes unless a watched forward left it alone
(Note [Side effects of a recomputed forward] in ``tba/runtime/_layer_state.py``); this module keeps that
knowledge per layer.

Note: [What a layer learned of a module outside it goes with that module]
A recomputed layer's forward may call modules outside it, whose state tensors are watched as the layer's (Note [A
recomputation puts back the modules outside its layer that it calls] in ``tba/runtime/_outside_state.py``), under
keys holding the module's identity. Such a module may be made anew by each forward (``Rotary(dim)(x)``): a key per step
was added to the layer's sets for as long as the layer lived (helper-103 found them growing by one a step), and a new
module given a dead one's identity inherited what was learned of it (a buffer that one left alone was not copied; one
the new module changes then raised a :class:`~tba.errors.TbaError` telling to run the step again). So
:meth:`Learned.meet` holds a plain weak reference to each outside module met, forgets what was learned under an
identity when it meets another module there, and forgets the dead ones each time their number has doubled.
"""

from __future__ import annotations

import dataclasses
import weakref

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
    outside: dict[int, weakref.ref] = dataclasses.field(default_factory=dict)
    """The modules outside the layer that its forwards called, by identity (Note [What a layer learned of a module
    outside it goes with that module])."""
    bound: int = 64
    """How many of those before the dead ones are forgotten."""

    def meet(self, module: nn.Module) -> None:
        """``module``, outside the layer, is called by its forward: what was learned of another module with its identity
        is forgotten, and of the dead ones once there are :attr:`bound` (Note [What a layer learned of a module outside
        it goes with that module])."""
        known = self.outside.get(id(module))
        if known is not None and known() is module:
            return
        self._forget({id(module)})
        self.outside[id(module)] = weakref.ref(module)
        if len(self.outside) > self.bound:
            dead = {identity for identity, ref in list(self.outside.items()) if ref() is None}
            for identity in dead:
                del self.outside[identity]
            self._forget(dead)
            self.bound = max(64, 2 * len(self.outside))

    def _forget(self, identities: set[int]) -> None:
        for keys in (self.changed, self.unchanged):
            keys.difference_update([key for key in list(keys) if key[0] in identities])

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
