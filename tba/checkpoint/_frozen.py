"""What a lazy save takes in the caller's thread: the state's structure, and each tensor's version.

Note: [A tensor changed before the lazy copy read it]
A lazy save returns before its tensors are copied; the docs bracket it with
``LazyCheckpointer.guard(optimizer)`` (the next ``optimizer.step()`` waits for the copy) or
``wait_snapshot()``. A save followed at once by an unguarded ``optimizer.step()`` wrote the
post-step weights under the pre-step checkpoint's name, silently (helper-41). Every in-place
change to a tensor (an optimizer step, BatchNorm's running statistics in forward, ``p.add_()``
under ``no_grad``) bumps its version counter, which views and ``detach()`` share. :func:`freeze`
records each tensor's ``_version`` at the save call; once the last tensor has been copied, and
before the snapshot is announced, :func:`check_unchanged` compares them: a tensor changed since
the save call fails the save with a :class:`TbaCheckpointError` naming the fix, and the earlier
checkpoint at the path stays. The check reads one integer per tensor. It cannot see a change made
through ``.data`` (which has its own version counter) or an array from ``t.numpy()``, to an inference tensor (which has none), by
another process, or by a kernel that does not bump it (memory torch does not own, shared memory and
inference tensors are copied at the save instead: Note [Memory torch does not own is copied at the
save]): ``batch_norm`` updates ``running_mean`` and ``running_var`` so, but the ``num_batches_tracked``
saved beside them is bumped by the same forward. A change still running in another thread when the
check runs can escape it; ``guard`` leaves no such window.

Note: [A fused optimizer step bumps no version]
``torch.optim.SGD(fused=True)`` and ``Adam(fused=True)`` update parameters and their states in one
kernel that bumps no version counter (Adam's ``step`` tensor only), so an unguarded fused step
right after a save published the post-step weights under the save's name, silently (helper-55).
A :class:`StepWatch` per lazy save, registered from the save call until the check, sees every
``optimizer.step()`` in the process through torch's global step pre-hook: a step of an optimizer
holding one of the save's storages (a parameter with a gradient, or its state), unless that
optimizer is guarded by the saving checkpointer (its own pre-hook waits for the copy, after the
global one ran), fails the save at the check as a changed version does.
"""

from __future__ import annotations

import copy
import io
import pickle
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from tba.checkpoint._io import TbaCheckpointError, TbaConfigError, flatten_state_dict

Watched = list[tuple[str, torch.Tensor, int]]
"""(key, tensor, version at the save call) of every tensor a lazy save holds by reference."""


REFUSALS_TO_PICKLE = (pickle.PicklingError, copy.Error, TypeError, AttributeError, ValueError, NotImplementedError,
                      RuntimeError)
"""What ``deepcopy`` and the pickler raise for a value they cannot copy or pickle.

Note: [Only a refusal to pickle is the state dict's fault]
The check of a non-tensor value turned every ``Exception`` raised while it copied and pickled the value into a
:class:`TbaConfigError` blaming the state dict: a user's signal handler's exception landing there (a time limit's
``TimeoutError``, the ``Exception`` subclass the randomised signal test raises), or a ``MemoryError``, came out of
``save`` as "cannot be saved by DCP: ; keep only tensors and picklable values" (the empty reason being the
exception's own text), and the caller's ``except`` for its own exception never saw it. Only the errors that mean
"this value cannot be copied or pickled" (a lambda, a lock, a generator, a local class) are the state dict's fault;
any other goes on as itself, and the save has not started.
"""


