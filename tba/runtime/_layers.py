"""Which layer is running: the unit of prefetch and of the adaptive policy.

A *layer* is one of the model's repeated blocks (a transformer block, a ResNet stage). tba tags
every storage saved during forward with the index of the layer that was running, so that backward
through layer ``i`` can prefetch the storages of layers ``i-1 .. i-depth``.

Layers come from the user (``layers=[...]``) or are found in a module by :func:`find_layers`: the
largest ``nn.ModuleList`` / ``nn.Sequential`` / ``nn.ModuleDict`` whose children share one class. Tagging uses forward
pre-hooks, removed when the offload context exits.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet

import torch
from torch import nn

from tba import _control
from tba.errors import TbaConfigError
from tba.policy import Plan
from tba.runtime._compile import is_compiled_module, is_optimized_module, saved_by_compiled_graph
from tba.runtime._compiled_call import add_layer_hook
from tba.runtime._compiling import compiling
from tba.runtime._layer_hooks import LayerHook


def find_layers(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks: the container of >= 2 same-class children holding most parameters.

    A container is an ``nn.ModuleList``, ``nn.Sequential`` or ``nn.ModuleDict``; children that are lists or
    dicts themselves (never called) stand for the blocks inside them (Note [Containers that are never called]).
    Returns an empty list when the model has no such container.

    Raises:
        TbaConfigError: ``model`` is not an ``nn.Module``.
    """
    if not isinstance(model, nn.Module):
        raise TbaConfigError(f"find_layers takes the model (an nn.Module), got {type(model).__name__} {model!r:.80}")
    best: list[nn.Module] = []
    best_params = -1
    for module in model.modules():
        if not isinstance(module, (*_NEVER_CALLED, nn.Sequential)):
            continue
        blocks = _repeated_blocks(list(module.children()))
        if len(blocks) < 2:
            continue
        params = sum(_full_numel(p) for p in module.parameters())
        if params > best_params:
            best, best_params = blocks, params
    return best


def _full_numel(parameter: nn.Parameter) -> int:
    """The parameter's size, partitioned away or not.

    Note: [Parameters partitioned away]
    DeepSpeed ZeRO-3 keeps each rank's shard elsewhere and leaves the parameter an empty tensor between the gathers of
    its module's forward, with its full size in ``ds_numel``. Counted by ``numel()``, every container held 0
    parameters, and find_layers took the first container of repeated blocks met (two embeddings before the
    blocks), so ``TbaDeepSpeed(engine)`` under ZeRO-3 tagged, prefetched and planned the wrong modules (helper-165).
    FSDP2's DTensor parameters already give their global size.
    """
    return int(getattr(parameter, "ds_numel", None) or parameter.numel())


_NEVER_CALLED = (nn.ModuleList, nn.ModuleDict)
"""Containers without a forward of their own: the blocks are the modules inside them."""


def _leaves(module: nn.Module) -> list[nn.Module]:
    """``module``, or, for a container never called, the modules inside it (at any depth), in order."""
    if isinstance(module, _NEVER_CALLED):
        return [leaf for child in module.children() for leaf in _leaves(child)]
    return [module]


def _repeated_blocks(children: list[nn.Module]) -> list[nn.Module]:
    """The blocks a container's ``children`` are: the children when they share one class; the modules inside
    them when every child is a container never called and they hold one class, or each holds the same
    sequence of classes (an attention and a feed-forward per block); else none.

    Note: [Containers that are never called]
    find_layers took only the ``nn.ModuleList`` or ``nn.Sequential`` whose children share one class. A model
    keeping its blocks in an ``nn.ModuleDict`` (torchtitan's ``layers["0"]``...) had none, so ``layers=model``
    gave no layers: a pinned plan was refused ("policy Plan needs the model's layers") and the adaptive default
    offloaded every step without ever planning, silently. A ``ModuleList`` of ``ModuleList([attention,
    feed_forward])`` pairs gave the inner lists, which are never called: their forward pre-hooks never ran, so
    nothing was tagged or planned, and the warning that followed told the user to pass ``layers=model``, what
    they had done (helper-154). Neither container has a forward, so the layers are the modules inside them,
    as the bare context's discovery (which sees the modules that run) finds them.
    """
    if len({type(child) for child in children}) != 1:
        return []
    if not isinstance(children[0], _NEVER_CALLED):
        return children
    inner = [_leaves(child) for child in children]
    flat = [leaf for leaves in inner for leaf in leaves]
    kinds = {tuple(type(leaf) for leaf in leaves) for leaves in inner}
    return flat if len({type(leaf) for leaf in flat}) == 1 or len(kinds) == 1 else []


