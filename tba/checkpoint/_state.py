"""Model and optimizer state in a form that saves and loads back exactly: :func:`state_dict`, :func:`load`.

Note: [Why a fresh optimizer loaded nothing]
DCP loads *into* the state dict it is given and ignores what the checkpoint holds beyond it. A
fresh optimizer's ``state_dict()`` has no per-parameter state yet (Adam creates ``exp_avg`` on its
first step), so ``dcp.load({"optim": fresh_optimizer}, ...)`` restored 0 of its entries, silently.
``torch.distributed.checkpoint.state_dict.get_state_dict`` initialises the optimizer's state and
keys it by parameter name; :func:`state_dict` saves in that form, and :func:`load` builds the same
form for the model and optimizer it is given, checks the checkpoint's keys against it both ways
(a missing or an unexpected key is a :class:`TbaCheckpointError`), loads, and applies the result
with ``set_state_dict``.

Note: [A parameter that never had a gradient has no optimizer state]
``get_state_dict`` initialises a fresh optimizer's state by a step with zero gradients for every
parameter that requires grad, but the trained optimizer has no state for a parameter that never got
a gradient (an unused branch, a head not trained yet): its checkpoint has no key for it, and the
strict key check refused every such checkpoint, naming a fix (save with ``state_dict``) the user had
already applied (helper-55). :class:`_StrictPlanner` drops from the target the state of each
parameter of which the checkpoint holds no key at all, and :func:`load` removes it before
``set_state_dict`` (then told ``strict=False``: torch checks for the same state, and every key was
checked here), so the loaded optimizer has no state for it either, as the saved one had.
A parameter with some of its state keys in the checkpoint and not others still fails.

Note: [Saving before the first step changed the optimizer]
That initialisation is a real ``optimizer.step()`` (lr set to 0): on the optimizer being saved, a
checkpoint taken before the first step (``step % N == 0`` at step 0) left Adam one step further on
(bias correction, so every later update differed from training without the checkpoint), created
SGD's momentum buffers (the next step then dampens the first gradient), bumped the parameters'
versions and ran the step hooks (helper-55). :func:`state_dict` therefore never lets it run:
when the initialisation would happen (no state, no gradient), a zero gradient is set on the
smallest parameter for the call (``_init_optim_state`` returns on any gradient) and taken away
after, and the checkpoint holds no per-parameter state, as the optimizer has none; :func:`load`
(Note [A parameter that never had a gradient has no optimizer state]) restores it as such. Only the
optimizer being loaded into is initialised, and its state is then replaced.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.optim import Optimizer

from tba.checkpoint._io import TbaCheckpointError, interrupt_in
from tba.checkpoint._reader import CheckpointReplaced, TbaStorageReader
from tba.errors import TbaConfigError

MODEL_KEY = "model"
OPTIMIZER_KEY = "optim"
LOAD_TRIES = 3
"""Loads attempted while saves of other processes replace the checkpoint between a load's reads."""


def state_dict(model: nn.Module, optimizer: Optimizer | None = None, **extra: Any) -> dict[str, Any]:
    """What to save for ``model`` (and ``optimizer``): ``{"model": ..., "optim": ..., **extra}``.

    The optimizer's state is keyed by parameter name (Note [Why a fresh optimizer loaded nothing]),
    so :func:`load` restores it into a fresh optimizer. Pass it to ``LazyCheckpointer.save``,
    ``save_lazy`` or ``dcp.save``.
    """
    _check_targets("state_dict(model, optimizer)", model, optimizer)
    _check_extras("state_dict", extra)
    with _no_state_initialisation(optimizer):
        model_state, optimizer_state = get_state_dict(model, optimizer if optimizer is not None else [])
    return _assemble(model_state, optimizer, optimizer_state, extra)


