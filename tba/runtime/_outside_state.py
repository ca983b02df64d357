"""The modules outside a recomputed layer that its first call runs: their state copied and put back as the layer's own.

Note: [A recomputation puts back the modules outside its layer that it calls]
A layer's forward may call a module that is not among its ``modules()``: a BatchNorm the blocks share through a list,
or one set with ``object.__setattr__``. Under a plan that recomputes the layer, the recomputation ran that module again
from the state the later forwards had left, and updated it a second time: the running statistics of a BatchNorm shared
by three recomputed blocks counted 18 batches where training without tba counted 9, and the next steps normalised with
them, with no error (the adaptive default does not recompute such a layer: Note [A recomputed forward reaches beyond
its layer] in ``tba/runtime/_outside.py``; a pinned plan did).

So while a recomputed layer's first call runs, a global module pre-hook (registered only then, and only heard on the
calling thread) takes the state of each module outside the layer just before its first call, with its submodules
that are not the layer's, as :func:`~tba.runtime._layer_state.snapshot` takes the layer's own. The first call's
bookkeeping treats those states as the layer's (``tba/runtime/_first_call.py``: what it left alone is watched, what
it changed is kept), and the recomputation loads them before it runs and puts the present state back after it, as for
the layer's own modules (Note [Side effects of a recomputed forward] in ``tba/runtime/_layer_state.py``). Their
parameters are watched as the layer's are (Note [A recomputed layer's parameters must not change before backward]):
one the module changes in place as it runs (``self.bias.add_(0.01)`` after use) raises right after the first call
(Note [A recomputed layer that changes its own parameters]), and the recomputation runs with the tensors its
parameter slots held (Note [A recomputation runs with the parameters its first call ran with]): under
``torch.func.functional_call`` of the whole model, the recomputation of a block calling the model's own norm read the
norm's own weights, not the ones given, and both gave other gradients than training without tba, silently
(helper-103 found them). Their private state and the objects nested in their public attributes are the layer's too
(Note [Private state of a recomputed layer] and Note [Nested state a recomputation is given back] in
``tba/runtime/_private_state.py``), their signature taken as each group is: a private counter (``self._n += 1``) the
module read raises right after the first call, a list in a public dict is put back for the recomputation; both were
recomputed from what the first call left, silently (a shared module's counter 18 where training without tba counted 9).

Each first call registers a hook of its own (:meth:`OutsideModules.start`, inside the ``try``) and takes it out in
its ``finally`` through one C call (``OutsideModules.stop``, a ``functools.partial`` of the hooks dict's ``pop``, which
finds nothing when the hook never went in): no Python frame starts there, so no signal handler's exception can skip it
(Note [An exit that always runs] in ``tba/_whole_exit.py``), and no lock is shared. A first version counted the first
calls of every thread under a Python-level lock: an exception raised as its ``__exit__`` began left the lock held, and
the next recomputed layer waited for ever (``tests/runtime/test_exception_at_every_call.py``). The object is made
before the ``try`` and registers nothing: CPython runs pending signal handlers when a call of a class returns, and a
hook registered in ``__init__`` was left registered by a handler's exception raised there, before the ``try`` began,
snapshotting and holding every module the thread ran from then on (helper-103 found it).

Not covered: a module the forward changes without calling it (``self.refs[0].running_mean.mul_(0.9)``), and a layer
that is compiled or holds a compiled module: Dynamo traces the module calls inside without the hook (whose guards a
hook registered and removed around each call would invalidate), and ``torch.compile``'s wrapper warns when it is
called while any global module hook is registered.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn.modules import module as module_hooks
from torch.utils.hooks import RemovableHandle

from tba.runtime._compiling import compiling
from tba.runtime._generators import held_generator_states
from tba.runtime._layer_state import ModuleState, snapshot
from tba.runtime._learned import Learned
from tba.runtime._private_state import Signature, check_watchable, modules_state

if TYPE_CHECKING:
    from tba.runtime._first_call import FirstCall
    from tba.runtime._overlap import Use


class OutsideModules:
    """The state of the modules outside one layer that its first call ran, each taken before its first call there.

    Made right before the first call; :meth:`start` registers its hook and :attr:`stop` (a C callable) takes it out.
    """

    __slots__ = ("_own", "_learned", "_use", "_seen", "_thread", "_key", "states", "parameters", "slots", "groups",
                 "generators", "private", "stop", "__weakref__")

    def __init__(self, layer: nn.Module, learned: Learned, use: Use) -> None:
        self._own = frozenset(map(id, layer.modules()))
        self._learned = learned
        self._use = use
        self._seen: set[int] = set()
        self._thread = threading.get_ident()
        self.states: list[ModuleState] = []
        self.parameters: list[tuple[str, torch.Tensor, int]] = []
        """``(what, parameter, version)`` of each parameter of those modules before its first call there."""
        self.slots: list[tuple[nn.Module, str, torch.Tensor | None]] = []
        """``(module, name, tensor)`` of each of their parameter slots then (``torch.func.functional_call``'s tensors)."""
        self.groups: list[list[nn.Module]] = []
        """The modules taken at each call heard (the module called, with its submodules not taken before)."""
        self.generators: dict[int, tuple[Any, Any]] = {}
        """The generators those modules hold, each with its state before its module's first call there."""
        self.private = Signature()
        """The signature of their private and nested state (``tba/runtime/_private_state.py``), each group's then."""
        hooks = module_hooks._global_forward_pre_hooks
        self._key = RemovableHandle(hooks).id
        self.stop = functools.partial(hooks.pop, self._key, None)

    def start(self) -> None:
        """Register the hook: called inside the ``try`` whose ``finally`` calls :attr:`stop`."""
        module_hooks._global_forward_pre_hooks[self._key] = self._called

    def _called(self, module: nn.Module, args: object) -> None:
        """The global pre-hook: ``module`` is about to run."""
        if threading.get_ident() != self._thread or compiling():
            return
        if id(module) in self._own or id(module) in self._seen:
            return
        new = [sub for sub in module.modules() if id(sub) not in self._own and id(sub) not in self._seen]
        self._seen.update(map(id, new))
        self._use.add(new)  # Note [A recomputation and a first call of its state in two threads] in tba/runtime/_overlap.py
        for sub in new:  # Note [What a layer learned of a module outside it goes with that module] in tba/runtime/_learned.py
            self._learned.meet(sub)
        self.states += snapshot(new, self._learned)
        self.generators.update(held_generator_states(new, self.generators))  # Note [Generators of a recomputed layer]
        self.groups.append(new)
        self.private.add(modules_state(new))
        for sub in new:
            self.slots += [(sub, name, p) for name, p in sub._parameters.items()]
            self.parameters += [(f"parameter {name!r} of {type(sub).__name__} (outside the layer, which its forward calls)",
                                 p, p._version) for name, p in sub._parameters.items() if p is not None]


def first_call(layer: nn.Module, learned: Learned, first: FirstCall, private: Signature, forward: Callable[..., Any],
               args: tuple, kwargs: dict[str, Any], use: Use) -> Any:
    """Run a recomputed layer's first call, ``forward(*args, **kwargs)``, with the modules outside the layer that it runs
    watched; then their state is ``first``'s and their private and nested state ``private``'s, as the layer's own, and
    they are ``use``'s."""
    outside = OutsideModules(layer, learned, use)
    try:
        outside.start()  # inside the try: an exception as it returns still stops it
        out = forward(*args, **kwargs)
    finally:
        outside.stop()
    first.add_outside(outside.states, outside.parameters, outside.slots, outside.groups)
    for key, state in outside.generators.items():
        first.generators.setdefault(key, state)
    check_watchable(layer, outside.private.deep)
    private.add(outside.private)
    return out


def _after_fork_in_child() -> None:
    """A first call of another thread of the parent never ends in the child: its hook goes."""
    hooks = module_hooks._global_forward_pre_hooks
    for key, hook in list(hooks.items()):
        owner = getattr(hook, "__self__", None)
        if isinstance(owner, OutsideModules) and owner._thread != threading.get_ident():
            hooks.pop(key, None)


os.register_at_fork(after_in_child=_after_fork_in_child)