def resolve_layers(layers: nn.Module | Sequence[nn.Module] | None) -> list[nn.Module]:
    """Normalise ``layers=``: a module is searched with :func:`find_layers`, a sequence is taken as is."""
    if layers is None:
        return []
    if isinstance(layers, nn.Module) and not isinstance(layers, (nn.ModuleList, nn.Sequential)):
        return find_layers(layers)
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Iterable):
        raise TbaConfigError(f"layers must be a module or a list of modules, got {type(layers).__name__} {_short(layers)}; "
                             "pass layers=model, layers=list_of_blocks, or leave it out to find them during forward")
    if isinstance(layers, (AbstractSet, Mapping)):  # a plan's decisions and the prefetch go by forward order
        kind = "set" if isinstance(layers, AbstractSet) else "dict"
        raise TbaConfigError(f"layers is a {kind}, whose order is not the order the blocks run in; pass a list of the "
                             f"blocks in forward order{' (list(layers.values()) if its values are)' if kind == 'dict' else ''}")
    found = [leaf for layer in layers for leaf in _leaves(layer)] if isinstance(layers, nn.ModuleList) else list(layers)
    seen: dict[int, int] = {}
    for index, layer in enumerate(found):
        if not isinstance(layer, nn.Module):
            raise TbaConfigError(f"layers must contain nn.Module objects, got {type(layer).__name__} {_short(layer)}; "
                                 "pass layers=model or a list of the model's blocks")
        if id(layer) in seen:
            raise TbaConfigError(f"layers lists the same {type(layer).__name__} twice (at {seen[id(layer)]} and {index}): "
                                 "a layer has one placement and one index; pass each block once")
        seen[id(layer)] = index
    return found


def searched_in_vain(given: object, found: list[nn.Module], policy: object) -> bool:
    """Whether ``layers=`` was a module searched by :func:`find_layers` in vain, so that the layers are found
    during forward, as without ``layers=``.

    Note: [A module searched in vain for layers]
    ``layers=model`` on a model whose repeated blocks sit in no container (attributes ``self.b0``,
    ``self.b1``... called in a loop) gave no layers and, ``layers=`` being given, no discovery either: the
    adaptive default never profiled nor planned and offloaded every step for good, silently, where the bare
    context found the blocks; a pinned plan or ``"keep"`` was refused as "needs the model's layers: pass
    layers=model", what the user had done (helper-154; every integration passes ``layers=model``). Such a
    module now leaves the layers to the discovery of the modules that run; a plan, which needs them
    before the first forward, is refused naming the fix.

    Raises:
        TbaConfigError: a pinned plan or ``"keep"`` for such a module.
    """
    if found or not isinstance(given, nn.Module) or isinstance(given, (nn.ModuleList, nn.Sequential)):
        return False
    if (isinstance(policy, str) and policy == "keep") or isinstance(policy, Plan):
        raise TbaConfigError(
            f"layers={type(given).__name__} holds no repeated blocks tba.find_layers finds (a ModuleList, "
            f"Sequential or ModuleDict of modules of one class); pass its blocks as a list: layers=[...]")
    return True


def _short(value: object) -> str:
    """``value``'s repr on one line, cut at 80 characters (a tensor's repr is its values, lines of them)."""
    text = " ".join(repr(value).split())
    return text if len(text) <= 80 else text[:77] + "..."


