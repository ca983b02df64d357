"""Parts of the fuzzer's blocks that real models write and the first menu (``_fuzz_case.py``) did not draw.

Each is a field of :class:`~tba.bench._fuzz_case.Case` drawn after every older one (so older seeds keep
their cases), applied by :class:`~tba.bench._fuzz_case.Block`'s forward:

* ``functions``: per block, a custom :class:`torch.autograd.Function` (as fused kernels and quantised
  layers are written) that saves its input and output with ``ctx.save_for_backward``, and reads in
  backward a non-tensor attribute of ``ctx`` (``"attribute"``), a Python attribute of a saved tensor
  that requires no grad (``"tensor_attribute"``, as quantised layers carry ``.scale``: Note [A saved tensor's
  attributes]), or saves a ``detach()`` or ``.data`` alias of its input instead of the input (``"detached"``,
  ``"data"``).
* ``hooks``: per block, a hook the program registers on the block's linear layer: a forward hook that
  scales its output (``"scale"``), a forward pre-hook that scales its input (``"pre"``), or a forward hook
  that appends the output's sum to a list the block holds (``"append"``, compared after the steps).
* ``extra``: an argument every block is called with besides ``x`` (:class:`Stack` passes it on): a mask
  tensor of the input's shape (``"mask"``), a numpy array of one row (``"numpy"``) or a Python float
  (``"float"``), new each step (:func:`step_extra`); the block scales its activation by it.
* ``checkpoints``: per block, a piece of its forward it runs under ``torch.utils.checkpoint`` itself,
  non-reentrant (``"nonreentrant"``) or reentrant (``"reentrant"``), as models with their own activation
  checkpointing do inside a block.
* ``autocast``: bfloat16 autocast on the CPU around the model's forward (``"model"``, as a training loop
  enters it) or around each block's linear layer (``"linear"``, as a block mixes dtypes itself).

Note: [A saved tensor's attributes]
Autograd wraps what any unpack hook returns for a saved tensor that requires grad in a new tensor object,
so its Python attributes (``h.scale = 1.5``, a parameter's ``main_grad``) are gone in backward under every
saved-tensor hook: torch's own ``checkpoint`` and ``save_on_cpu`` too (an ``AttributeError``, or the
default of a ``getattr``). tba cannot give them back, and docs/api.md lists it among what it does not
catch; the fuzzer draws the attribute on a tensor that requires no grad, which autograd hands back as it
is, and which tba keeps in memory for that (Note [A tensor with attributes stays in memory] in
``tba/runtime/_keep.py``).
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from torch import nn

from tba.bench import _fuzz_ops as fuzz_ops

FUNCTIONS = ("saves", "attribute", "tensor_attribute", "detached", "data")
HOOKS = ("scale", "pre", "append")
EXTRAS = ("mask", "numpy", "float")
CHECKPOINTS = ("nonreentrant", "reentrant")
AUTOCASTS = ("model", "linear")


def draw_functions(rng: random.Random, count: int) -> tuple[str, ...]:
    """Per block, the custom Function its forward applies ("" for none; none at all in about 60% of cases)."""
    if rng.random() < 0.6:
        return ()
    return tuple(rng.choice(("", *FUNCTIONS)) for _ in range(count))


class _Silu(torch.autograd.Function):
    """``x * sigmoid(x)`` whose backward reads the saved input and output (and what ``kind`` stashes)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, kind: str, extra: torch.Tensor) -> torch.Tensor:
        y = x * torch.sigmoid(x)
        ctx.kind = kind
        if kind == "attribute":
            ctx.scale = 1.5
        saved = x.detach() if kind == "detached" else x.data if kind == "data" else x
        ctx.save_for_backward(saved, y, extra)
        return y * 1.5 if kind in ("attribute", "tensor_attribute") else y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        x, y, extra = ctx.saved_tensors
        sig = torch.sigmoid(x)
        out = grad * (sig + y * (1 - sig))
        if ctx.kind == "attribute":
            out = out * ctx.scale
        elif ctx.kind == "tensor_attribute":
            out = out * getattr(extra, "scale", 1.0)  # Note [A saved tensor's attributes]
        return out, None, None