def _check_targets(call: str, model: Any, optimizer: Any) -> None:
    """A TbaConfigError for arguments torch's get_state_dict fails on deep inside (swapped, None, another model's)."""
    if not isinstance(model, nn.Module):
        raise TbaConfigError(f"the model must be an nn.Module, got {type(model).__name__}; call {call}, in this order")
    if optimizer is None:
        return
    if not isinstance(getattr(optimizer, "param_groups", None), list):
        raise TbaConfigError(f"the optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}; "
                             f"call {call}, in this order")
    owned = {id(p) for p in model.parameters()}
    if any(id(p) not in owned for group in optimizer.param_groups for p in group["params"]):
        raise TbaConfigError("the optimizer holds parameters that are not the model's; pass the optimizer built "
                             "from this model's parameters")


def _check_extras(call: str, extra: dict[str, Any]) -> None:
    """Refuse an extra entry that ``load`` cannot fill in place, at the save already.

    Note: [An extra value load cannot fill in place]
    ``load`` returns nothing: an extra entry comes back by being filled in place. A tensor is, and so
    is every value inside a dict, but ``load(path, model, optimizer, step=0)`` read the saved step into
    load's own dict and threw it away, so the caller resumed from step 0, silently (helper-99); so did a
    list (``step=[0]`` stayed ``[0]``; of ``[tensor, 5]`` only the tensor came back). Both refuse
    them: :func:`state_dict` too, so that no checkpoint is made that :func:`load` would refuse at resume.
    """
    if OPTIMIZER_KEY in extra:  # the optimizer's state took its place, saved and loaded nowhere, silently (helper-153)
        raise TbaConfigError(f"{call}(..., {OPTIMIZER_KEY}=...): that name holds the optimizer's state in the "
                             "checkpoint; give the extra entry another name, in both state_dict and load")
    for key, value in extra.items():
        if not isinstance(value, (torch.Tensor, dict)):
            raise TbaConfigError(f"{call}(..., {key}={value!r} ({type(value).__name__})): load fills extra entries "
                                 f"in place and cannot change a {type(value).__name__}; pass it inside a dict, "
                                 f"meta={{'{key}': ...}}, to both state_dict and load, and read the loaded "
                                 "values from that dict after load")


@contextlib.contextmanager
def _no_state_initialisation(optimizer: Optimizer | None) -> Iterator[None]:
    """``get_state_dict`` without its optimizer step (Note [Saving before the first step changed the optimizer])."""
    params = [p for group in optimizer.param_groups for p in group["params"]] if optimizer is not None else []
    if optimizer is None or optimizer.state or not params or any(p.grad is not None for p in params):
        yield
        return
    smallest = min(params, key=lambda p: p.numel())
    smallest.grad = torch.zeros_like(smallest)
    try:
        yield
    finally:
        smallest.grad = None


def _assemble(model_state: dict[str, Any], optimizer: Optimizer | None, optimizer_state: Any,
              extra: dict[str, Any]) -> dict[str, Any]:
    state = {MODEL_KEY: model_state, **extra}
    if optimizer is not None:
        state[OPTIMIZER_KEY] = optimizer_state
    return state


class _StrictPlanner(DefaultLoadPlanner):
    """DCP's load planner that also refuses keys the checkpoint has and the target lacks."""

    def __init__(self, optimizer_state: dict[str, Any] | None = None) -> None:
        super().__init__(allow_partial_load=False)
        self._optimizer_state = optimizer_state
        self.stateless: list[str] = []
        """Parameters the checkpoint holds no optimizer state for (Note [A parameter that never had a gradient has no
        optimizer state])."""

    def _drop_stateless(self, saved: set[str]) -> None:
        per_param = (self._optimizer_state or {}).get("state", {})
        for fqn, entries in per_param.items():
            prefix = f"{OPTIMIZER_KEY}.state.{fqn}."
            if not isinstance(entries, dict) or any(prefix + name in saved for name in entries):
                continue
            if any(key.startswith(prefix) for key in saved):
                continue
            for key in [key for key in self.state_dict if key.startswith(prefix)]:
                del self.state_dict[key]
            self.stateless.append(fqn)

    def set_up_planner(self, state_dict: Any, metadata: Any = None, is_coordinator: bool = False) -> None:
        super().set_up_planner(state_dict, metadata, is_coordinator)
        self._drop_stateless(set(metadata.state_dict_metadata))
        unexpected = sorted(set(metadata.state_dict_metadata) - set(self.state_dict))
        if unexpected and self._optimizer_state is None and all(k.startswith(f"{OPTIMIZER_KEY}.") for k in unexpected):
            raise TbaCheckpointError(
                "the checkpoint holds optimizer state and no optimizer was given; pass it, load(path, model, "
                "optimizer), a fresh one too (load checks every key both ways, so a model alone is refused)")
        if unexpected and (names := _param_group_names(unexpected)):
            raise TbaCheckpointError(f"the checkpoint's optimizer param_groups hold {names}, which this "
                                     f"optimizer's lack{_GROUPS_FIX}")
        if unexpected:
            shown = ", ".join(unexpected[:5]) + (f" and {len(unexpected) - 5} more" if len(unexpected) > 5 else "")
            raise TbaCheckpointError(
                f"the checkpoint holds keys this model and optimizer do not: {shown}; load it into the model it "
                "was saved from, or save with tba.checkpoint.state_dict(model, optimizer)")
        _check_kinds(self.state_dict, metadata.state_dict_metadata)


