"""Which layer is running: the unit of prefetch and of the adaptive policy.

A *layer* is one of the model's repeated blocks (a transformer block, a ResNet stage). tba tags
every storage saved during forward with the index of the layer that was running, so that backward
through layer ``i`` can prefetch the storages of layers ``i-1 .. i-depth``.

Layers come from the user (``layers=[...]``) or are found in a module by :func:`find_layers`: the
largest ``nn.ModuleList`` / ``nn.Sequential`` whose children share one class. Tagging uses forward
pre-hooks, removed when the offload context exits.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence

import torch
from torch import nn

from tba import _control
from tba.errors import TbaConfigError
from tba.runtime._compile import is_compiled_module, is_optimized_module, saved_by_compiled_graph
from tba.runtime._layer_hooks import LayerHook


def find_layers(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks: the container of >= 2 same-class children holding most parameters.

    Returns an empty list when the model has no such container.

    Raises:
        TbaConfigError: ``model`` is not an ``nn.Module``.
    """
    if not isinstance(model, nn.Module):
        raise TbaConfigError(f"find_layers takes the model (an nn.Module), got {type(model).__name__} {model!r:.80}")
    best: list[nn.Module] = []
    best_params = -1
    for module in model.modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(module.children())
        if len(children) < 2 or len({type(c) for c in children}) != 1:
            continue
        params = sum(p.numel() for p in module.parameters())
        if params > best_params:
            best, best_params = children, params
    return best


def resolve_layers(layers: nn.Module | Sequence[nn.Module] | None) -> list[nn.Module]:
    """Normalise ``layers=``: a module is searched with :func:`find_layers`, a sequence is taken as is."""
    if layers is None:
        return []
    if isinstance(layers, nn.Module) and not isinstance(layers, (nn.ModuleList, nn.Sequential)):
        return find_layers(layers)
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Iterable):
        raise TbaConfigError(f"layers must be a module or a list of modules, got {type(layers).__name__} {layers!r}; "
                             "pass layers=model, layers=list_of_blocks, or leave it out to find them during forward")
    found = list(layers)
    seen: dict[int, int] = {}
    for index, layer in enumerate(found):
        if not isinstance(layer, nn.Module):
            raise TbaConfigError(f"layers must contain nn.Module objects, got {type(layer).__name__} {layer!r}; "
                                 "pass layers=model or a list of the model's blocks")
        if id(layer) in seen:
            raise TbaConfigError(f"layers lists the same {type(layer).__name__} twice (at {seen[id(layer)]} and {index}): "
                                 "a layer has one placement and one index; pass each block once")
        seen[id(layer)] = index
    return found


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
            self._handles.append(layer.register_forward_pre_hook(LayerHook(self._entering(index, is_compiled_module(layer)))))

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
            if not compiled_itself and torch.compiler.is_compiling():
                self.traced_in_enclosing_graph = True

        return hook
