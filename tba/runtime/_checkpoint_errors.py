"""Torch's checkpoint errors from a layer tba recomputes, raised as a :class:`TbaError` that names the layer.

Note: [Torch's checkpoint errors name the recomputed layer]
A recomputed layer runs under torch's non-reentrant checkpoint (Note [Hook nesting of a recomputed
layer] in ``tba/runtime/_recompute.py``), which refuses some layers in backward with its
``CheckpointError``: a saved tensor unpacked twice in one backward ('already unpacked once': a custom
Function reading ``ctx.saved_tensors`` twice, a gradient penalty through an in-place op on a view of a
tensor the layer saves), and a recomputation that saves fewer, more or other tensors than the first
forward ('A different number of tensors', 'trying to save more tensors', 'different metadata': the
layer read state that changed between forward and backward, a global or a flag tba does not put
back). Plain checkpoint fails the same way; but the program never called checkpoint, tba chose to
recompute the layer, and torch's message names neither the layer nor the fix (it suggests
``debug=True``, an argument of a call the program does not make).

Every one of them is raised inside checkpoint's unpack hook: the last three by the recomputation that
hook runs (the third in the pack hook checkpoint pushes for it, out through the recomputation), after
the first call of the layer has ended. So the first call pushes, above checkpoint's pair, a pair with
checkpoint's own pack function (a check of the pair on top reads the pack, so it sees checkpoint's
pair as before: ``tba/runtime/_pairs.py``) and an unpack that calls checkpoint's and raises a
:class:`TbaError` naming the layer and the fix, torch's error its ``__cause__``. What is saved, when
and how it is unpacked are checkpoint's, unchanged: a layer that checkpoint does not refuse gives
the same gradients. A tensor saved under another pair pushed inside the layer (the user's own
hooks, a checkpoint of the user's) is that pair's, as before.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointError

from tba.errors import TbaError

_CAUSES = (
    ("already unpacked once", "its backward unpacked one saved tensor twice (as a custom Function reading "
     "ctx.saved_tensors twice does, or a gradient of a gradient through an in-place op on a view of a tensor it saves)"),
    ("different number of tensors", "its recomputation saved another number of tensors than its forward"),
    ("more tensors", "its recomputation saved more tensors than its forward"),
    ("different metadata", "its recomputation saved tensors of other shapes, dtypes or devices than its forward"),
)
_STATE = (", as when it reads state that changed between its forward and backward (a global, a flag, an attribute "
          "tba does not put back)")


def named_errors(cls: type, index: int) -> contextlib.AbstractContextManager:
    """Around the first call of a recomputed layer (layer ``index`` of class ``cls``), with checkpoint's pair on top:
    the pair that raises checkpoint's errors from what the call saves as a TbaError naming the layer (Note [Torch's
    checkpoint errors name the recomputed layer]). Under any other pair on top (grad disabled: none), nothing."""
    top = torch._C._autograd._top_saved_tensors_default_hooks(True)
    if top is None or not getattr(top[0], "__qualname__", "").startswith("_checkpoint_hook."):
        return contextlib.nullcontext()
    pack, unpack = top

    def unpack_named(holder: Any) -> torch.Tensor:
        try:
            return unpack(holder)
        except CheckpointError as error:
            raise TbaError(_message(cls, index, error)) from error

    unpack_named.tba_layer = f"layer {index} ({cls.__name__})"  # Note [A layer that enters a tba block is not recomputed]
    return torch.autograd.graph.saved_tensors_hooks(pack, unpack_named)


def _message(cls: type, index: int, error: CheckpointError) -> str:
    said = str(error).strip().splitlines()[0].removeprefix("torch.utils.checkpoint: ")
    why = next((cause + ("" if "unpacked" in key else _STATE) for key, cause in _CAUSES if key in said), None)
    return (f"layer {index} ({cls.__name__}), which tba recomputes in backward, failed in torch.utils.checkpoint"
            f"{f': {why}' if why else ''} ({said!r}; torch's own checkpoint fails the same way on this layer). Keep or "
            "offload this layer (policy='offload', or a tba.Plan that does not recompute it)")
