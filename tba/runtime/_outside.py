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

Under a pinned plan that recomputes such a layer the hooks run again, as under plain checkpoint (docs/api.md), and a
module outside the layer that its forward calls has its state put back (Note [A recomputation puts back the modules
outside its layer that it calls] in ``tba/runtime/_outside_state.py``), one it changes without a call does not. The adaptive
default, which promises the results of training without tba, planned ``RRRRRK`` for the shared BatchNorm under a
memory budget (helper-93). So the profiled steps mark such a layer not recomputable, as they mark one that changes its
input (``tba/runtime/_timer.py``):

* one whose submodules hold a forward hook, or that runs while a global module hook is registered
  (:func:`hooks_run_again`), unless the hook is tba's own or a framework's that runs again under the framework's own
  activation checkpointing (:data:`FRAMEWORKS`: torch's FSDP and parametrisations, DeepSpeed ZeRO-3's hooks on every
  submodule, Hugging Face's output capture), whose changes fall on the layer's own modules, which tba puts back;
* one whose forward changed the state of a module outside it (:class:`OutsideCalls`): a module the forward called
  (which also counts when it holds a hook of its own), or one the layer's modules hold in an attribute or in a
  container one level down (``self.refs = [norm]``, changed without a call: ``norm.running_mean.mul_(0.9)``).

The state compared is every buffer's and parameter's version and every attribute's value of that module and its
submodules, with one level of the containers they hold (:func:`tba.runtime._nested_state.entry`): a change deeper
down is not seen, nor one to a module the layer reaches otherwise (a global, a closure). A module outside the layer
whose state does not change (a shared rotary embedding reading its cache) leaves the layer recomputable. Only the
thread that runs the layer is watched: a module another thread runs meanwhile (an evaluation model) is not the
layer's (helper-98 found the calls of two threads mixed, and one's ``leave`` failing while the other added to them).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

from torch import nn
from torch.nn.modules import module as module_hooks

from tba.runtime._global_hooks import GlobalHook, add_forward_pre_hook
from tba.runtime._nested_state import Entry, contents, entry, first_differing
from tba.runtime._private_state import MODULE_INTERNALS

FRAMEWORKS = ("tba", "torch", "deepspeed", "transformers")
"""Packages whose forward hooks a recomputation may run again (Note [A recomputed forward reaches beyond its layer])."""


def _is_frameworks(hook: Any) -> bool:
    """Whether ``hook`` comes from one of :data:`FRAMEWORKS` (by the module of its function, or of its class)."""
    name = (getattr(hook, "__module__", None) or getattr(getattr(hook, "__func__", None), "__module__", None)
            or type(hook).__module__ or "")
    return name.partition(".")[0] in FRAMEWORKS


def _has_hooks(module: nn.Module) -> bool:
    """Whether ``module`` holds a forward hook or pre-hook of the program's own (not of :data:`FRAMEWORKS`)."""
    return any(not _is_frameworks(hook) for hooks in (module._forward_pre_hooks, module._forward_hooks)
               for hook in hooks.values())


def hooks_run_again(layer: nn.Module) -> bool:
    """Whether a recomputation of ``layer`` would run a forward hook of the program's again: one of a submodule's, or a
    global module hook (Note [A recomputed forward reaches beyond its layer])."""
    global_hooks = (*module_hooks._global_forward_pre_hooks.values(), *module_hooks._global_forward_hooks.values())
    if any(not _is_frameworks(hook) for hook in global_hooks):
        return True
    return any(_has_hooks(module) for module in layer.modules() if module is not layer)


def held_modules(layer: nn.Module, own: frozenset[int]) -> Iterator[nn.Module]:
    """The modules outside ``layer`` (not in ``own``, the ids of its modules) that its modules hold in an attribute or
    in a list, tuple or dict one level down."""
    for module in layer.modules():
        for value in vars(module).values():
            items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else (value,)
            for item in items:
                if isinstance(item, nn.Module) and id(item) not in own:
                    yield item


