"""Which layers tba can wrap for recomputation, and the errors that say why one cannot be.

:class:`~tba.runtime._recompute.RecomputeLayers` sets a wrapper as the layer's ``forward`` on the
instance. That fails, or would be wrong, for a layer inside another recomputed one, a layer another
tba context already wraps (nested, or in another thread: the wrapper is on the shared layer object),
a ``torch.compile`` wrapper or a block compiled in place, and a layer whose ``forward`` someone else
set on the instance. The adaptive planner asks :func:`plannable_for_recomputation` first and never plans those.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from torch import nn

from tba.errors import TbaConfigError
from tba.runtime._compile import is_compiled_module, is_optimized_module
from tba.runtime._layer_hooks import set_on_instance


def can_recompute(layer: nn.Module) -> bool:
    """Whether :class:`RecomputeLayers` can wrap ``layer``: not when its forward is set on the instance (a
    ``torch.compile(block)`` wrapper, a patched forward) or it was compiled in place (``block.compile()``);
    the adaptive planner never recomputes such a layer.

    Note: [A block compiled in place is not recomputed]
    ``block.compile()`` compiles the module's call, which calls ``forward``: tba's wrapper, traced into
    the block's graph. Its Python (checkpoint, the call taken apart, the state checks) breaks that
    graph into pieces, and inductor's kernels for the pieces round otherwise than the whole block's:
    gradients differed from the same compiled model without tba (a review found it on the tiny GPT,
    inductor's RNG set to eager's). So such a block is kept or offloaded, never recomputed.
    """
    return not set_on_instance(layer) and not is_compiled_module(layer)


def plannable_for_recomputation(layers: Sequence[nn.Module]) -> list[bool]:
    """Per layer, whether a plan may recompute it: :func:`can_recompute` says so, and it is not a submodule of
    another of ``layers``.

    Note: [A layer inside another is not planned for recomputation]
    ``layers=`` may nest (a block and one of its submodules, ``list(model.modules())``). Each layer was
    profiled as recomputable, so the adaptive search, which recomputes a run of neighbouring layers, could
    plan a block and its submodule both recomputed, and :func:`check_wrappable` refused that plan at the
    step it was made for and at every later one, naming a placement the user never chose. The runner
    profiles a layer inside another as not recomputable (the outer one's recomputation covers it), as it
    does one that :func:`can_recompute` refuses.
    """
    ids = {id(layer) for layer in layers}
    inner = {id(module) for layer in layers for module in layer.modules() if module is not layer and id(module) in ids}
    return [can_recompute(layer) and id(layer) not in inner for layer in layers]


def check_wrappable(layers: Sequence[nn.Module], indices: Sequence[int], thread: int | None = None) -> None:
    """Raise :class:`~tba.errors.TbaConfigError` naming the fix when one of ``layers`` (their indices in
    the model's layers) cannot be wrapped for recomputation by the context of training thread ``thread``."""
    thread = threading.get_ident() if thread is None else thread
    index_of = {id(layer): index for index, layer in zip(indices, layers)}
    for index, layer in zip(indices, layers):
        inner = next((module for module in layer.modules() if module is not layer and id(module) in index_of), None)
        if inner is not None:
            raise TbaConfigError(
                f"layers {index} ({type(layer).__name__}) and {index_of[id(inner)]} ({type(inner).__name__}) are "
                f"both recomputed, and layer {index_of[id(inner)]} is inside layer {index}: one recomputation would "
                "run inside the other; recompute only one of them (keep or offload the other), or pass layers= "
                "that do not nest")
        wrapper = vars(layer).get("forward")
        if getattr(wrapper, "tba_recomputes", False):
            if getattr(wrapper, "tba_thread", thread) != thread:
                raise TbaConfigError(
                    f"layer {index} ({type(layer).__name__}) is recomputed by a tba context active in another "
                    "thread: recomputation wraps the layer object itself, so one model's layers are recomputed by "
                    "one context at a time; give each thread its own copy of the model, or a plan that keeps or "
                    "offloads these layers")
            raise TbaConfigError(
                f"layer {index} ({type(layer).__name__}) is recomputed by another tba context that is active: "
                "offload contexts over the same layers do not nest; enter one context around the whole forward")
        if is_optimized_module(layer):
            raise TbaConfigError(
                f"layer {index} ({type(layer).__name__}) is a torch.compile wrapper, which the plan would "
                "recompute: tba wraps a layer's forward for recomputation and cannot wrap a compiled one (neither "
                "torch.compile(block) nor block.compile()); keep or offload that layer")
        if is_compiled_module(layer):  # Note [A block compiled in place is not recomputed]
            raise TbaConfigError(
                f"layer {index} ({type(layer).__name__}) was compiled in place (block.compile()), and the plan "
                "would recompute it: its compiled graph would trace tba's wrapper and break into other kernels, "
                "whose gradients differ from the block's; keep or offload that layer")
        if set_on_instance(layer):  # a copy's class forward is not: Note [A copy of a hooked layer holds none of tba's]
            raise TbaConfigError(
                f"layer {index} ({type(layer).__name__}) has a forward set on the instance, which the plan "
                "would recompute: tba wraps the class's forward for recomputation and cannot wrap a patched "
                "one; remove the instance attribute (del layer.forward), or keep or offload that layer")