def _check_kinds(targets: dict[str, Any], saved: dict[str, Any]) -> None:
    """Refuse a tensor target of another dtype than the saved tensor's, or where the checkpoint holds no tensor.

    Note: [A tensor of another dtype was cast on load]
    The reader copies each saved tensor into its target with ``copy_``, which casts, as DCP's own
    ``FileSystemReader`` does: an fp32 checkpoint loaded into a bf16 model was rounded, an int64 entry
    into an int32 tensor wrapped (2**40 became 0), and a saved int left a tensor target as it was
    (DCP replaced load's entry, not the caller's tensor), each with no word (helper-99). :func:`load`
    promises the state exactly, so it compares each target with the checkpoint's metadata first.
    """
    for key, target in targets.items():
        if not isinstance(target, torch.Tensor) or key not in saved:
            continue
        dtype = getattr(getattr(saved[key], "properties", None), "dtype", None)
        if dtype is None:
            raise TbaCheckpointError(f"{key}: the checkpoint holds a value that is not a tensor, and the target is a "
                                     "tensor; pass a dict holding that entry instead, or save it as a tensor")
        if dtype != target.dtype:
            raise TbaCheckpointError(f"{key}: the checkpoint holds {dtype}, the target is {target.dtype}, and load "
                                     "restores exactly, never by casting; build the model (or entry) in the saved "
                                     f"dtype, load, then convert it (model.to({target.dtype}))")


def _param_group_names(keys: list[str]) -> str | None:
    """"initial_lr" when every key is a param group's initial_lr, which an LR scheduler adds (DCP names only the
    first missing key: a checkpoint without optimizer state misses param_groups.0.lr first)."""
    scheduler = [re.fullmatch(rf"{OPTIMIZER_KEY}\.param_groups\.\d+\.initial_lr", key) for key in keys]
    return "initial_lr" if scheduler and all(scheduler) else None


_GROUPS_FIX = ("; build the optimizer as it was at the save, with an LR scheduler (which adds initial_lr to its "
               "param_groups) created before load if and only if one was created before the save")


def _last_line(text: str) -> str:
    """The message of the innermost error of DCP's report (its last line), at most 300 characters."""
    return text.strip().splitlines()[-1][:300] if text.strip() else "no message"


# Note: [A shape mismatch escaped except Exception]
# DCP reports a tensor whose size differs from the saved one, and any other failure of one of its
# ranks, as a CheckpointException, which derives from BaseException: `except Exception` in the
# caller did not catch it (helper-41). load raises TbaCheckpointError for all of them, naming the fix
# where it is known.


