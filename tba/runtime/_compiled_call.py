"""tba's forward hooks on a layer: in the layer's hook dicts, or around the compiled call of a layer compiled in place.

Note: [Hooks on a block compiled in place run around its graph]
``block.compile()`` (torchtitan compiles each block so, with ``fullgraph=True``) sets ``_compiled_call_impl`` on the
instance: ``torch.compile`` of the block's own ``_call_impl``, so the block's forward hooks run inside the compiled
frame, and Dynamo traces them. tba's hooks on a layer (the layer tracker's, the profiling timer's, the runner's input
shape check and its output hook) read clocks, thread idents and storages, which Dynamo cannot trace: under
``fullgraph=True`` the first profiled step failed (``Unsupported: ... method nbytes of class UntypedStorage``);
without it the block's graph broke at tba's hooks, and the tracker's index was set by Dynamo's replay of the hook's
side effects after the graph had run, when the block's saved tensors had been packed. On such a layer tba's hooks are
not put in its hook dicts: :class:`CompiledCall` takes the place of its compiled call while tba has hooks on it and
runs them eagerly around the graph, as torch runs hooks around a block it did not compile (pre-hooks first, then the
graph, then the hooks, each with torch's rules for what a hook returns); the last hook removed puts the compiled call
back. A ``torch.compile(block)`` wrapper needs none of this: its own ``_call_impl``, which runs its hooks, is not
compiled.

Note: [A graph that encloses a block compiled in place traces none of tba's hooks]
A graph that encloses such a block (``model.compile()`` over blocks compiled in place, or a block compiled in place
inside another) traces the block's call, and so :class:`CompiledCall` and tba's hooks in it: the profiling timer's
plain hooks (the plain ones, as for a layer compiled itself) failed the first profiled step under ``fullgraph=True``
(``Unsupported: ... method nbytes of class UntypedStorage``), and without it broke the graph at each of them and
compiled tba's own frames until Dynamo's recompile limit. Traced, a :class:`CompiledCall` calls the layer's compiled
call alone, as Dynamo runs a ``torch.compile(block)`` wrapper inside an enclosing graph without the wrapper's hooks:
the layers go unmeasured and untracked there, and the step is told it ran in a whole-model graph (Note [Hooks traced
into a whole-model graph do nothing] in ``tba/runtime/_layer_hooks.py``).
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable
from typing import Any

from torch import nn

from tba.runtime._compile import is_optimized_module
from tba.runtime._compiling import compiling

__all__ = ["CompiledCall", "add_layer_hook", "compiled_in_place", "remove_layer_hooks"]

_ids = itertools.count()


def compiled_in_place(layer: nn.Module) -> bool:
    """Whether ``layer`` was compiled with ``layer.compile()`` (not a ``torch.compile(layer)`` wrapper)."""
    return vars(layer).get("_compiled_call_impl") is not None and not is_optimized_module(layer)


class CompiledCall:
    """What a layer compiled in place calls while tba has hooks on it: the hooks, eagerly, around its compiled call."""

    __slots__ = ("_layer", "compiled", "pre", "post", "__weakref__")

    def __init__(self, layer: nn.Module, compiled: Callable[..., Any]) -> None:
        self._layer = weakref.ref(layer)
        self.compiled = compiled
        """The layer's own compiled call, which :meth:`__call__` calls and the last hook's removal puts back."""
        self.pre: dict[int, tuple[Callable[..., Any], bool]] = {}
        """The forward pre-hooks, each with whether it takes the keyword arguments too."""
        self.post: dict[int, Callable[..., Any]] = {}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if compiling():  # Note [A graph that encloses a block compiled in place traces none of tba's hooks]
            return self.compiled(*args, **kwargs)
        layer = self._layer()
        for hook, with_kwargs in tuple(self.pre.values()):
            if with_kwargs:
                result = hook(layer, args, kwargs)
                if result is not None:
                    args, kwargs = result
            else:
                result = hook(layer, args)
                if result is not None:
                    args = result if isinstance(result, tuple) else (result,)
        output = self.compiled(*args, **kwargs)
        for post in tuple(self.post.values()):
            result = post(layer, args, output)
            if result is not None:
                output = result
        return output

    def put_back_if_idle(self, layer: nn.Module) -> None:
        """Give ``layer`` its own compiled call again once no hook of tba's is left on this one (and this one is still
        the layer's: a ``layer.compile()`` since then set another)."""
        if not self.pre and not self.post and vars(layer).get("_compiled_call_impl") is self:
            vars(layer)["_compiled_call_impl"] = self.compiled

    def __reduce__(self) -> tuple[Any, tuple]:
        """A copy of the layer gets its own compiled call, not tba's (Note [A copy of a hooked layer holds none of
        tba's] in tba/runtime/_layer_hooks.py; torch's ``__getstate__`` drops the attribute before pickling anyway)."""
        return _compiled_of, (self.compiled,)


