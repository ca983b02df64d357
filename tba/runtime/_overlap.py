"""Which modules' state a first call or a recomputation of a recomputed layer is using, on which thread.

Note: [A recomputation and a first call of its state in two threads]
A recomputation loads the state its layer's first call started from into the modules it runs (the
layer's own, and those outside it that the first call ran: Note [A recomputation puts back the
modules outside its layer that it calls] in ``tba/runtime/_outside_state.py``), runs the forward,
and writes back the state it found (Note [Side effects of a recomputed forward] in
``tba/runtime/_layer_state.py``). Backward of step N run in a thread while the main thread runs the
forward of step N+1 let the first call of the same layer run in between: it read the loaded state
and its BatchNorm update was overwritten by the write back, or its snapshot took the loaded state.
The running statistics differed from training without tba, silently (gradients were equal); a
review found layers 4-5 of six differing.

Waiting would make it exact, but the thread holding a layer's state may be waiting for the other:
a forward that runs backward (forces as the gradient of an energy), whose recomputations run on
autograd's device thread under CUDA, or threads the program synchronises itself. So the overlap is
refused, on both threads. Each first call and each recomputation is a :class:`Use`: entered before
it looks at anything, it lists the ids of the modules it uses (a first call adds each module outside
its layer as it is called) and then looks for a running use of another thread that lists one of
them, where one of the two is a recomputation (two first calls, two forwards of one model at once,
race without tba too): one is found by whichever of the two lists second (set and dict operations
are atomic). That one raises :class:`~tba.errors.TbaError` before it touches the module, and marks
the other, which raises when it ends, so that the failure also reaches a training thread whose
backward thread failed. A recomputation is also a global forward pre-hook while it runs (unless a
compiled module is among its modules): a call of one of its modules on another thread through code
tba does not wrap (a kept layer calling a module a recomputed one shares, an evaluation after the
``with`` block) raises there, and marks the recomputation. A call of another module is not refused, though torch's
checkpoint and tba set the process's random generators to the first call's states for the
recomputation and back after it: dropout drawn meanwhile on another thread is replayed, then rewound
(Note [Generators of a recomputed layer] in ``tba/runtime/_generators.py``). Refusing every call in
training mode there (a first version) refused models that draw nothing from them, an evaluation or EMA
model run by another thread in training mode with BatchNorm (``tests/runtime/test_outside.py``), at
random, whenever a call met a recomputation. Without an overlap nothing changes: a first call wholly
before or after a recomputation is exact. An overlap is refused whatever the modules' state: which
state a forward changes is known only once it has run, so a layer with none (no buffers, no
dropout) is refused too, though its overlap was exact. A use of the same thread is not refused (a
recomputation inside a forward on one thread). A use ends through one C call, :attr:`Use.end`
(Note [An exit that always runs] in ``tba/_whole_exit.py``): no Python frame starts there for a
signal handler's exception. A child forked while another thread of the parent was in a use ends it:
that thread never does there.

Not covered: a call through code tba does not wrap that began before the recomputation and is still
running on the other thread when it starts, a module whose state is read or changed without calling
it, another thread's random draws from the global generators during a recomputation (above), a
recomputation of a layer holding a compiled module, which has no hook (only its own modules are
watched, by first calls), and two recomputations on two threads drawing from the same global
generator (the CPU's, Python's or numpy's; a CUDA device's is its own thread's under model
parallelism).
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Iterable

from torch import nn
from torch.nn.modules import module as module_hooks
from torch.utils.hooks import RemovableHandle

from tba.errors import TbaError
from tba.runtime._compiling import compiling

_uses: set[Use] = set()
"""The first calls running, and the recomputations of layers holding a compiled module, on every thread."""

_hooks = module_hooks._global_forward_pre_hooks
"""Where the other recomputations are: each registered as a global forward pre-hook while it runs."""


class Use:
    """A first call (``what="first call"``) or a recomputation of ``layer`` on the calling thread; :attr:`end` ends it.

    A recomputation is ``watch``-ed where no compiled module is among those it runs (Note [A recomputation puts back the
    modules outside its layer that it calls] in ``tba/runtime/_outside_state.py`` says why not there): it is then a global
    forward pre-hook, which refuses a call of one of its modules on another thread, through code tba does not wrap.
    """

    __slots__ = ("thread", "what", "layer", "modules", "clash", "_key", "end", "__weakref__")

    def __init__(self, what: str, layer: nn.Module, watch: bool = False) -> None:
        self.thread = threading.get_ident()
        self.what = what
        self.layer = type(layer).__name__
        self.modules: set[int] = set()
        self.clash = ""
        """The message to raise when this use ends: another thread's use of its modules was refused."""
        self._key = RemovableHandle(_hooks).id if watch else None
        self.end = functools.partial(_uses.discard, self) if self._key is None else functools.partial(_hooks.pop, self._key, None)

    def begin(self, modules: Iterable[nn.Module]) -> None:
        """Enter the use with ``modules``: called inside the ``try`` whose ``finally`` calls :attr:`end`."""
        if self._key is None:
            _uses.add(self)
        else:
            _hooks[self._key] = self._called
        self.add(modules)

    def add(self, modules: Iterable[nn.Module]) -> None:
        """The use also takes ``modules``; raise :class:`TbaError` when another thread's use holds one of them."""
        ids = [id(module) for module in modules]
        self.modules.update(ids)
        for other in _running():
            if other.thread != self.thread and "recomputation" in (self.what, other.what) and not other.modules.isdisjoint(ids):
                message = _message(self, other)
                other.clash = other.clash or message
                raise TbaError(message)

    def check(self) -> None:
        """Raise :class:`TbaError` when another thread's use of this one's modules was refused meanwhile."""
        if self.clash:
            raise TbaError(self.clash)

    def _called(self, module: nn.Module, args: object) -> None:
        """The global pre-hook of a watched recomputation: ``module`` is about to run, on some thread."""
        if compiling() or threading.get_ident() == self.thread or id(module) not in self.modules:
            return
        message = (f"a call of {type(module).__name__} in one thread overlapped the recomputation of a recomputed "
                   f"layer ({self.layer}) in another, which has put back the state of that module its forward started "
                   "from (BatchNorm's running statistics): the call would read it, and its updates be undone. Run the "
                   "backward before the next forward or evaluation, or in the same thread, or keep or offload these "
                   "layers instead of recomputing them")
        self.clash = self.clash or message
        raise TbaError(message)


def _running() -> list[Use]:
    """The uses running, on every thread."""
    hooks = [getattr(hook, "__self__", None) for hook in list(_hooks.values())]
    return [*list(_uses), *(use for use in hooks if isinstance(use, Use))]


def _message(new: Use, running: Use) -> str:
    first, again = (new, running) if new.what == "first call" else (running, new)
    return (f"the {again.what} of a recomputed layer ({again.layer}) in one thread overlapped the {first.what} of "
            f"{first.layer}, which uses the same modules' state, in another (backward of one step in a thread while "
            "the next forward runs): the recomputation puts back the state its forward started from, and would undo "
            "or give the other thread's updates (BatchNorm's running statistics). Run the backward before the next "
            "forward, or in the same thread, or keep or offload these layers instead of recomputing them")


def _after_fork_in_child() -> None:
    """The uses of the parent's other threads never end in the child."""
    me = threading.get_ident()
    for use in _running():
        if use.thread != me:
            use.end()


os.register_at_fork(after_in_child=_after_fork_in_child)
