"""tba's recomputations run each layer to its end: torch's early stop is off while tba calls checkpoint.

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
to recompute. So tba turns early stop off around its own checkpoint calls (the setting is read when
checkpoint is called, in forward): a recomputation then also runs the operators after the layer's last
saved tensor, usually a residual add.

torch keeps the setting in one module global, and ``set_checkpoint_early_stop`` restores the value it
found, so two threads interleaving it can leave it off for good. :data:`RUN_TO_END` counts the calls in
flight on all threads under a lock: the first turns early stop off and the last puts back what it found.
Another thread's own checkpoint called meanwhile also runs to its end, which changes no result.
"""

from __future__ import annotations

import threading
from typing import Any

import torch.utils.checkpoint as torch_checkpoint


class _RunToEnd:
    """Context manager: early stop off while any tba recomputation is being set up (Note above)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._depth = 0
        self._found: Any = None

    def __enter__(self) -> None:
        with self._lock:
            if self._depth == 0:
                self._found = torch_checkpoint._enable_checkpoint_early_stop
                torch_checkpoint._enable_checkpoint_early_stop = False
            self._depth += 1

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._depth -= 1
            if self._depth == 0:
                torch_checkpoint._enable_checkpoint_early_stop = self._found
                self._found = None

    def __repr__(self) -> str:
        return f"RunToEnd(in_flight={self._depth})"


RUN_TO_END = _RunToEnd()
"""Entered around each of tba's ``checkpoint`` calls."""
