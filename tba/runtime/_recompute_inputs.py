"""How a recomputed layer's inputs are saved for its recomputation, and how they come back.

Note: [A recomputed layer's input changed before backward]
Checkpoint saves a recomputed layer's inputs, not copies, and the recomputation starts from them.
A program that changes one in place after the layer's call and before backward (``x.mul_(2)`` on
the batch, ``h0.add_(1)`` on an activation the next block took; legal without tba when the layer
itself saves no tensor sharing the input's version counter, a block that starts with an addition)
got torch's in-place error from the unpack of the input, whose hint does not say which layer nor
that the layer's placement is the cause. The pair a ``recompute`` layer's inputs are saved under,
and the one pushed above tba's for an ``offloaded_recompute`` layer's (which passes each input to
tba's pack and unpack and keeps only a version watch beside it, no bytes: Note [In-place after
saving] in ``tba/runtime/_views.py``), check the input's version before anything else reads it and
raise :class:`~tba.errors.TbaError` naming the layer and the fix. Under
``allow_mutation_on_saved_tensors()``, where the change is legal and the input is cloned, no check is
pushed. The adaptive default already sees such a change in its profiled steps and never recomputes
the layer (Note [A recomputed layer's input changed after its forward] in ``tba/runtime/_timer.py``).
A change that no version counter sees (through ``.data``, through a numpy array sharing the
tensor's memory) is recomputed from, as under plain checkpoint (docs/api.md).

Note: [A recomputation gets its input's view-ness]
Autograd hands back a tensor that requires grad, saved under a pair, as a new tensor that is a
view of nothing (tba's offloaded tensors are rebuilt as such too): a layer called with a view
(``block(h[:, 8:24])``) saw ``_is_view()`` false and ``_base`` None in its recomputation, where
torch's checkpoint, which saves its inputs under no pair, hands back the view. A branch on
``_is_view()`` that computes the same values either way (``contiguous()``, a clone before an
in-place change) changed nothing, but a forward that reads its input's base (``h._base.mean()``)
computed another value in the recomputation, and the gradients differed from training without tba,
silently (helper-122). So an input that is a view of a plain tensor of its own dtype is saved as
its base, and the recomputation gets the view rebuilt on the base handed back
(:func:`saved_as_bases`): the same geometry and bytes (tba writes a whole storage either way), the
same ``requires_grad``, ``_base`` a tensor of the base's geometry, one object for a tensor the call
holds twice, and the base itself where the call holds it too. Saved as it is, reaching the
recomputation as a view of nothing: a view with another dtype, a conjugate or negative bit, of a
tensor subclass, or one that requires grad of a base that does not; and (helper-123) a view of a
nested tensor (``nested.unbind()[0]``: the base has no sizes, and the call failed in forward), one
that or whose base carries Python attributes (``v.scale = 3.0``: the rebuilt view, and the alias
below, came back without them, and a forward reading them computed another value, silently), and
one whose base holds another storage now (its ``.data`` swapped after the view was taken: the view
rebuilt on it read the new bytes). A kept base is held as an alias taken at the save (its storage
and version counter), as autograd holds the view: a program that swapped the base's ``.data`` after
the call (Megatron frees a sent output so) had the view rebuilt on the new data, other gradients or
an out-of-bounds error (helper-123). Under ``allow_mutation_on_saved_tensors()``, whose pair clones a
changed saved tensor, a base is saved only where a clone keeps its strides (it is dense) and holds
every element of the view: the view rebuilt on the clone of a base with gaps read other elements,
silently (helper-123). That pair holds the base itself, so a ``.data`` swap there is not covered.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import _StopRecomputationError

from tba._untrack import untrack
from tba.errors import TbaError
from tba.runtime._call_objects import Holder, changed_holder_message
from tba.runtime._pairs import is_tba_pair
from tba.runtime._views import Kept, version_watch

_PLAIN = (torch.Tensor, nn.Parameter)


class _Watched:
    """What the pair above tba's returns for an ``offloaded_recompute`` layer's input: tba's own record, and a watch
    of the input's version counter."""

    __slots__ = ("inner", "watch", "version", "what")

    def __init__(self, inner: Any, tensor: torch.Tensor) -> None:
        self.inner = inner
        self.what = f"{tensor.dtype} {list(tensor.shape)}"
        self.watch = version_watch(tensor)
        self.version = tensor._version
        untrack(self, self.watch)  # Note [Objects the cycle collector need not see] in tba/_untrack.py


