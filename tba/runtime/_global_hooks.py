"""tba's global module hooks: one forward pre-hook and one forward hook, each under a key made once per process.

Note: [One key per process for tba's global module hooks]
Dynamo guards a compiled module's frame on the keys of torch's global module hook dicts
(``list(dict.keys(_global_forward_hooks))[0] == 27``): a block compiled in place (``block.compile()``, as torchtitan
compiles each of its blocks, with ``fullgraph=True``) traces its own ``_call_impl``, and with it the global hooks.
Layer discovery and the profiled step's watch of the modules outside a layer each registered its own global hook, under
a key new for each context or step. So every step compiled every such block again, and at the eighth Dynamo's
recompile limit ended training (``FailOnRecompileLimitHit`` under ``fullgraph=True``) or ran the block uncompiled from
then on, silently. Those two now attach callbacks to tba's one pre-hook and one hook, whose keys are made once per
process; both hooks are in torch's dicts while any callback is attached and out of them otherwise, so a compiled
block meets two sets of keys at most and compiles twice at most. Each hook calls the callbacks attached, in the order
they were attached; traced by Dynamo it does nothing (:func:`~tba.runtime._compiling.compiling`, Note [Another
thread's compile is not this thread's]), so the callbacks, called only outside a trace, do not ask again. A recomputation's
two global pre-hooks (``tba/runtime/_outside_state.py``, ``tba/runtime/_overlap.py``) keep a key of their own: each
must come off in a ``finally`` through one C call that no signal handler can interrupt halfway, and they exist only
while a recomputed layer runs, which a block compiled in place never is (Note [A block compiled in place is not
recomputed]).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from typing import Any

from torch import nn
from torch.nn.modules import module as module_hooks
from torch.utils.hooks import RemovableHandle

from tba.runtime._compiling import compiling

__all__ = ["GlobalHook", "add_forward_hook", "add_forward_pre_hook"]

_PRE_KEY = RemovableHandle(module_hooks._global_forward_pre_hooks).id
_POST_KEY = RemovableHandle(module_hooks._global_forward_hooks).id
_pre: dict[int, Callable[[nn.Module, Any], None]] = {}
_post: dict[int, Callable[[nn.Module, Any, Any], None]] = {}
_ids = itertools.count()
_lock = threading.Lock()


def _forward_pre_hook(module: nn.Module, args: Any) -> None:
    if compiling():
        return
    for callback in tuple(_pre.values()):
        callback(module, args)


def _forward_hook(module: nn.Module, args: Any, output: Any) -> None:
    if compiling():
        return
    for callback in tuple(_post.values()):
        callback(module, args, output)


class GlobalHook:
    """One callback attached to tba's global pre-hook or hook; :meth:`remove` detaches it (again: nothing)."""

    __slots__ = ("_callbacks", "_id", "__weakref__")

    def __init__(self, callbacks: dict[int, Any], callback: Callable[..., None]) -> None:
        self._callbacks = callbacks
        self._id = next(_ids)
        with _lock:
            callbacks[self._id] = callback
            _install()

    def remove(self) -> None:
        with _lock:
            self._callbacks.pop(self._id, None)
            _install()


def _install() -> None:
    """Put both hooks in torch's dicts while either has callbacks, and take them out when neither has (under
    ``_lock``): a compiled block meets one set of tba's keys or none, not three."""
    if _pre or _post:
        module_hooks._global_forward_pre_hooks[_PRE_KEY] = _forward_pre_hook
        module_hooks._global_forward_hooks[_POST_KEY] = _forward_hook
        module_hooks._global_forward_hooks_always_called[_POST_KEY] = True
    else:
        module_hooks._global_forward_pre_hooks.pop(_PRE_KEY, None)
        module_hooks._global_forward_hooks.pop(_POST_KEY, None)
        module_hooks._global_forward_hooks_always_called.pop(_POST_KEY, None)


def add_forward_pre_hook(callback: Callable[[nn.Module, Any], None]) -> GlobalHook:
    """Call ``callback(module, args)`` before every module's forward, eagerly, until the handle is removed."""
    return GlobalHook(_pre, callback)


def add_forward_hook(callback: Callable[[nn.Module, Any, Any], None]) -> GlobalHook:
    """Call ``callback(module, args, output)`` after every module's forward, eagerly, also when it raised."""
    return GlobalHook(_post, callback)