def load(path: str | os.PathLike, model: nn.Module, optimizer: Optimizer | None = None, *,
         backend: str = "auto", **extra: Any) -> None:
    """Restore ``model`` (and ``optimizer``) exactly from a checkpoint saved with :func:`state_dict`.

    Args:
        path: The checkpoint directory.
        model / optimizer: Where the state goes; a fresh optimizer works (its state is created first).
        backend: Engine backend for the reads.
        **extra: Further entries saved beside them, each loaded in place (tensors, or dicts of tensors).

    Raises:
        TbaCheckpointError: the checkpoint lacks a key the model or optimizer has, or has one they lack
            (a checkpoint of another model, or one saved without :func:`state_dict`).
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TbaConfigError(f"path must be the checkpoint's directory (a str or os.PathLike), got {path!r}")
    _check_targets("load(path, model, optimizer)", model, optimizer)
    _check_extras("load", extra)
    if meta := next((name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta), None):
        raise TbaConfigError(f"the model's {meta} is on the meta device, with no storage to load into (DCP then asked "
                             "for a process group); call model.to_empty(device='cpu') first, then load")
    # the target is initialised (a fresh optimizer has state to load into); its state is replaced below
    model_state, optimizer_state = get_state_dict(model, optimizer if optimizer is not None else [])
    state = _assemble(model_state, optimizer, optimizer_state, extra)
    try:
        for attempt in range(LOAD_TRIES):  # Note [A load racing another process's save]
            planner = _StrictPlanner(state.get(OPTIMIZER_KEY))
            try:
                dcp.load(state, storage_reader=TbaStorageReader(path, backend=backend), planner=planner,
                         no_dist=True)
                break
            except CheckpointException as err:
                replaced = any(isinstance(f[0], CheckpointReplaced) for f in err.failures.values())
                if not replaced or attempt == LOAD_TRIES - 1:
                    raise
    except TbaCheckpointError:
        raise
    except (Exception, CheckpointException) as err:  # noqa: BLE001 - DCP wraps errors in its own BaseException
        interrupt = interrupt_in(err)  # Note [A Ctrl-C inside DCP stays a Ctrl-C] in tba/checkpoint/_io.py
        if interrupt is not None:
            raise interrupt from None
        failures = err.failures.values() if isinstance(err, CheckpointException) else ()
        tba_error = next((f[0] for f in failures if isinstance(f[0], TbaCheckpointError)), None)
        if tba_error is not None:
            raise tba_error from None
        text = str(err)
        ours = next((line for line in text.splitlines() if "TbaCheckpointError: " in line), None)
        if ours is not None:
            raise TbaCheckpointError(ours.split("TbaCheckpointError: ", 1)[1]) from None
        if f"no checkpoint at {os.fspath(path)}" in text:  # not "lacks keys": there is nothing at path
            raise TbaCheckpointError(f"no checkpoint at {os.fspath(path)} (no .metadata there); pass the directory "
                                     "a save completed to") from None
        missing = re.findall(r"Missing key in checkpoint state_dict: ([\w.]*\w)", text)
        if missing and (names := _param_group_names(missing)):
            raise TbaCheckpointError(f"this optimizer's param_groups hold {names}, which those in the checkpoint "
                                     f"at {os.fspath(path)} lack{_GROUPS_FIX}") from None
        if "Missing key" in text or "missing" in text.lower():
            raise TbaCheckpointError(f"the checkpoint at {os.fspath(path)} lacks keys of this model or optimizer "
                                     f"({text.strip().splitlines()[-1][:300]}); save with "
                                     "tba.checkpoint.state_dict(model, optimizer)") from None
        if "Size mismatch" in text:  # Note [A shape mismatch escaped except Exception]
            raise TbaCheckpointError(f"the checkpoint at {os.fspath(path)} does not fit this model or optimizer: "
                                     f"{_last_line(text)}; load it into a model built as the saved one was "
                                     "(same sizes)") from None
        if isinstance(err, CheckpointException):
            raise TbaCheckpointError(f"loading the checkpoint at {os.fspath(path)} failed: {_last_line(text)}") from err
        raise
    for fqn in planner.stateless:  # Note [A parameter that never had a gradient has no optimizer state]
        del state[OPTIMIZER_KEY]["state"][fqn]
    set_state_dict(model, optimizer if optimizer is not None else [], model_state_dict=state[MODEL_KEY],
                   optim_state_dict=state.get(OPTIMIZER_KEY, {}),
                   # every key was checked both ways above; torch's own check refuses a parameter without state
                   options=StateDictOptions(strict=False) if planner.stateless else None)
