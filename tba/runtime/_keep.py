"""Why a saved tensor stays in memory, and the region where the user asks for that.

:class:`KeepReason` names every reason ``Offloader.pack`` keeps a tensor instead of writing it;
stats count kept tensors and bytes per reason (``OffloadStats.kept_by_reason``), and integrations
add reasons of their own by overriding ``Offloader.keep_reason``, never the hook itself.

:class:`KeepDecision` is where that method comes from: a base of the saved-tensor hooks
(``tba/runtime/_hooks.py``) whose ``keep_reason`` tries the reasons in order (the cheap tests of
the tensor first, then its storage, then the layer's plan) and returns the first that holds; a kept
layer past its keep cap (a step following a larger input shape's plan) offloads instead.

Note: [A tensor with attributes stays in memory]
Without hooks, autograd hands backward the very object it saved when that tensor is not the
node's output and requires no grad: a custom ``autograd.Function`` whose backward reads
``getattr(extra, "scale", 1.0)`` of a saved tensor sees the attribute, and so does the
recomputation of an ``offloaded_recompute`` layer given ``extra`` as an argument. A written
tensor came back as a new one, without its attributes: gradients differed, silently, under
``offload`` and ``offloaded_recompute`` (helper-93 found it). Such a tensor is kept
(:attr:`KeepReason.ATTRIBUTES`; ``Kept`` returns the object itself, which has no grad_fn to detach).
The test comes last, run only for a tensor that would be written: ``requires_grad`` first, then,
only for a tensor that requires no grad, its ``__dict__``. Reading ``__dict__`` makes it on first
access under Python 3.11: an empty dict that lives as long as the tensor and counts toward the cycle
collector's young generation (``gc.get_count()`` rose by 0.99 per fresh tensor read), which is what
starts its collections (docs/host-cost.md, thirty-fourth pass); most saved activations require grad,
so the common save makes none (0.07 us for ``requires_grad`` alone against 0.10 for a first
``__dict__``, measured on fresh tensors; the order was the other way round until stop 73). One that
requires grad stays on the disk path: autograd wraps what any unpack hook returns for it in a new
tensor object (torch's own checkpoint and ``save_on_cpu`` lose its attributes too), so keeping it
would not bring them back.

:func:`keep_in_memory` opts a region out of offloading, as torchtune's ``NoOpManager`` does: inside
it, every tensor autograd saves stays in memory, whatever the offloader's plan. It is per thread
and nests. :func:`kept_after_block` keeps what hooks left installed after their block still see.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import threading
from typing import TYPE_CHECKING, Any, TypeVar, overload

import torch
from torch import nn

from tba.device import DEVICE_TYPES, cuda_api, is_device_tensor
from tba.errors import TbaConfigError
from tba.runtime._compiling import compiling
from tba.runtime._views import Kept

QUANTIZED_DTYPES = frozenset((torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4))
"""Dtypes whose tensors stay in memory even when ``is_quantized`` is False (``x.view(torch.qint32)``): a
rebuilt one has no quantizer, and using it crashed the process (segmentation fault, or torch's internal
assert in Quantizer.cpp)."""

if TYPE_CHECKING:
    from collections.abc import Callable

    from tba.runtime._layers import LayerTracker, StateKeys

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
    """Sparse, nested, quantized (or of a quantized dtype) or meta."""
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
    ATTRIBUTES = "tensor with attributes"
    """A tensor that requires no grad and carries Python attributes (``extra.scale = 3.0``): a rebuilt one would
    come back without them (Note [A tensor with attributes stays in memory])."""
    SAVE_FAILED = "save failed"
    """A tensor whose save could not start (its device route could not be built, or the store raised while
    registering it): kept with a warning naming the error, so training stays exact."""
    EMPTY_STORAGE = "empty storage"
    """A view of no elements whose storage the program freed (``untyped_storage().resize_(0)``) before its deferred
    save: there are no bytes to write (Note [An empty storage is not saved] in ``tba/runtime/_writes.py``)."""

    def __str__(self) -> str:
        return self.value

    @property
    def is_state(self) -> bool:
        """Parameters and buffers: not counted as kept activation bytes."""
        return self in (KeepReason.PARAMETER, KeepReason.MODULE_STATE)


class _Region(threading.local):
    """This thread's depth of :func:`keep_in_memory` blocks (a class default: a thread that never entered one
    reads 0 without the missed-attribute lookup, 0.8 µs, that ``getattr(local, name, 0)`` costs per saved tensor)."""

    depth = 0


_region = _Region()
_F = TypeVar("_F", bound="Callable[..., Any]")


class keep_in_memory(contextlib.ContextDecorator):  # noqa: N801 - a function before, and called as one
    """Inside this block (this thread only), saved tensors stay in memory even under an offload context.

    Example::

        with tba.offload_activations():
            hidden = blocks(x)
            with tba.keep_in_memory():
                logits = head(hidden)     # saved in memory, as without tba

    As a decorator (``@tba.keep_in_memory`` or ``@tba.keep_in_memory()``) each call of the function runs in a region
    of its own.

    Note: [keep_in_memory inside a compiled graph]
    Dynamo traced the region's entry and exit into the graph of a compiled block or model that used it, and its
    write to the thread's depth failed torch.compile's first call with an internal ``AssertionError: Guard
    failed on the same frame it was created``, tba or not (helper-125). Traced, ``is_compiling()`` is the
    constant True and the region traces nothing: it does nothing there, as it could do nothing anyway (a
    compiled graph saves its tensors when it returns, outside the region). Around a compiled call in eager
    code it keeps what the call saves. An exit undoes only what its own entry did.

    Note: [A region object entered twice at once]
    One object may be entered again before it exits: ``KEEP = tba.keep_in_memory()`` used as ``with KEEP:`` in a
    module called inside itself, or by two threads. A single flag recorded its entry, and the inner (or the other
    thread's) exit cleared it: the outer exit then undid nothing, and the thread stayed inside the region for good,
    every tensor it saved afterwards kept in memory without a word. Each entry pushes what it did and each exit pops
    one (the depth it changes is the exiting thread's own; entries differ only under tracing, where none counts).
    """

    @overload
    def __new__(cls) -> keep_in_memory: ...
    @overload
    def __new__(cls, func: _F) -> _F: ...

    def __new__(cls, func: Callable[..., Any] | None = None) -> Any:
        """``@tba.keep_in_memory`` without parentheses decorates ``func`` as ``@tba.keep_in_memory()`` does (as
        ``@torch.no_grad`` is written); it raised a bare TypeError at the decorated function's definition.

        Note: [The region's constructor is its __new__]
        mypy types a call of a class that defines both ``__init__`` and ``__new__`` by ``__init__``: with an
        ``__init__(self)`` here, ``@tba.keep_in_memory`` failed a user's type check ("Too many arguments"), and each
        call of the decorated function after it. So the class has no ``__init__`` of its own: ``__new__``'s
        overloads (an instance, or the decorated function) are what checkers read, and it sets the instance up.
        """
        if func is None:
            region = super().__new__(cls)
            region._entered = []
            return region
        if not callable(func):
            raise TbaConfigError(f"tba.keep_in_memory takes no arguments: use 'with tba.keep_in_memory():', or decorate "
                                 f"a function with @tba.keep_in_memory (got {type(func).__name__} {func!r})")
        return cls()(func)

    _entered: list[bool]
    """What each entry not yet exited did: True where it counted in this thread's depth."""

    def _recreate_cm(self) -> keep_in_memory:
        return type(self)()  # each call of a decorated function enters a region of its own

    def __enter__(self) -> None:
        counted = not compiling()
        self._entered.append(counted)
        if counted:
            _region.depth += 1

    def __exit__(self, *exc_info: object) -> None:
        if self._entered and self._entered.pop():
            _region.depth -= 1


def in_keep_region() -> bool:
    """True inside :func:`keep_in_memory` on this thread."""
    return _region.depth > 0


_WARNED_SUBCLASSES: set[type] = set()


def warn_subclass_kept(kind: type) -> None:
    """Say once per tensor subclass (Float8Tensor, DTensor, ...) that its saved tensors stay in memory."""
    if kind not in _WARNED_SUBCLASSES:
        _WARNED_SUBCLASSES.add(kind)
        logger.warning("tba: saved tensors of subclass %s.%s stay in memory (stats.kept_by_reason['tensor subclass']): "
                       "tba writes plain tensors only", kind.__module__, kind.__qualname__)


class KeepDecision:
    """Mixin of the saved-tensor hooks: whether a saved tensor stays in memory, and why. :class:`tba.Offloader`
    sets every attribute it reads."""

    _state_keys: StateKeys
    _staged_devices: tuple[str, ...]
    _tracker: LayerTracker
    min_offload_bytes: int
    keep_layers: set[int | None]
    _keep_caps: tuple[int, ...] | None
    _kept_this_step: dict[int, int]
    _kept_storages: set[int]

    def keep_reason(self, tensor: torch.Tensor) -> KeepReason | None:
        """Why ``tensor`` stays in memory, or None when it goes to disk (integrations extend this)."""
        if in_keep_region():
            return KeepReason.USER_REGION
        device_type = "cpu" if tensor.is_cpu else tensor.device.type  # is_cpu: no torch.device object made
        if is_device_tensor(tensor, device_type) and cuda_api().is_current_stream_capturing():
            return KeepReason.CUDA_GRAPH_CAPTURE
        if type(tensor) is not torch.Tensor:
            if isinstance(tensor, nn.Parameter):
                return KeepReason.PARAMETER
            warn_subclass_kept(type(tensor))
            return KeepReason.TENSOR_SUBCLASS
        if tensor.layout is not torch.strided or tensor.is_nested or tensor.dtype in QUANTIZED_DTYPES or tensor.is_meta:
            return KeepReason.NOT_STRIDED
        if tensor.is_conj() or tensor.is_neg():
            return KeepReason.LAZY_VIEW
        if device_type not in DEVICE_TYPES:
            return KeepReason.UNSUPPORTED_DEVICE
        base = tensor._base if tensor._is_view() else tensor
        if base.is_leaf and (base.requires_grad or isinstance(base, nn.Parameter)):
            return KeepReason.PARAMETER
        try:
            storage = tensor.untyped_storage()
            address = storage.data_ptr()
        except (NotImplementedError, RuntimeError):
            return KeepReason.NO_STORAGE
        if storage._cdata in self._state_keys:
            return KeepReason.MODULE_STATE
        nbytes = storage.nbytes()
        if nbytes == 0 or nbytes < self.min_offload_bytes:
            return KeepReason.SMALL
        if device_type not in self._staged_devices and address % 64:
            return KeepReason.UNALIGNED
        layer = self._tracker.current
        if layer in self.keep_layers and (self._keep_caps is None or self._within_keep_cap(layer, storage._cdata, nbytes)):
            return KeepReason.LAYER_KEPT
        if not tensor.requires_grad and tensor.__dict__:  # Note [A tensor with attributes stays in memory]
            return KeepReason.ATTRIBUTES
        return None

    def _within_keep_cap(self, layer: int | None, key: int, nbytes: int) -> bool:
        """Whether a kept layer may keep one more storage this step, when caps are set: a step following a plan keeps at
        most what the plan's input shape saved in each layer when it was profiled (Note [A covered step keeps no more
        than the plan was made for] in ``tba/runtime/_input_shapes.py``); past it, the layer offloads."""
        caps = self._keep_caps
        if layer is None or not 0 <= layer < len(caps) or key in self._kept_storages:
            return True  # a storage kept already (saved again) adds nothing
        total = self._kept_this_step.get(layer, 0) + nbytes
        if total > caps[layer]:
            return False
        self._kept_this_step[layer] = total
        self._kept_storages.add(key)
        return True


_warned_orphaned = False


def kept_after_block(tensor: torch.Tensor) -> Kept:
    """The pack of hooks left installed after their block ended: the tensor stays in memory.

    Note: [Hooks left installed after their block]
    The offloader's exit pops the pair on top of the thread's stack. When a context inside the
    block had its own Python exit skipped by a signal handler's exception (torch's checkpoint,
    in a recomputed layer), its pair was the one on top, and the offloader's stays installed
    (``tba/_whole_exit.py`` says why the exit cannot pop both). Every tensor saved on this thread
    afterwards comes here: it is kept as without tba, with one warning, instead of raising
    at every later forward. So does one saved on the thread that entered a block exited on another
    thread (Note [A block's hooks come off only on its thread] in ``tba/_whole_exit.py``).
    """
    global _warned_orphaned
    if not _warned_orphaned:
        _warned_orphaned = True
        logger.warning("tba: the saved-tensor hooks of an offloader whose with block has ended are still installed "
                       "on this thread (an exception skipped the exit of a context inside that block, such as "
                       "torch.utils.checkpoint's, or the block was exited on another thread than the one that entered "
                       "it); tensors saved outside tba stay in memory, as without tba")
    return Kept(tensor.detach() if tensor.grad_fn is not None else tensor, tensor._version)
