"""Operations real models run that the fuzzer's first menu (``_fuzz_case.py``) did not: what each saves for backward.

A case may draw, per block, one op of :data:`OPS` (field ``ops`` of :class:`~tba.bench._fuzz_case.Case`, drawn
after every older field), applied by the block's forward to its activation ``h`` of shape ``(batch, width)``
and giving one of the same shape. Each saves something the linear-and-pointwise menu never did:

* ``"conv_pool"``: a ``Conv1d`` over the row, then ``max_pool1d``, which saves its int64 indices;
* ``"conv2d"``: a ``Conv2d`` over the row seen as a channels_last image (strides no row-major tensor has);
* ``"embedding"``: an ``nn.Embedding`` looked up by indices computed from ``h`` (an int64 storage of
  the activation's own, saved by the lookup, and the indices differ if a recomputation differs);
* ``"attention"``: causal ``scaled_dot_product_attention`` over the row as four tokens (q, k and v views
  of one storage; the fused CPU kernel saves its output and log-sum-exp);
* ``"gru"``: an ``nn.GRUCell`` (the fused cell saves its gates' workspace);
* ``"complex"``: a rotation in the complex plane, as rotary embeddings write it (``view_as_complex`` of
  ``h``'s storage, a complex product, ``view_as_real``);
* ``"strided"``: overlapping ``as_strided`` windows of ``h`` and a stride-0 ``expand`` of its mean, both saved;
* ``"split"``: ``chunk``, ``select`` and ``narrow`` views of ``h``, several saved, all one storage;
* ``"inplace_view"``: ``sigmoid_`` on a slice of a tensor that is saved afterwards (autograd allows it: the
  saved tensor is saved at its new version, and the slice's output is saved too, a view of it).

``calls`` (also drawn last) is, per block, how :class:`~tba.bench._fuzz_parts.Stack` calls it: directly, or
through ``torch.func.functional_call`` with fast weights (each parameter scaled by 0.5: Note [A recomputation
runs with the parameters its first call ran with] in ``tba/runtime/_first_call.py``).

Each keeps the activation's scale (``tanh`` where it multiplies ``h`` by itself): a product of ``h`` with
itself in every block made many cases diverge to NaN within a few steps (Note [A case that diverges] in
``tba/bench/fuzz.py``), where a difference is no longer seen.

Note: [No cat]
The ops join pieces with ``F.pad`` and a sum, not ``torch.cat``: under CPU bfloat16 autocast (drawn by
``_fuzz_parts.py``) ``torch.cat`` of float16 tensors raises in torch itself ('Unexpected floating ScalarType
in at::autocast::prioritize'), with or without tba.
"""

from __future__ import annotations

import random
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

OPS = ("conv_pool", "conv2d", "embedding", "attention", "gru", "complex", "strided", "split", "inplace_view")
EMBEDDINGS = 7
"""Rows of a block's embedding table."""


def draw_ops(rng: random.Random, count: int) -> tuple[str, ...]:
    """Per block, the op its forward applies ("" for none; none at all in about half of the cases)."""
    if rng.random() < 0.5:
        return ()
    return tuple(rng.choice(("", *OPS)) for _ in range(count))


def draw_calls(rng: random.Random, count: int) -> tuple[str, ...]:
    """Per block, "functional" when the stack calls it through ``functional_call`` ("" directly; all directly in
    about 80% of the cases)."""
    if rng.random() < 0.8:
        return ()
    return tuple(rng.choice(("", "functional")) for _ in range(count))


def attach(block: nn.Module, op: str, width: int) -> None:
    """Give ``block`` the modules its ``op`` calls (after every block is built, so that older cases' weights stay)."""
    block.op = op
    if op == "conv_pool":
        block.conv = nn.Conv1d(1, 2, 3, padding=1)
    elif op == "conv2d":
        block.conv = nn.Conv2d(2, 2, 3, padding=1)
    elif op == "embedding":
        block.embedding = nn.Embedding(EMBEDDINGS, width)
    elif op == "gru":
        block.gru = nn.GRUCell(width, width)


def apply_op(block: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """``h`` through the block's op (``h`` itself when it has none), in ``h``'s dtype (autocast may give another)."""
    return _applied(block, getattr(block, "op", ""), h).to(h.dtype)


def _applied(block: nn.Module, op: str, h: torch.Tensor) -> torch.Tensor:
    batch, width = h.shape
    if op == "conv_pool":
        return F.max_pool1d(block.conv(h.unsqueeze(1)).reshape(batch, 1, 2 * width), 2).reshape(batch, width)
    if op == "conv2d":
        image = h.reshape(batch, 2, 2, width // 4).contiguous(memory_format=torch.channels_last)
        return block.conv(image).reshape(batch, width)
    if op == "embedding":
        index = (h.detach().float().sum(1).abs() * 3).long() % EMBEDDINGS
        return h + block.embedding(index)
    if op == "attention":
        tokens = h.reshape(batch, 4, width // 4).transpose(0, 1)
        out = F.scaled_dot_product_attention(tokens, tokens * 0.5, tokens.flip(-1), is_causal=True)
        return out.transpose(0, 1).reshape(batch, width)
    if op == "gru":
        return block.gru(h, torch.tanh(h))
    if op == "complex":
        return _rotate(h)
    if op == "strided":
        flat = h.contiguous()
        windows = flat.as_strided((batch, width - 1, 2), (width, 1, 1))  # overlapping
        mixed = (windows * torch.tensor([0.75, 0.25], dtype=h.dtype)).sum(-1)
        return F.pad(mixed, (0, 1)) + torch.tanh(h.mean(1, keepdim=True)).expand(batch, width) * h
    if op == "split":
        a, b = h.chunk(2, 1)
        second = b * torch.tanh(h.select(1, 0)).unsqueeze(1) + h.narrow(1, 1, width // 2)
        return F.pad(a * b.sigmoid(), (0, width // 2)) + F.pad(second, (width // 2, 0))  # torch.cat: Note [No cat]
    if op == "inplace_view":
        base = h * 1.5
        base[:, : width // 2].sigmoid_()
        return base * torch.tanh(h)
    return h


def _rotate(h: torch.Tensor) -> torch.Tensor:
    real = (h if h.dtype in (torch.float32, torch.float64) else h.float()).contiguous()
    pairs = torch.view_as_complex(real.reshape(h.shape[0], h.shape[1] // 2, 2))
    angles = torch.arange(h.shape[1] // 2, dtype=real.dtype) * 0.25
    rotated = pairs * torch.polar(torch.ones_like(angles), angles)
    return torch.view_as_real(rotated).reshape(h.shape).to(h.dtype)


def call(block: nn.Module, x: torch.Tensor, extra: Any) -> torch.Tensor:
    """``block`` called on ``x`` (and ``extra``), through ``functional_call`` with fast weights when drawn."""
    args = (x,) if extra is None else (x, extra)
    if getattr(block, "call", "") != "functional":
        return block(*args)
    fast = {name: parameter * 0.5 for name, parameter in block.named_parameters()}
    return torch.func.functional_call(block, fast, args)