def _freeze(value: Any, key: str, watched: Watched) -> Any:
    if isinstance(value, torch.Tensor):
        if isinstance(value, torch.nn.parameter.UninitializedTensorMixin):  # torch's ValueError came from tba's code
            raise TbaConfigError(f"state_dict[{key}] is an uninitialised parameter or buffer of a lazy module "
                                 "(nn.LazyLinear, ...), which holds no data yet; run one forward pass first, or drop it")
        if value.is_meta:  # no data to save; .to_dense() (the other fix) keeps it on meta
            raise TbaConfigError(f"state_dict[{key}] is a tensor on the meta device, which holds no data; "
                                 "materialise it first (module.to_empty(device=...) then initialise or load "
                                 "its values) or drop it")
        if value.is_quantized:  # torch.save cannot build its archive around the data (skip_data refuses it)
            raise TbaConfigError(f"state_dict[{key}] is a quantized tensor, which tba's checkpoints cannot store; "
                                 "save its .dequantize() (with its scale and zero point) or drop it")
        if value.layout != torch.strided or value.is_nested:
            raise TbaConfigError(f"state_dict[{key}] is a {value.layout} tensor on {value.device}; "
                                 "only dense tensors can be saved: convert it with .to_dense() or drop it")
        storage = value.untyped_storage()
        if not storage.resizable() or (value.device.type == "cpu" and storage.is_shared()) or value.is_inference():
            # Note: [Memory torch does not own is copied at the save]
            # A tensor over a numpy array (torch.from_numpy) or DLPack memory can change through its owner, which
            # bumps no version: arr[:] = 1 after a lazy save published the new values under the save's name,
            # silently (helper-68). Torch marks such storages not resizable; they are copied at the save call. So
            # are those mapped from a file (torch.load(mmap=True) assigned to a model): a copy they need not have.
            # A CPU tensor in shared memory (share_memory_(), a model shared with Hogwild workers) is resizable,
            # but another process's write to it bumps no version here (helper-91): it is copied too, and so is an
            # inference tensor, which has no version counter for a change under inference_mode to bump.
            return value.clone()
        # Note: [A saved tensor's storage is pinned at the save]
        # The save kept the caller's tensor object, and read it in the save thread. A Parameter given itself
        # (state_dict(keep_vars=True), {"w": model.weight}) whose .data was assigned after the call (nn.Module.to(),
        # .half(), p.data = x) changed storage, dtype and shape under the save, bumping no version, and the new data
        # was published under the save's name, silently (helper-142). The save keeps a detach()ed alias instead: it
        # holds the storage of the save call and shares the version counter, so an in-place change still fails the save.
        alias = value.detach()
        watched.append((key, alias, alias._version))
        return alias
    if isinstance(value, dict):
        return {k: _freeze(v, f"{key}.{k}" if key else str(k), watched) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
        items = [_freeze(v, f"{key}.{i}", watched) for i, v in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    try:
        copied = copy.deepcopy(value)
        torch.save(copied, io.BytesIO())
    except REFUSALS_TO_PICKLE as err:  # Note [Only a refusal to pickle is the state dict's fault]
        raise TbaConfigError(f"state_dict[{key}] ({type(value).__name__}) cannot be saved by DCP: "
                             f"{err or type(err).__name__}; keep only tensors and picklable values in the state dict"
                             ) from err
    return copied


def freeze(state_dict: dict[str, Any]) -> tuple[dict[str, Any], Watched]:
    """Containers rebuilt, tensors kept by reference (their versions recorded), other values deep-copied and checked."""
    watched: Watched = []
    frozen = _freeze(state_dict, "", watched)
    try:
        # Note: [Two keys that DCP names alike]
        # DCP names each item by joining its nested keys with '.', so {"a.b": x, "a": {"b": y}} names two items
        # "a.b"; a lazy save accepted it and failed only at wait(), with DCP's traceback (helper-91). DCP's own
        # flattening, run here, refuses it at the save call.
        flatten_state_dict(frozen)
    except ValueError as err:
        raise TbaConfigError(f"state_dict has two keys that DCP names alike ({err}): DCP joins nested keys with '.'; "
                             "rename one of them") from None
    return frozen, watched


def _storage_ptr(tensor: torch.Tensor) -> int:
    try:
        storage = tensor.untyped_storage()
        return storage.data_ptr() if storage.nbytes() else 0
    except (RuntimeError, NotImplementedError):  # no storage of its own (a functional or wrapped tensor)
        return 0


class StepWatch:
    """Optimizer steps on a lazy save's tensors before its copy was checked (Note [A fused optimizer step bumps no version])."""

    def __init__(self, watched: Watched, guarded: Callable[[torch.optim.Optimizer], bool]) -> None:
        self.storages = {_storage_ptr(tensor) for _, tensor, _ in watched} - {0}
        self.guarded = guarded
        self.stepped: list[str] = []

    def note_step(self, optimizer: torch.optim.Optimizer) -> None:
        if not self.storages or self.guarded(optimizer):
            return
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue  # a step leaves a parameter without a gradient and its state as they are
                state = optimizer.state.get(param, {})
                tensors = [param, *(v for v in state.values() if isinstance(v, torch.Tensor))]
                if any(_storage_ptr(t) in self.storages for t in tensors):
                    self.stepped.append(f"{type(optimizer).__name__}.step()")
                    return


_watches: list[StepWatch] = []
_watches_lock = threading.Lock()
_hook_registered = False


def _note_step(optimizer: torch.optim.Optimizer, *_: object) -> None:
    if _watches:
        with _watches_lock:
            watches = list(_watches)
        for watch in watches:
            watch.note_step(optimizer)


def start_watch(watch: StepWatch) -> None:
    """See every optimizer step from now until :func:`stop_watch` (Note [A fused optimizer step bumps no version])."""
    global _hook_registered
    with _watches_lock:
        if not _hook_registered:
            register_optimizer_step_pre_hook(_note_step)
            _hook_registered = True
        _watches.append(watch)


def forget_watches_in_child() -> None:
    """After fork: the parent's saves are the parent's to check."""
    global _watches_lock
    _watches_lock = threading.Lock()
    _watches.clear()


def stop_watch(watch: StepWatch) -> None:
    with _watches_lock:
        if watch in _watches:
            _watches.remove(watch)


def check_unchanged(watched: Watched, path: str, watch: StepWatch | None = None) -> None:
    """Raise if a tensor changed since the save call (Note [A tensor changed before the lazy copy read it])."""
    if watch is not None:
        stop_watch(watch)
    changed = [key for key, tensor, version in watched if tensor._version != version]
    if not changed and watch is not None and watch.stepped:
        changed = [f"tensors stepped by {watch.stepped[0]} (a fused step bumps no version counter)"]
    if changed:
        shown = ", ".join(changed[:3]) + (f" and {len(changed) - 3} more" if len(changed) > 3 else "")
        raise TbaCheckpointError(
            f"checkpoint {path}: {shown} changed after save() returned and before the lazy copy had read it, "
            "so the checkpoint would not hold the state of the save call; call checkpointer.guard(optimizer) "
            "once (optimizer.step() then waits for the copy), or handle.wait_snapshot() before changing saved "
            "tensors (forward changes BatchNorm running statistics); the earlier checkpoint at the path is unchanged")
