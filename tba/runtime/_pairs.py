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