def watched_inputs(layer: nn.Module, index: int, top: tuple[Any, Any] | None, keep: bool, bases: set[int]
                   ) -> contextlib.AbstractContextManager:
    """The saved-tensor pair a recomputed layer's inputs are saved under (Note [A recomputed layer's input changed
    before backward]): kept in memory (``keep``; the tensors whose ids are in ``bases`` as aliases: Note [A
    recomputation gets its input's view-ness]), else passed to ``top`` when it is tba's pair; none under another
    (``allow_mutation_on_saved_tensors()``'s)."""
    def changed(what: str, version: int, now: int) -> TbaError:
        return TbaError(
            f"an input of a recomputed layer (layer {index}, {type(layer).__name__}; {what}, the input or its base) "
            f"was changed in place after the layer's forward (version {version}, now {now}): its recomputation in "
            "backward would start from the changed input. Clone the input before changing it in place (x = x.clone()), "
            "change it after backward, or keep or offload this layer (policy='offload', or a tba.Plan that does not "
            "recompute it)")

    if keep:
        def pack_kept(tensor: torch.Tensor) -> Kept:
            held = torch.Tensor._make_subclass(torch.Tensor, tensor) if id(tensor) in bases else tensor
            return Kept(held, tensor._version)

        def unpack_kept(kept: Kept) -> torch.Tensor:
            if kept.tensor._version != kept.version:
                raise changed(f"{kept.tensor.dtype} {list(kept.tensor.shape)}", kept.version, kept.tensor._version)
            return kept.tensor

        return torch.autograd.graph.saved_tensors_hooks(pack_kept, unpack_kept)
    if top is None or not is_tba_pair(top):  # allow_mutation_on_saved_tensors()'s: a change there is legal
        return contextlib.nullcontext()
    pack, unpack = top

    def pack_watched(tensor: torch.Tensor) -> Any:
        inner = pack(tensor)
        return _Watched(inner, tensor) if type(tensor) in _PLAIN and not tensor.is_inference() else inner

    def unpack_watched(saved: Any) -> torch.Tensor:
        if type(saved) is not _Watched:
            return unpack(saved)
        if saved.watch._version != saved.version:
            raise changed(saved.what, saved.version, saved.watch._version)
        return unpack(saved.inner)

    return torch.autograd.graph.saved_tensors_hooks(pack_watched, unpack_watched)


def _rebuildable_base(tensor: torch.Tensor, cloned: bool) -> torch.Tensor | None:
    """``tensor``'s base when the view can be rebuilt on it by ``as_strided`` (Note [A recomputation gets its input's
    view-ness]; on a clone of it where ``cloned``), else None."""
    base = tensor._base if tensor._is_view() else None
    if (base is None or type(tensor) not in _PLAIN or type(base) not in _PLAIN or base.dtype != tensor.dtype
            or tensor.layout is not torch.strided or base.layout is not torch.strided or base.is_nested
            or tensor.is_inference()
            or tensor.is_quantized
            or tensor.is_conj() != base.is_conj() or tensor.is_neg() != base.is_neg()
            or (tensor.requires_grad and not base.requires_grad) or tensor.__dict__ or base.__dict__
            or tensor.untyped_storage()._cdata != base.untyped_storage()._cdata
            or (cloned and not _clone_holds(base, tensor))):
        return None
    return base


def _clone_holds(base: torch.Tensor, view: torch.Tensor) -> bool:
    """Whether a clone of ``base`` keeps its strides (it is dense, without overlap) and holds every element ``view``
    reads."""
    expected = 1
    for stride, size in sorted((stride, size) for size, stride in zip(base.shape, base.stride()) if size != 1):
        if stride != expected:
            return False
        expected *= size
    first = view.storage_offset() - base.storage_offset()
    last = first + sum((size - 1) * stride for size, stride in zip(view.shape, view.stride()))
    return view.numel() > 0 and first >= 0 and last < base.numel()


