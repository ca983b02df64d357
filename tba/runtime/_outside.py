"""What a layer's forward runs beyond its own modules' state, which a recomputation would run again.

Note: [A recomputed forward reaches beyond its layer]
A recomputation runs the layer's forward a second time, in backward. tba puts back the state of the layer's own
modules first (Note [Side effects of a recomputed forward] in ``tba/runtime/_layer_state.py``), but two things the
forward reaches run again unseen:

* a module outside the layer that its forward calls: a BatchNorm the blocks share through a list, or through an
  attribute set with ``object.__setattr__`` (neither is among the block's ``modules()``). Its running statistics were
  updated a second time, and the next steps normalised with them;
* forward hooks and pre-hooks of the layer's submodules (the layer's own run around its call, which is not
  recomputed): a hook summing activations into a tensor of the program's added each of them twice.

Under a pinned plan that recomputes such a layer this is as under plain checkpoint (docs/api.md). The adaptive
default, which promises the results of training without tba, planned ``RRRRRK`` for the shared BatchNorm under a
memory budget (helper-93). So the profiled steps mark such a layer not recomputable, as they mark one that changes its
input (``tba/runtime/_timer.py``): one whose submodules hold a hook that is not tba's own, or that runs while a
global module hook is registered (:func:`hooks_run_again`); and one whose forward called a module outside it whose
state changed during the call, or that holds a hook itself (:class:`OutsideCalls`). The state compared is every
buffer's and parameter's version and every attribute's value of that module and its submodules, with one level of
the containers they hold (:func:`tba.runtime._nested_state.entry`): a change deeper down is not seen. A module outside
the layer whose state does not change (a shared rotary embedding reading its cache) leaves the layer recomputable.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as module_hooks

from tba.runtime._nested_state import Entry, contents, entry, first_differing

_MODULE_INTERNALS = frozenset(vars(nn.Module()))
"""Attributes every module has (``_parameters``, ``_buffers``, the hook dicts): their contents are compared below."""


def _is_tbas(hook: Any) -> bool:
    """Whether ``hook`` is one of tba's own (the layer timer's, the layer discovery's)."""
    name = getattr(hook, "__module__", None) or getattr(getattr(hook, "__func__", None), "__module__", None) or ""
    return name == "tba" or name.startswith("tba.")


def _has_hooks(module: nn.Module) -> bool:
    """Whether ``module`` holds a forward hook or pre-hook that is not tba's own."""
    return any(not _is_tbas(hook) for hooks in (module._forward_pre_hooks, module._forward_hooks)
               for hook in hooks.values())


def hooks_run_again(layer: nn.Module) -> bool:
    """Whether a recomputation of ``layer`` would run a forward hook again: one of a submodule's, or a global module
    hook (Note [A recomputed forward reaches beyond its layer])."""
    global_hooks = (*module_hooks._global_forward_pre_hooks.values(), *module_hooks._global_forward_hooks.values())
    if any(not _is_tbas(hook) for hook in global_hooks):
        return True
    return any(_has_hooks(module) for module in layer.modules() if module is not layer)


def state_of(module: nn.Module) -> list[Entry]:
    """Every buffer, parameter and attribute of ``module`` and its submodules, with what tells a change of each."""
    found: list[Entry] = []
    for sub in module.modules():
        prefix = type(sub).__name__
        for name, tensor in (*sub._buffers.items(), *sub._parameters.items()):
            found.append(entry(f"{prefix}.{name}", tensor))
        for name, value in vars(sub).items():
            if name in _MODULE_INTERNALS:
                continue
            found.append(entry(f"{prefix}.{name}", value))
            if isinstance(value, (dict, list, tuple)):
                found += contents(value, f"{prefix}.{name}")
    return found


class OutsideCalls:
    """Watches, during a profiled step, the modules each layer's forward calls that are not the layer's own.

    :meth:`attach` registers a global module pre-hook; :meth:`enter` and :meth:`leave` bracket layer ``index``'s
    forward, and :meth:`leave` says whether a module outside it that the forward called changed its state meanwhile,
    or holds a hook of its own (Note [A recomputed forward reaches beyond its layer]).
    """

    def __init__(self) -> None:
        self._own: list[frozenset[int]] = []
        self._open: list[tuple[int, dict[int, tuple[nn.Module, list[Entry] | None]]]] = []
        """Per layer whose forward is running, innermost last: its index and the outside modules its forward called,
        by id, with their state before the call (None: the module holds a hook)."""
        self._handle: Any = None

    def attach(self, layers: Sequence[nn.Module | None]) -> None:
        self._own = [frozenset(map(id, layer.modules())) if layer is not None else frozenset() for layer in layers]
        self._open = []
        if self._handle is None:
            self._handle = module_hooks.register_module_forward_pre_hook(self._called)

    def detach(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        self._open = []

    def enter(self, index: int) -> None:
        self._open.append((index, {}))

    def leave(self, index: int) -> bool:
        """Layer ``index``'s forward ended: whether it reached beyond the layer."""
        while self._open:
            opened, called = self._open.pop()
            if opened == index:
                return any(before is None or _changed(before, state_of(module)) for module, before in called.values())
        return False

    def _called(self, module: nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling() or not self._open:
            return
        index, called = self._open[-1]
        if id(module) in self._own[index] or id(module) in called:
            return
        called[id(module)] = (module, None if _has_hooks(module) else state_of(module))


def _changed(before: list[Entry], after: list[Entry]) -> bool:
    return len(before) != len(after) or first_differing(before, after) is not None