class StateKeys:
    """Storage identities of every parameter and buffer of some modules (``key in keys``), to keep them off disk.

    Each key comes with a weak reference to its StorageImpl, which keeps the address from being
    handed to a new storage after the parameter's storage is replaced (ZeRO-3 swaps a partitioned
    parameter's ``.data`` during forward): a freed key reused by an activation would keep that
    activation in memory.

    Note: [State keys are freed on the control thread]
    The weak references are torch's raw ones (``storage._weak_ref()``), freed by the control thread
    once this object is collected (:func:`tba._control.on_death`), not by a ``__del__``. They were
    ``StorageWeakRef`` objects, whose ``__del__`` is Python code: an offloader is freed by the cycle
    collector, in whatever thread of the user's allocates at that moment, and a Ctrl-C landing in
    one of those ``__del__`` calls was printed as "Exception ignored" and dropped (Note
    [Asynchronous exceptions] in ``tba/_control.py``).
    """

    __slots__ = ("_refs", "__weakref__")

    def __init__(self, modules: Iterable[nn.Module]) -> None:
        storages: dict[int, torch.UntypedStorage] = {}
        for module in modules:
            for tensor in [*module.parameters(), *module.buffers()]:
                if isinstance(tensor, nn.parameter.UninitializedTensorMixin):
                    raise TbaConfigError(
                        f"{type(module).__name__} has lazy parameters or buffers that are not materialised yet "
                        f"({type(tensor).__name__}); run one forward of the model (torch.no_grad() is enough) "
                        "before building the offloader")
                if tensor.layout is not torch.strided:
                    continue  # a sparse buffer has no storage of its own, and its saves are kept anyway (NOT_STRIDED)
                storage = tensor.untyped_storage()
                storages[storage._cdata] = storage
        self._refs = {key: storage._weak_ref() for key, storage in storages.items()}
        if self._refs:
            _control.on_death(self, _free_weak_refs, tuple(self._refs.values()))

    def __contains__(self, key: object) -> bool:
        return key in self._refs

    def __len__(self) -> int:
        return len(self._refs)

    def __repr__(self) -> str:
        return f"StateKeys({len(self._refs)} storages)"


def _free_weak_refs(refs: tuple[int, ...]) -> None:
    for ref in refs:
        torch.UntypedStorage._free_weak_ref(ref)


class LayerTracker:
    """Knows the index of the layer whose forward is running (None outside any layer)."""

    def __init__(self, layers: Sequence[nn.Module], given: object = None) -> None:
        self.layers = list(layers)
        self._given = weakref.ref(given) if isinstance(given, nn.Module) else None
        """The module ``layers=`` was (the model, or the container of the blocks), weakly."""
        self.current: int | None = None
        self.traced_in_enclosing_graph = False
        """Set when a layer that is not compiled itself ran inside a compiled graph (``tba/runtime/_compile.py``)."""
        self.compiled_save_outside_layers = False
        """Set when a compiled graph saved a tensor while no layer was running."""
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def attach(self) -> None:
        """Start tracking; forward starts outside any layer, whatever the last forward ended in."""
        self.current = None
        self.traced_in_enclosing_graph = False
        self.compiled_save_outside_layers = False
        for index, layer in enumerate(self.layers):
            self._handles.append(add_layer_hook(layer, LayerHook(self._entering(index, is_compiled_module(layer))), pre=True))

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def note_save(self) -> None:
        """Called for each saved tensor: remembers whether a compiled graph saved it outside every layer."""
        if self.layers and self.current is None and not self.compiled_save_outside_layers:
            self.compiled_save_outside_layers = saved_by_compiled_graph()

    @property
    def in_whole_model_graph(self) -> bool:
        """After forward: whether the layers ran inside an enclosing compiled graph (see ``tba/runtime/_compile.py``)."""
        return self.traced_in_enclosing_graph or (self.compiled_save_outside_layers and self.current is None)

    def wrapped_after_given(self) -> bool:
        """Whether the module given as ``layers=`` now holds a ``torch.compile`` wrapper of one of the layers (Note
        [Blocks compiled after tba was given them] in ``tba/runtime/_compile.py``)."""
        given = self._given() if self._given is not None else None
        layers = {id(layer) for layer in self.layers}
        return given is not None and any(is_optimized_module(module) and id(module._orig_mod) in layers
                                         for module in given.modules())

    def _entering(self, index: int, compiled_itself: bool):
        def hook(module: nn.Module, args: object) -> None:
            self.current = index
            if not compiled_itself and compiling():
                self.traced_in_enclosing_graph = True

        return hook