def _compiled_of(compiled: Callable[..., Any]) -> Callable[..., Any]:
    return compiled


class _Handle:
    """Removes one hook from a :class:`CompiledCall`; the last one removed puts the layer's compiled call back."""

    __slots__ = ("_call", "_key", "_layer")

    def __init__(self, call: CompiledCall, key: int, layer: nn.Module) -> None:
        self._call, self._key, self._layer = call, key, weakref.ref(layer)

    def remove(self) -> None:
        call = self._call
        call.pre.pop(self._key, None)
        call.post.pop(self._key, None)
        layer = self._layer()
        if layer is not None:
            call.put_back_if_idle(layer)


def add_layer_hook(layer: nn.Module, hook: Callable[..., Any], *, pre: bool, with_kwargs: bool = False) -> Any:
    """Register ``hook`` as a forward pre-hook (``pre``) or forward hook of ``layer``; a handle with ``remove()``.

    On a layer compiled in place the hook runs around its compiled call (Note [Hooks on a block compiled in place run
    around its graph]); on any other it goes in the layer's hook dicts, as ``register_forward_pre_hook`` puts it.

    Note: [A hook goes on with its handle]
    The profiled step hooks its first layer from a hook, in the training thread, where a signal handler's exception
    can land. The hook and the CompiledCall went in place before the handle was made, and an exception landing in
    between left them on the layer for good, with no handle to take them off (found raising at every line here).
    The handle is made first, and an exception before the handle is returned takes the hook off through it. The
    compiled call is set in the instance's dict, one step, not through ``Module.__setattr__``, a Python call.
    """
    if not compiled_in_place(layer):
        if pre:
            return layer.register_forward_pre_hook(hook, with_kwargs=with_kwargs)
        return layer.register_forward_hook(hook)
    call = vars(layer)["_compiled_call_impl"]
    if not isinstance(call, CompiledCall):
        call = CompiledCall(layer, call)
    key = next(_ids)
    handle = _Handle(call, key, layer)
    try:  # Note [A hook goes on with its handle]
        if pre:
            call.pre[key] = (hook, with_kwargs)
        else:
            call.post[key] = hook
        vars(layer)["_compiled_call_impl"] = call
        return handle
    except BaseException:
        handle.remove()
        raise


def remove_layer_hooks(layer: nn.Module, hooks: tuple[Callable[..., Any], ...]) -> None:
    """Take every one of ``hooks`` (compared with ``==``: bound methods of one object) off the compiled call of
    ``layer``, handle or not, and put its own compiled call back once none is left (Note [Discovery takes off whatever
    it put on a block] in ``tba/runtime/_discover.py``)."""
    call = vars(layer).get("_compiled_call_impl")
    if not isinstance(call, CompiledCall):
        return
    for key, (hook, _) in list(call.pre.items()):
        if hook in hooks:
            call.pre.pop(key, None)
    for key, hook in list(call.post.items()):
        if hook in hooks:
            call.post.pop(key, None)
    call.put_back_if_idle(layer)
