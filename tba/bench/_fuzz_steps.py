"""Ways a training step runs that the fuzzer's first loop (``tba/bench/fuzz.py``) did not: the step modes.

A case may draw, per step, one mode of :data:`MODES` (field ``modes`` of :class:`~tba.bench._fuzz_case.Case`,
drawn after every older field), beside the step's event:

* ``"accumulate"``: gradient accumulation in one context: a second forward on another input inside the
  same ``with`` block, and one backward over the sum of both losses (every layer runs twice before any
  backward: two sets of saved tensors per layer, two recomputations);
* ``"no_grad"``: an evaluation forward under ``torch.no_grad()`` inside the context before the training one
  (the model stays in training mode: it draws dropout, counts calls, updates running statistics; nothing is
  saved, yet every layer is called);
* ``"inference"``: the same under ``torch.inference_mode()``, after the training forward and before its
  backward, so that a recomputed layer's state has moved on since its first call;
* ``"double"``: ``torch.autograd.grad`` with ``create_graph=True``, then one backward over the loss plus the
  squared gradients (a gradient penalty): every saved tensor is unpacked twice, the second time for a graph
  built in the first backward. Not drawn with a reentrant checkpoint, which refuses ``autograd.grad``, nor with
  the ``"inplace_view"`` op (Note [Double backward through an in-place op on a view]);
* ``"keep_grads"``: ``optimizer.zero_grad(set_to_none=False)``, so that backward accumulates into zeroed
  gradients rather than creating them.

The other inputs come from the seed and the step alone (:func:`second_input`), so both runs see the same.

Note: [Double backward through an in-place op on a view]
A layer that runs ``sigmoid_`` on a slice of a tensor it saves afterwards (``"inplace_view"`` in
``_fuzz_ops.py``), recomputed, and a gradient of its gradient: the second backward fails in torch's
non-reentrant checkpoint ('Unpack is being triggered for a tensor that was already unpacked once'), under
tba's recompute and under ``torch.utils.checkpoint`` alone alike; kept or offloaded, the layer is exact. It
is loud, but torch's error rather than tba's, so the fuzzer does not draw the two together (tba could name
the layer in an error of its own instead).
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

MODES = ("accumulate", "no_grad", "inference", "double", "keep_grads")


def draw_modes(rng: random.Random, case: Any) -> tuple[str, ...]:
    """Per step of ``case``, its mode ("" for a plain step; all plain in about 60% of cases)."""
    if rng.random() < 0.6:
        return ()
    modes = tuple(rng.choice(("", *MODES)) for _ in case.events)
    if "reentrant" in case.checkpoints or "inplace_view" in case.ops:
        return tuple("" if mode == "double" else mode for mode in modes)
    return modes


def second_input(case: Any, step: int, batch: int) -> torch.Tensor:
    """Another input of ``batch`` rows for ``step`` (the same on every run)."""
    values = np.random.default_rng(case.seed * 131 + step + 10**6).standard_normal((batch, case.width))
    return torch.from_numpy(values.astype(np.float32)).to(case.dtype)


def without_grad(mode: str, forward: Any, case: Any, step: int, batch: int, after: bool) -> None:
    """The step's forward without grad (its output dropped), if ``mode`` runs one at this point."""
    if mode == "no_grad" and not after:
        with torch.no_grad():
            forward(second_input(case, step, batch))
    elif mode == "inference" and after:
        with torch.inference_mode():
            forward(second_input(case, step, batch))


def backward(loss: torch.Tensor, model: torch.nn.Module, mode: str, retained: bool) -> None:
    """The step's backward: twice through a retained graph when ``retained``; a gradient penalty when ``mode`` is
    "double" (and some parameter is trained)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    if mode == "double" and trainable:
        grads = torch.autograd.grad(loss, trainable, create_graph=True, allow_unused=True)
        penalty = sum(grad.float().pow(2).sum() for grad in grads if grad is not None)
        (loss + 0.01 * penalty).backward()
        return
    if retained:
        loss.backward(retain_graph=True)
    loss.backward()