def saved_as_bases(tensors: list[torch.Tensor], cloned: bool
                   ) -> tuple[list[torch.Tensor], Callable[[tuple[torch.Tensor, ...]], tuple[torch.Tensor, ...]], set[int]]:
    """What checkpoint saves for a call's ``tensors`` (each view of a plain tensor as its base; Note [A recomputation
    gets its input's view-ness]), what turns what it hands back into the call's tensors, views again, and the ids of
    the bases among them. ``cloned``: saved under ``allow_mutation_on_saved_tensors()``'s pair."""
    saved: list[torch.Tensor] = []
    where: dict[int, int] = {}
    plan: list[tuple[int, Any]] = []
    bases: set[int] = set()
    for tensor in tensors:
        base = _rebuildable_base(tensor, cloned)
        if base is not None:
            bases.add(id(base))
        held = tensor if base is None else base
        if id(held) not in where:
            where[id(held)] = len(saved)
            saved.append(held)
        geometry = None if base is None else (tuple(tensor.shape), tuple(tensor.stride()),
                                              tensor.storage_offset() - base.storage_offset(), tensor.requires_grad)
        plan.append((where[id(held)], geometry))

    def views_again(handed: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        out = []
        for position, geometry in plan:
            root = handed[position]
            if geometry is None:
                out.append(root)
                continue
            size, stride, offset, requires_grad = geometry
            source = root if requires_grad or not root.requires_grad else root.detach()
            out.append(source.as_strided(size, stride, root.storage_offset() + offset))
        return tuple(out)

    return saved, views_again, bases


@contextlib.contextmanager
def inputs_left_alone(layer: nn.Module, index: int, inputs: tuple[torch.Tensor, ...]) -> Iterator[None]:
    """Raise :class:`TbaError` when the recomputation run inside changes one of its inputs in place.

    Note: [A recomputation must leave its inputs as they are]
    The first call of a recomputed layer changed none of its inputs (Note [A recomputed layer must
    not change its input], below), so a recomputation that changes one took
    another path than the first call: a forward that clones a view before scaling it in place and
    scales any other input in place (``h.clone() if h._is_view() else h``) changed the caller's own
    activation in backward, silently, while the recomputation got no view (helper-122). Its inputs
    share the saved tensors' version counters, so the check is their versions around the recomputation,
    through torch's early stop too (whose exception ends it once every tensor is rebuilt). Whatever
    the branch (a view tba cannot rebuild, ``is_leaf``, a ``data_ptr`` comparison), the change is loud.
    """
    versions = [(tensor, tensor._version) for tensor in inputs if not tensor.is_inference()]

    def check() -> None:
        for tensor, version in versions:
            if tensor._version != version:
                raise TbaError(
                    f"the recomputation of a recomputed layer (layer {index}, {type(layer).__name__}) changed its input "
                    f"({tensor.dtype} {list(tensor.shape)}) in place, which its first call did not: it took another "
                    "path than the first call (a branch on x._is_view(), x._base, x.is_leaf or x.data_ptr()). Keep or "
                    "offload this layer, or make its forward take the same path for any input")

    try:
        yield
    except _StopRecomputationError:
        check()
        raise
    check()


def check_inputs_unchanged(layer: nn.Module, inputs: list[tuple[int | Holder, torch.Tensor, int]],
                            private_change: str | None = None) -> None:
    """Raise :class:`TbaError` when the first call of a recomputed layer changed one of its own inputs in place,
    or private state of its modules (``private_change``: the changed value's label; Note [Private state of a
    recomputed layer] in ``tba/runtime/_private_state.py``).

    Note: [A recomputed layer must not change its input]
    Checkpoint keeps a recomputed layer's inputs, not copies of them: a forward that changes its
    input in place (``x.mul_(0.9)`` before any operation saves ``x``, legal without tba) leaves the
    recomputation a changed input, and backward failed with torch's in-place error, whose hint
    blamed the user's code, many steps into an adaptive run whose profiled steps had offloaded the
    layer without trouble. The change is seen here, in forward, right after the call. The profiled
    steps watch for it too (the layer timer compares the versions of every tensor of the call,
    keyword and nested arguments included, around each layer's forward, ``tba/runtime/_timer.py``):
    such a layer's profile is marked ``recomputable=False`` and the adaptive planner never
    recomputes it. Neither looks with grad disabled (checkpoint then recomputes nothing) nor in
    inference mode (whose tensors have no version); the timer cannot look inside a layer compiled
    on its own, whose recomputation still raises here. A tensor an object passed as it is holds (a
    module's buffer) is named with its holder (helper-93 found one called "tensor argument 3").
    """
    if private_change is not None:
        raise TbaError(
            f"the forward of a recomputed layer ({type(layer).__name__}) changed private state of its modules "
            f"({private_change}), which tba does not put back for the recomputation in backward. Register a tensor "
            "as a buffer (module.register_buffer) or make the attribute public, which tba restores, or keep or "
            "offload this layer")
    for position, tensor, version in inputs:
        if tensor._version != version and isinstance(position, Holder):  # held by an object passed as it is
            raise TbaError(changed_holder_message(type(layer).__name__, position, version, tensor._version))
        if tensor._version != version:
            raise TbaError(
                f"the forward of a recomputed layer ({type(layer).__name__}) changed its own input in place (tensor "
                f"argument {position}, version {version}, now {tensor._version}): its recomputation in backward would "
                "start from the changed input. Keep or offload this layer (policy='offload', or a tba.Plan that does "
                "not recompute it), or make the change out of place (x = x * 0.9 instead of x.mul_(0.9))")
