"""Which saved-tensor pair is on top of a thread's stack: torch's checkpoint's, ``allow_mutation_on_saved_tensors``',
or tba's own. Autograd uses only the top pair (Note [Hook nesting of a recomputed layer] in
``tba/runtime/_recompute.py``), so what tba does at an entry or a recomputed layer's call depends on whose it is.
"""

from __future__ import annotations

from typing import Any

from tba.runtime._hooks import SavedTensorHooks


def is_checkpoint_pair(top: tuple[Any, Any]) -> bool:
    """Whether the saved-tensor pair ``top`` is torch's non-reentrant checkpoint's, of its forward or of its
    recomputation (Note [Inside a user's checkpoint a recomputed layer runs as it is] in ``tba/runtime/_recompute.py``)."""
    return getattr(top[0], "__module__", None) == "torch.utils.checkpoint"


def is_mutation_pair(top: tuple[Any, Any] | None) -> bool:
    """Whether the saved-tensor pair ``top`` is ``torch.autograd.graph.allow_mutation_on_saved_tensors()``'s, which
    clones a saved tensor before an in-place change (Note [Hook nesting of a recomputed layer] in
    ``tba/runtime/_recompute.py``)."""
    return top is not None and getattr(top[0], "__qualname__", "").startswith("_swap_with_cloned.")


def is_tba_pair(top: tuple[Any, Any]) -> bool:
    """Whether the saved-tensor pair ``top`` (the one on top, read as the offloader's own check on entry
    reads it, whether or not a tracer has set the pairs aside) is tba's (Note [Hook nesting of a
    recomputed layer] in ``tba/runtime/_recompute.py``)."""
    return isinstance(getattr(top[0], "__self__", None), SavedTensorHooks)


def context_below(top: tuple[Any, Any] | None) -> str | None:
    """Why the block cannot be entered above the saved-tensor pair ``top`` (the one on top now), else None.

    Note: [A block inside a user's non-reentrant checkpoint]
    Autograd uses only the saved-tensor pair on top. Entered inside the function of
    torch.utils.checkpoint(use_reentrant=False), the block's pair went above the checkpoint's:
    every tensor the function saved went to tba, the checkpoint held none, and backward
    recomputed nothing. Gradients were exact, but the recomputation's side effects were gone
    (a BatchNorm's running statistics updated once, where training without tba updates them
    twice) and a kept layer's activations stayed in memory, the checkpoint's saving silently lost.
    Inside ``torch.autograd.graph.allow_mutation_on_saved_tensors()`` the same happened to its pair,
    which clones a saved tensor before an in-place change: the change, legal there, raised torch's
    in-place error through tba's version check. Either is refused, naming the fix. A reentrant
    checkpoint's forward saves nothing (it runs without grad) and its recomputation enters the
    block in backward with no pair of the checkpoint's on top: it works as it is. A pair that only
    stores tensors elsewhere (``save_on_cpu``) loses nothing but memory: tba stores them instead.
    """
    if top is None:
        return None
    if is_checkpoint_pair(top):
        layer = getattr(top[1], "tba_layer", None)  # Note [A layer that enters a tba block is not recomputed]
        if layer is not None:
            return (f"tba's with block was entered inside the forward of {layer}, which the plan recomputes in backward "
                    "under torch.utils.checkpoint, where tba would take every tensor it saves and the checkpoint would "
                    "recompute nothing; keep or offload that layer (a tba.Plan that does not recompute it; the "
                    "adaptive default does not), or enter the inner block outside its forward")
        return ("tba's with block was entered inside the function of torch.utils.checkpoint(use_reentrant=False): "
                "tba would take every tensor it saves and the checkpoint would recompute nothing; enter the offload "
                "context around the checkpoint call instead (tba.Plan's 'recompute' placement recomputes layers under tba)")
    if is_mutation_pair(top):
        return ("tba's with block was entered inside torch.autograd.graph.allow_mutation_on_saved_tensors(): tba "
                "would take every tensor saved, and an in-place change of one would raise instead of being allowed; "
                "enter the offload context around allow_mutation_on_saved_tensors() instead")
    return None
