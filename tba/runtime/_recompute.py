"""Recompute chosen layers in backward with non-reentrant ``torch.utils.checkpoint``.

A recomputed layer saves only its inputs during forward; its internals are computed again in
backward. Where its inputs live is the placement's: a ``recompute`` layer keeps them in memory, as
plain checkpoint does; an ``offloaded_recompute`` layer saves them through tba, which writes them
to the spill file and reads them back (prefetched) for the recomputation (Note [Hook nesting of a
recomputed layer]). RNG state is preserved, so dropout masks are identical in the recomputation.

Note: [Hook nesting of a recomputed layer]
Saved-tensor hooks form a per-thread stack and autograd uses only the top pair. Non-reentrant
checkpoint saves the layer's tensor arguments (``_CheckpointFrame.save_inputs``, or
``_NoopSaveInputs`` in older torch) *before* it pushes its own pair, so those saves go to whatever
pair was on top when the layer was called: tba's, inside ``with offloader:``. It then pushes its
pair for the layer's forward: every tensor saved inside is replaced by a placeholder and dropped,
whatever pairs lie below, so nothing inside the layer reaches tba. In backward, the first unpack
of a placeholder runs the recomputation under checkpoint's recomputation pair, again on top: the
rebuilt internals stay in memory, never offloaded a second time, even when backward runs inside
the ``with`` block. So:

* ``offloaded_recompute`` calls checkpoint with tba's pair on top: the inputs are offloaded like any
  saved tensor (below ``min_offload_bytes``, or parameters, they stay in memory), tagged with the
  layer (its forward pre-hook has run), and read back when backward reaches the layer. Checkpoint
  saves only *top-level* tensor arguments; tensors in keyword arguments or nested in tuples would
  stay referenced by its closure, in memory. The wrapper therefore flattens ``(args, kwargs)``
  (``torch.utils._pytree``), passes every tensor leaf as a top-level argument and rebuilds the call
  inside, so each one is saved, and offloaded, on its own; a view stays a view of its storage (tba
  writes the storage once and rebuilds the view).
* ``recompute`` pushes a pair of its own around the checkpoint call, so its inputs are held by
  autograd as without tba (the cost model counts them as held; tba's stats do not see them); the
  pair checks their versions at unpack, as autograd does without hooks.
* When the pair on top is not tba's (the user's own non-reentrant checkpoint around the layer, or
  another hooks context inside tba's), an ``offloaded_recompute`` layer runs as ``recompute``: its
  inputs would be saved into the outer pair's frame, whose recomputation then saw the saves in
  another order (silently wrong gradients with a checkpointed block whose first save had the
  input's shape, torch's metadata error otherwise).

Note: [Side effects of a recomputed forward]
The recomputation must run the forward the first call ran, and must not change the model a second
time. A forward may update buffers in place (BatchNorm's running statistics, spectral norm's power
iteration vectors, an exponential average it then subtracts) and assign plain attributes (a call
counter); when it also *reads* them, a recomputation from the state the first call left computes
another forward, and gradients differ from training without tba. So the wrapper tells the first
call of ``forward`` from the recomputation (checkpoint calls the same function again during
backward). Before the first call it copies every buffer and plain attribute of the layer's modules;
right after it, the copies of buffers the call did not change (same version counter, same tensor)
are dropped, so only what the forward updates (usually a few small vectors) is held until backward;
the copy itself costs one memcpy of the layer's buffers per step (a causal mask of 16-64 KiB in the
``tba.bench`` GPTs).
The recomputation then copies the state as it is, loads the state the first call started from, runs
the forward, and restores what it copied, bit for bit. The copy back keeps each buffer's version
counter: the recomputed forward's in-place update already bumped it, and nodes it built (under
``create_graph``) saved the buffer at that version; another bump would make their unpack raise the
in-place error on a program torch runs.

Note: [A recomputed layer's parameters must not change before backward]
Without tba, a parameter autograd saved and the optimiser (or the user) changed in place before
backward makes unpack raise torch's in-place error; one it did not save is not read again. A
recomputation reads every parameter of the layer again, so a change between forward and backward
would silently give the gradients of another forward. The wrapper records each parameter's version
counter (and each buffer's that the first call left unchanged, whose value it does not keep) when
the first call ends, and before recomputing raises :class:`~tba.errors.TbaError` naming the tensor
when one moved. Loud where torch may be silent (a weight that no saved tensor aliases), never wrong.

Note: [Generators of a recomputed layer]
Checkpoint preserves the global RNG states only. A layer that draws from a ``torch.Generator`` of
its own (held as an attribute of one of its modules, or in a dict, list or tuple attribute) would draw a different mask in the
recomputation, so its gradients would be those of another forward, and the generator would end
advanced twice. The wrapper records each such generator's state before the first forward, sets it
back before the recomputation and, afterwards, restores the state the first forward left. A
generator the layer reaches any other way (a module-level global) is not found: as under plain
checkpoint, keep or offload such a layer instead of recomputing it.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.autograd.grad_mode import _unsafe_preserve_version_counter
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import checkpoint

from tba.errors import TbaConfigError, TbaError
from tba.runtime._hooks import SavedTensorHooks
from tba.runtime._views import Kept

_PLAIN_TYPES = (int, float, bool, str, bytes, type(None))


class RecomputeLayers:
    """Wraps ``layers``' forward with checkpoint until :meth:`remove` (or the ``with`` block ends).

    Args:
        layers: The layers to recompute.
        indices: Their indices in the model's layers (for messages). Default: 0, 1, ...
        offload_inputs: Per layer (or one value for all): save its inputs through the hooks below
            (tba's: ``offloaded_recompute``) instead of keeping them in memory (``recompute``).
            Default False.

    Raises:
        TbaConfigError: a layer already has a ``forward`` attribute of its own (patched by hand or by
            another tool): wrapping it would hide that one.
    """

    def __init__(self, layers: Iterable[nn.Module], indices: Iterable[int] | None = None,
                 offload_inputs: bool | Iterable[bool] = False) -> None:
        layers = list(layers)
        indices = list(indices) if indices is not None else list(range(len(layers)))
        offload = [offload_inputs] * len(layers) if isinstance(offload_inputs, bool) else list(offload_inputs)
        index_of = {id(layer): index for index, layer in zip(indices, layers)}
        for index, layer in zip(indices, layers):
            inner = next((module for module in layer.modules() if module is not layer and id(module) in index_of), None)
            if inner is not None:
                raise TbaConfigError(
                    f"layers {index} ({type(layer).__name__}) and {index_of[id(inner)]} ({type(inner).__name__}) are "
                    f"both recomputed, and layer {index_of[id(inner)]} is inside layer {index}: one recomputation would "
                    "run inside the other; recompute only one of them (keep or offload the other), or pass layers= "
                    "that do not nest")
            if "forward" in vars(layer):
                raise TbaConfigError(
                    f"layer {index} ({type(layer).__name__}) has a forward set on the instance, which the plan "
                    "would recompute: tba wraps the class's forward for recomputation and cannot wrap a patched "
                    "one; remove the instance attribute (del layer.forward), or keep or offload that layer")
        self.layers = layers
        for layer, spill in zip(self.layers, offload):
            layer.forward = _checkpointed(layer, layer.forward, spill)

    def remove(self) -> None:
        for layer in self.layers:
            if "forward" in vars(layer):
                del layer.forward
        self.layers = []

    def __enter__(self) -> RecomputeLayers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def _checkpointed(layer: nn.Module, forward: Any, offload_inputs: bool) -> Any:
    def first_or_again(calls: list[int], first: _FirstCall, *args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == 1:
            first.generators = _generator_states(layer)
            first.before = _snapshot(layer)
            out = forward(*args, **kwargs)
            first.settle(layer)
            return out
        first.check_unchanged(layer)
        after = _snapshot(layer)
        after_generators = _generator_states(layer)
        _restore(after, first.before)
        for generator, state in first.generators.values():
            generator.set_state(state)
        try:
            return forward(*args, **kwargs)
        finally:
            _restore(after, after)
            for generator, state in after_generators.values():
                generator.set_state(state)

    def run(*args: Any, **kwargs: Any) -> Any:
        calls: list[int] = [0]
        first = _FirstCall()
        if not offload_inputs or not _tba_pair_on_top():
            with _inputs_in_memory():
                return checkpoint(first_or_again, calls, first, *args, use_reentrant=False, **kwargs)
        leaves, spec = pytree.tree_flatten((args, kwargs))
        at = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        tensors = [leaves[i] for i in at]
        # The closure keeps the call's structure and non-tensor leaves only: a tensor held here would
        # stay in memory until backward (Note [Hook nesting of a recomputed layer]).
        for i in at:
            leaves[i] = None

        def call(calls: list[int], first: _FirstCall, *saved: torch.Tensor) -> Any:
            rebuilt = list(leaves)
            for i, tensor in zip(at, saved):
                rebuilt[i] = tensor
            call_args, call_kwargs = pytree.tree_unflatten(rebuilt, spec)
            return first_or_again(calls, first, *call_args, **call_kwargs)

        return checkpoint(call, calls, first, *tensors, use_reentrant=False)

    return run


def _tba_pair_on_top() -> bool:
    """Whether the saved-tensor pair on top is tba's (Note [Hook nesting of a recomputed layer]); as the
    offloader's own check on entry, whether or not a tracer has set the pairs aside."""
    top = torch._C._autograd._top_saved_tensors_default_hooks(True)
    return top is not None and isinstance(getattr(top[0], "__self__", None), SavedTensorHooks)


def _keep(tensor: torch.Tensor) -> Kept:
    return Kept(tensor, tensor._version)


def _inputs_in_memory() -> contextlib.AbstractContextManager:
    """A saved-tensor pair on top that keeps a ``recompute`` layer's inputs in memory, bypassing tba (Note [Hook
    nesting of a recomputed layer]), and checks their versions at unpack as autograd would without hooks: an
    input changed in place after forward raises torch's in-place error instead of being recomputed from
    (Note [In-place after saving] in ``tba/runtime/_views.py``)."""
    return torch.autograd.graph.saved_tensors_hooks(_keep, Kept.get)


def _generator_states(layer: nn.Module) -> dict[int, tuple[torch.Generator, torch.Tensor]]:
    """Each ``torch.Generator`` held by ``layer``'s modules, directly or in a dict, list or tuple attribute,
    with its state (Note [Generators of a recomputed layer])."""
    states = {}
    for module in layer.modules():
        for value in vars(module).values():
            held = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else (value,)
            for item in held:
                if isinstance(item, torch.Generator) and id(item) not in states:
                    states[id(item)] = (item, item.get_state())
    return states


_Snapshot = list[tuple[nn.Module, dict[str, tuple[torch.Tensor, torch.Tensor, int]], dict[str, Any]]]
"""Per module of a layer: each buffer as ``(tensor, copy of its bytes, version)``, and each plain attribute."""


def _snapshot(layer: nn.Module) -> _Snapshot:
    """Every buffer's bytes and every plain attribute of ``layer``'s modules (Note [Side effects of a recomputed forward])."""
    saved = []
    for module in layer.modules():
        buffers = {name: (value, value.detach().clone(), value._version)
                   for name, value in module._buffers.items() if value is not None}
        plain = {name: copy.copy(value) for name, value in vars(module).items()
                 if not name.startswith("_") and isinstance(value, _PLAIN_TYPES)}
        saved.append((module, buffers, plain))
    return saved


def _restore(current: _Snapshot, target: _Snapshot) -> None:
    """Put ``target``'s buffers and plain attributes back into the modules ``current`` (the state now) lists."""
    with torch.no_grad():
        for (module, _, now_plain), (_, buffers, plain) in zip(current, target):
            for name, (tensor, value, _) in buffers.items():
                if tensor.shape != value.shape:
                    module._buffers[name] = value.clone()
                    continue
                module._buffers[name] = tensor
                # Note [Side effects of a recomputed forward]: the copy keeps the version counter.
                with _unsafe_preserve_version_counter(tensor):
                    tensor.copy_(value)
            for name in now_plain.keys() - plain.keys():
                delattr(module, name)
            for name, value in plain.items():
                setattr(module, name, value)


class _FirstCall:
    """What the first call of a recomputed layer's forward left for its recomputation: the generators' states
    and the model state it started from (Note [Side effects of a recomputed forward]), and the versions to check
    (Note [A recomputed layer's parameters must not change before backward])."""

    __slots__ = ("generators", "before", "versions")

    def __init__(self) -> None:
        self.generators: dict[int, tuple[torch.Generator, torch.Tensor]] = {}
        self.before: _Snapshot = []
        self.versions: list[tuple[str, torch.Tensor, int]] = []

    def settle(self, layer: nn.Module) -> None:
        """After the first call: keep copies of the buffers it changed only, and record the versions to check."""
        changed = []
        for module, buffers, plain in self.before:
            kept = {}
            for name, (tensor, value, version) in buffers.items():
                if module._buffers.get(name) is tensor and tensor._version == version:
                    self.versions.append((f"buffer {name!r} of {type(module).__name__}", tensor, version))
                else:
                    kept[name] = (tensor, value, version)
            changed.append((module, kept, plain))
        self.before = changed
        self.versions += [(f"parameter {name!r}", p, p._version) for name, p in layer.named_parameters()]

    def check_unchanged(self, layer: nn.Module) -> None:
        """Raise :class:`TbaError` when a parameter (or a buffer whose value was not kept) changed in place
        since the first call (Note [A recomputed layer's parameters must not change before backward])."""
        for what, tensor, version in self.versions:
            if tensor._version != version:
                raise TbaError(
                    f"{what} of a recomputed layer ({type(layer).__name__}) was modified in place after its "
                    f"forward (version {version}, now {tensor._version}): recomputing the layer in backward would "
                    "give the gradients of another forward. Change it after backward (optimizer.step() after "
                    "loss.backward()), or keep or offload this layer instead of recomputing it")
