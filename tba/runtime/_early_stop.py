"""When tba's recomputations run each layer to its end: only under CUDA tools that break torch's early stop.

Note: [Recomputation runs to the end]
Non-reentrant ``torch.utils.checkpoint`` stops a recomputation early: once the last tensor the layer
saved has been rebuilt, its recomputation pack hook raises ``_StopRecomputationError``, which travels
out through the C++ operator that was saving (a dropout, a matmul) and is caught by checkpoint. On CUDA
under torch 2.11 that breaks whenever something runs Python inside the operator while the exception is
pending: with ``torch.cuda.memory._record_memory_history`` on (it gathers Python stacks at every
allocation) or under ``TORCH_CUDA_SANITIZER=1`` (its trace hooks are Python), the operator returned NULL
without an exception (``SystemError`` in backward) in 200 of 200 steps of a checkpointed dropout layer on
an H200, without tba, and a checkpoint frame stayed alive with the recomputed tensors (docs/gpu.md, the
third run). A user debugging memory with the history on would meet it in a layer the adaptive plan chose
to recompute.

So while either tool is on (:func:`run_to_end_needed`), tba calls checkpoint with ``early_stop=False``:
no exception crosses an operator. Only then, because early stop is worth keeping otherwise (helper-22's
review of an always-on version): a Linear's pack hook runs before its matmul, so running to the end
recomputes the block's last projection too (a pre-norm MLP block's backward went from 10.5 to 12.6
MFLOP); the operators after the last saved tensor run twice (a private counter, a forward hook, a
draw from a generator the layer does not hold), and a recomputation that saves more tensors than the
first call raises checkpoint's error instead of being cut short. These are torch's
``early_stop=False`` behaviours, met here only under those two tools. The keyword goes to this call
only: torch's module global (``set_checkpoint_early_stop``) is left alone, and a user's setting of it
takes precedence, as torch defines. torch releases without the keyword keep early stop.
"""

from __future__ import annotations

import inspect
import sys

import torch
from torch.utils.checkpoint import checkpoint

HAS_EARLY_STOP_KEYWORD = "early_stop" in inspect.signature(checkpoint).parameters
"""Whether this torch's ``checkpoint`` takes ``early_stop=``."""


def run_to_end_needed() -> bool:
    """Whether CUDA memory-history recording or the CUDA sanitizer is on (Note [Recomputation runs to the end])."""
    if not torch.cuda.is_initialized():
        return False
    history_enabled = getattr(torch._C, "_cuda_isHistoryEnabled", None)
    if history_enabled is not None and history_enabled():
        return True
    sanitizer = sys.modules.get("torch.cuda._sanitizer")
    return bool(getattr(getattr(sanitizer, "cuda_sanitizer", None), "enabled", False))


def checkpoint_keywords() -> dict[str, bool]:
    """The keywords tba adds to its ``checkpoint`` calls: ``early_stop=False`` when it must run to the end."""
    return {"early_stop": False} if HAS_EARLY_STOP_KEYWORD and run_to_end_needed() else {}