def state_of(module: nn.Module, own: frozenset[int] = frozenset()) -> list[Entry]:
    """Every buffer, parameter and attribute of ``module`` and its submodules but those in ``own`` (a layer's, whose state
    tba puts back itself: a block holding the model it belongs to), with what tells a change of each."""
    found: list[Entry] = []
    for sub in module.modules():
        if id(sub) in own:
            continue
        prefix = type(sub).__name__
        for name, tensor in (*sub._buffers.items(), *sub._parameters.items()):
            found.append(entry(f"{prefix}.{name}", tensor))
        for name, value in vars(sub).items():
            if name in MODULE_INTERNALS:  # buffers and parameters are compared above
                continue
            found.append(entry(f"{prefix}.{name}", value))
            if isinstance(value, (dict, list, tuple)):
                found += contents(value, f"{prefix}.{name}")
    return found


class OutsideCalls:
    """Watches, during a profiled step, what each layer's forward does to modules that are not the layer's own.

    :meth:`attach` registers a global module pre-hook; :meth:`enter` and :meth:`leave` bracket layer ``index``'s
    forward on the thread that runs it, and :meth:`leave` says whether a module outside the layer, one it holds or one
    its forward called, changed its state meanwhile, or holds a hook of its own (Note [A recomputed forward reaches
    beyond its layer]).
    """

    def __init__(self) -> None:
        self._layers: list[weakref.ref | None] = []
        """The layers, weakly: the watch must not keep a model alive."""
        self._own: list[frozenset[int]] = []
        self._open: list[tuple[int, dict[int, tuple[nn.Module, list[Entry] | None]]]] = []
        """Per layer whose forward is running, innermost last: its index and the outside modules it holds or its forward
        called, by id, with their state before (None: the module holds a hook)."""
        self._thread: int | None = None
        """The thread whose layers are open: calls on any other are not theirs."""
        self._hook: GlobalHook | None = None
        """The global pre-hook's callback while attached.

        Note: [One global hook key across profiled steps]
        :meth:`attach` registered the global pre-hook anew at every profiled step, under a new key. Dynamo guards a
        compiled block's frame on the keys of the global hooks, so every profiled step compiled each compiled block
        again (helper-154, ``TORCH_LOGS=recompiles``: ``..._global_forward_pre_hooks))[0] == 8``): seconds of tracing
        a step, counted in the profile, and with Note [A step that compiles is no sample] no step would have been a
        sample. The callback now goes to tba's one pre-hook, whose key is the process's (Note [One key per process for
        tba's global module hooks] in ``tba/runtime/_global_hooks.py``), so the steps after the first find the graph
        they compiled, whichever context or runner attached it.
        """

    def attach(self, layers: Sequence[nn.Module | None]) -> None:
        self._layers = [weakref.ref(layer) if layer is not None else None for layer in layers]
        self._own = [frozenset(map(id, layer.modules())) if layer is not None else frozenset() for layer in layers]
        self._open = []
        if self._hook is None:
            self._hook = add_forward_pre_hook(self._called)

    def detach(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self._open, self._layers, self._own = [], [], []

    def enter(self, index: int) -> None:
        if not self._open:
            self._thread = threading.get_ident()
        elif threading.get_ident() != self._thread:
            return
        ref = self._layers[index] if index < len(self._layers) else None
        layer = ref() if ref is not None else None
        own = self._own[index] if layer is not None else frozenset()
        held = {} if layer is None else {id(module): (module, _state_or_hooked(module, own))
                                         for module in held_modules(layer, own)}
        self._open.append((index, held))

    def leave(self, index: int) -> bool:
        """Layer ``index``'s forward ended: whether it reached beyond the layer."""
        if threading.get_ident() != self._thread:
            return False
        while self._open:
            opened, watched = self._open.pop()
            if opened == index:
                own = self._own[index] if index < len(self._own) else frozenset()
                return any(before is None or _changed(before, state_of(module, own)) for module, before in list(watched.values()))
        return False

    def _called(self, module: nn.Module, args: Any) -> None:
        """tba's global pre-hook calls this only outside a trace (Note [One key per process for tba's global module
        hooks] in ``tba/runtime/_global_hooks.py``): it need not ask."""
        if not self._open or threading.get_ident() != self._thread:
            return
        index, watched = self._open[-1]
        if id(module) in self._own[index] or id(module) in watched:
            return
        watched[id(module)] = (module, _state_or_hooked(module, self._own[index]))


def _state_or_hooked(module: nn.Module, own: frozenset[int]) -> list[Entry] | None:
    return None if _has_hooks(module) else state_of(module, own)


def _changed(before: list[Entry], after: list[Entry]) -> bool:
    return len(before) != len(after) or first_differing(before, after) is not None