def apply_function(kind: str, h: torch.Tensor) -> torch.Tensor:
    """``h`` through the block's custom Function of ``kind``."""
    extra = h.detach().abs()  # requires no grad; as large as ``h``, so written unless kept
    if kind == "tensor_attribute":
        extra.scale = 1.5
    return _Silu.apply(h, kind, extra)


def draw_hooks(rng: random.Random, count: int) -> tuple[str, ...]:
    """Per block, the hook the program registers on its linear layer ("" for none; none at all in about 70% of cases)."""
    if rng.random() < 0.7:
        return ()
    return tuple(rng.choice(("", *HOOKS)) for _ in range(count))


def register_hook(block: torch.nn.Module, kind: str) -> None:
    """Register the hook of ``kind`` on ``block.linear`` (its list, for ``"append"``, is ``block.hook_log``)."""
    if kind == "scale":
        block.linear.register_forward_hook(lambda module, args, out: out * 1.25)
    elif kind == "pre":
        block.linear.register_forward_pre_hook(lambda module, args: (args[0] * 0.75,))
    elif kind == "append":
        log = block.hook_log

        def append(module: torch.nn.Module, args: Any, out: torch.Tensor) -> None:
            log.append(float(out.detach().float().sum()))

        block.linear.register_forward_hook(append)


def draw_extra(rng: random.Random) -> str:
    """The argument blocks take besides ``x`` ("" for none, in about 60% of cases)."""
    return "" if rng.random() < 0.6 else rng.choice(EXTRAS)


def step_extra(kind: str, seed: int, step: int, batch: int, width: int) -> Any:
    """The extra argument of ``step`` (identical with and without tba); None when ``kind`` is ""."""
    rng = np.random.default_rng(seed * 977 + step)
    if kind == "mask":
        return torch.from_numpy(rng.random((batch, width)) < 0.8)
    if kind == "numpy":
        return (1.0 + rng.random(width)).astype(np.float32)
    if kind == "float":
        return float(1.0 + rng.random())
    return None


def apply_extra(h: torch.Tensor, extra: Any) -> torch.Tensor:
    """``h`` scaled by the block's extra argument."""
    if isinstance(extra, torch.Tensor):
        return h * extra.to(h.dtype)
    if isinstance(extra, np.ndarray):
        return h * torch.from_numpy(extra).to(h.dtype)
    return h * extra


class Stack(nn.Sequential):
    """The fuzzer's model: its blocks in turn, each given the step's extra argument when there is one (and called
    through ``functional_call`` when drawn: ``_fuzz_ops.py``)."""

    def forward(self, x: torch.Tensor, extra: Any = None) -> torch.Tensor:
        for block in self:
            x = fuzz_ops.call(block, x, extra)
        return x


def draw_checkpoints(rng: random.Random, count: int) -> tuple[str, ...]:
    """Per block, the checkpoint its forward runs a piece under ("" for none; none at all in about 70% of cases)."""
    if rng.random() < 0.7:
        return ()
    return tuple(rng.choice(("", *CHECKPOINTS)) for _ in range(count))


def _piece(h: torch.Tensor) -> torch.Tensor:
    return torch.tanh(h) * h + h.pow(2) * 0.125


def apply_checkpoint(kind: str, h: torch.Tensor) -> torch.Tensor:
    """``h`` through a piece of forward run under the block's own checkpoint of ``kind``."""
    from torch.utils.checkpoint import checkpoint

    # A reentrant checkpoint of an input that requires no grad warns and gives the same as a non-reentrant one.
    return checkpoint(_piece, h, use_reentrant=kind == "reentrant" and h.requires_grad)


def draw_autocast(rng: random.Random) -> str:
    """Where bfloat16 autocast is entered ("" for nowhere, in about 70% of cases)."""
    return "" if rng.random() < 0.7 else rng.choice(AUTOCASTS)


def autocast(on: bool) -> Any:
    """A CPU bfloat16 autocast context when ``on``, else one that does nothing."""
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=on)
