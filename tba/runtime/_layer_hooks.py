"""The hooks and the recomputing forward tba sets on a layer, and what a copy of the layer gets of them.

Note: [A copy of a hooked layer holds none of tba's]
While a step runs, tba's hooks sit in each layer's hook dicts (the layer tracker's, the profiling timer's, the runner's
input-shape check) and a recomputed layer holds tba's wrapper as its ``forward``, on the instance. A model copied then
(``copy.deepcopy``, pickle: a BYOL or DINO target encoder made lazily in the first forward, a snapshot taken inside the
block) copied those entries with the layer: a plain function is copied by reference, so the copy's blocks ran tba's
wrapper of the *original* blocks, whose weights gave the copy's output in every later step, silently (helper-117 found
it: a BYOL target that never moved); a hook bound to tba's runner copied the runner, which failed on its lock
(``TypeError: cannot pickle '_thread.lock' object``), and pickling failed on the local functions. So each hook is a
:class:`LayerHook`, whose copy is :func:`no_op` (the copy's hook dicts keep an entry that does nothing and holds
nothing of tba's), and the wrapper a :class:`Recomputing`, whose copy is ``getattr(copy, "forward")``, made while the
copy's attributes are not set yet: its class's ``forward`` bound to the copy, a plain method (the copy keeps the
signature ``inspect.signature`` and Hugging Face's ``generate`` read, and its pickle loads without tba). tba treats such
a bound class forward as no forward set on the instance (it recomputes such a copy later, and takes the attribute away
when that context ends). A shallow ``copy.copy`` of a layer shares its attribute dicts' entries, and so tba's, as it
shares everything else.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from tba.runtime._compile import is_compiled_module
from tba.runtime._compiling import compiling


def no_op(*args: Any, **kwargs: Any) -> None:
    """What a copy of one of tba's hooks is (Note [A copy of a hooked layer holds none of tba's])."""


def _copied_hook() -> Callable[..., None]:
    return no_op


class LayerHook:
    """One of tba's hooks on a layer: ``function``, whose copy (deep copy, pickle) is :func:`no_op`."""

    __slots__ = ("function",)

    def __init__(self, function: Callable[..., Any]) -> None:
        self.function = function

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.function(*args, **kwargs)

    def __reduce__(self) -> tuple[Any, tuple]:
        return _copied_hook, ()


class MeasuringHook(LayerHook):
    """A hook that measures a layer (the profiling timer's, the runner's shape check): inside a compiled graph that
    encloses the layer it does nothing.

    Note: [Hooks traced into a whole-model graph do nothing]
    Dynamo does not skip a module hook it meets while tracing a whole-model compile: it inlines it. The timer's
    hooks read clocks, ``threading.get_ident`` and ``/proc`` there, which Dynamo cannot trace, so it broke the
    model's graph at every layer of a profiled step, and the graphs it compiled stayed split for every later
    step (it does not guard on hooks). Under inductor the split graphs fuse their kernels otherwise: the adaptive
    default's loss and gradients differed from the same compiled model without tba (helper-125; ``aot_eager``
    fuses nothing, which hid it). Traced, ``is_compiling()`` is the constant True and such a hook traces nothing:
    the graph stays whole, and the layers go unmeasured as where the model was compiled before tba hooked them.
    A layer compiled itself gets the plain hook, which runs outside its graph: a ``torch.compile(block)`` wrapper
    runs its hooks in its own uncompiled call, and a block compiled in place (``block.compile()``) runs tba's around
    its compiled call (Note [Hooks on a block compiled in place run around its graph] in
    ``tba/runtime/_compiled_call.py``); its times are measured between graphs. The profiled step's gradient hooks (the
    timer's stamps, the peak's stop) do nothing when compiled autograd traces them: the peak's ``queue_callback``
    failed the first profiled backward with torch's AssertionError (helper-125), even under ``aot_eager``.
    """

    __slots__ = ()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if compiling():
            return None
        return self.function(*args, **kwargs)


def measuring_hook(layer: nn.Module, function: Callable[..., Any]) -> LayerHook:
    """``function`` as a hook on ``layer``: a :class:`MeasuringHook` unless ``layer`` is compiled itself."""
    return LayerHook(function) if is_compiled_module(layer) else MeasuringHook(function)


class Recomputing:
    """tba's recomputing ``forward`` of ``layer`` (``run``), set on the instance; its copy is the class's ``forward`` bound
    to the layer's copy."""

    __slots__ = ("layer", "run", "tba_thread")
    tba_recomputes = True
    """What ``RecomputeLayers`` tells from a user's own forward."""

    def __init__(self, layer: nn.Module, run: Callable[..., Any], thread: int) -> None:
        self.layer = layer
        self.run = run
        self.tba_thread = thread
        """Whose context wrapped it (``check_wrappable``'s message)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.run(*args, **kwargs)

    def __reduce__(self) -> tuple[Any, tuple]:
        return getattr, (self.layer, "forward")


def set_on_instance(layer: nn.Module) -> bool:
    """Whether ``layer`` has a ``forward`` set on the instance other than its class's bound to it (what a copy of a
    recomputed layer holds: Note [A copy of a hooked layer holds none of tba's])."""
    forward = vars(layer).get("forward")
    if forward is None:
        return False
    return getattr(forward, "__self__", None) is not layer or getattr(forward, "__func__", None) is not type(layer).forward
