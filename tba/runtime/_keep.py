"""Why a saved tensor stays in memory, and the region where the user asks for that.

:class:`KeepReason` names every reason ``Offloader.pack`` keeps a tensor instead of writing it;
stats count kept tensors and bytes per reason (``OffloadStats.kept_by_reason``), and integrations
add reasons of their own by overriding ``Offloader.keep_reason``, never the hook itself.

:func:`keep_in_memory` opts a region out of offloading, as torchtune's ``NoOpManager`` does: inside
it, every tensor autograd saves stays in memory, whatever the offloader's plan. It is per thread
and nests. :func:`kept_after_block` keeps what hooks left installed after their block still see.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import threading
from collections.abc import Iterator

import torch

from tba.runtime._views import Kept

logger = logging.getLogger("tba")


class KeepReason(str, enum.Enum):
    """Why a saved tensor was not written. A ``str`` enum: each member equals its text in stats and logs."""

    PARAMETER = "parameter"
    """A leaf that requires grad, or any ``nn.Parameter`` (frozen ones too), or a view of one."""
    MODULE_STATE = "parameter or buffer"
    """A parameter or buffer of the model's layers (frozen weights included)."""
    TENSOR_SUBCLASS = "tensor subclass"
    """Not a plain ``torch.Tensor`` (Float8Tensor, DTensor, ...): its bytes are not one storage tba can rebuild."""
    NOT_STRIDED = "not a plain strided tensor"
    """Sparse, nested, quantized or meta."""
    NO_STORAGE = "no storage of its own"
    """Its storage cannot be read: ``torch.vmap``'s batched tensors, some of forward-mode AD's."""
    LAZY_VIEW = "lazy conjugate or negative view"
    """``is_conj()`` or ``is_neg()``: rebuilding would lose the lazy bit."""
    UNSUPPORTED_DEVICE = "device not supported"
    """Neither CPU nor CUDA."""
    SMALL = "small"
    """Storage below ``min_offload_bytes``."""
    UNALIGNED = "storage not 64-byte aligned"
    """A host storage whose address O_DIRECT cannot write from."""
    LAYER_KEPT = "layer kept by policy"
    """The placement keeps the current layer in memory."""
    USER_REGION = "inside tba.keep_in_memory()"
    """Saved inside :func:`keep_in_memory`."""
    CUDA_GRAPH_CAPTURE = "CUDA graph capture"
    """Saved while the current CUDA stream is being captured into a graph: events and host waits are illegal there."""
    RECOMPUTED_ELSEWHERE = "recomputed by the framework in backward"
    """Saved inside a framework's own recomputed region (Megatron's checkpointing), a throw-away graph."""

    def __str__(self) -> str:
        return self.value

    @property
    def is_state(self) -> bool:
        """Parameters and buffers: not counted as kept activation bytes."""
        return self in (KeepReason.PARAMETER, KeepReason.MODULE_STATE)


_region = threading.local()


@contextlib.contextmanager
def keep_in_memory() -> Iterator[None]:
    """Inside this block (this thread only), saved tensors stay in memory even under an offload context.

    Example::

        with tba.offload_activations():
            hidden = blocks(x)
            with tba.keep_in_memory():
                logits = head(hidden)     # saved in memory, as without tba
    """
    _region.depth = getattr(_region, "depth", 0) + 1
    try:
        yield
    finally:
        _region.depth -= 1


def in_keep_region() -> bool:
    """True inside :func:`keep_in_memory` on this thread."""
    return getattr(_region, "depth", 0) > 0


_WARNED_SUBCLASSES: set[type] = set()


def warn_subclass_kept(kind: type) -> None:
    """Say once per tensor subclass (Float8Tensor, DTensor, ...) that its saved tensors stay in memory."""
    if kind not in _WARNED_SUBCLASSES:
        _WARNED_SUBCLASSES.add(kind)
        logger.warning("tba: saved tensors of subclass %s.%s stay in memory (stats.kept_by_reason['tensor subclass']): "
                       "tba writes plain tensors only", kind.__module__, kind.__qualname__)


_warned_orphaned = False


def kept_after_block(tensor: torch.Tensor) -> Kept:
    """The pack of hooks left installed after their block ended: the tensor stays in memory.

    Note: [Hooks left installed after their block]
    The offloader's exit pops the pair on top of the thread's stack. When a context inside the
    block had its own Python exit skipped by a signal handler's exception (torch's checkpoint,
    in a recomputed layer), its pair was the one on top, and the offloader's stays installed
    (``tba/_whole_exit.py`` says why the exit cannot pop both). Every tensor saved on this thread
    afterwards comes here: it is kept as without tba, with one warning, instead of raising
    at every later forward.
    """
    global _warned_orphaned
    if not _warned_orphaned:
        _warned_orphaned = True
        logger.warning("tba: the saved-tensor hooks of an offloader whose with block has ended are still installed "
                       "on this thread (an exception skipped the exit of a context inside that block, such as "
                       "torch.utils.checkpoint's); tensors saved outside tba stay in memory, as without tba")
    return Kept(tensor.detach() if tensor.grad_fn is not None else tensor, tensor._version)
