"""Python-side state the fuzzer's blocks change in forward and read back (``tba/bench/_fuzz_case.py``).

A recomputed layer runs its forward again in backward; a forward that changes state it also reads
must recompute from the state its first call started from, and leave the state as one forward would
(Note [Side effects of a recomputed forward] in ``tba/runtime/_layer_state.py``, Notes [State a
recomputed layer changes that tba does not put back] and [Nested state a recomputation is given
back] in ``tba/runtime/_private_state.py``). Each part of :data:`STATES` is one way a model does so
(numpy arrays in a dict, a tensor and a list in a tuple, dicts and a list three levels down in a
config object, a ``__slots__`` object too); every one scales the block's activation
by what it read, so a recomputation from other state changes the gradients. The parts of
:data:`REFUSED` are ones tba cannot put back: it must raise a :class:`~tba.errors.TbaError` naming
the attribute when it recomputes them, never differ silently.
:func:`state_of` is what the fuzzer compares after the steps, with and without tba.
"""

from __future__ import annotations

import collections
import functools
import random
import types
from typing import Any

import numpy as np
import torch
from torch import nn

STATES = ("nested_counter", "nested_list", "public_list", "deque", "shared_object", "first_call_config",
          "cached_property", "first_call_attribute", "nested_tensor", "private_counter", "array_in_dict", "tuple_held",
          "private_array", "deep_config", "slots_object")
REFUSED = {"nested_tensor": "ema_holder", "private_counter": "_private_calls", "private_array": "_private_hits"}
"""Parts whose state tba does not put back for a recomputation, and the name its error must give."""


class Shared:
    """A plain object every block of a model holds (as Hugging Face blocks hold their config): a counter the
    blocks advance, a field set on the first call, and a cached property read for the first time in a forward."""

    def __init__(self) -> None:
        self.index = 0
        self.problem_type: str | None = None

    @functools.cached_property
    def scale(self) -> float:
        return 1.0 + 0.25 * (self.index % 4)


class Tracker:
    """A plain object holding a tensor the forward updates in place (nested too deep for tba to copy)."""

    def __init__(self, width: int) -> None:
        self.ema = torch.zeros(width)


class Slots:
    """A plain object with ``__slots__`` (no ``vars()``) the forward advances."""

    __slots__ = ("n",)

    def __init__(self) -> None:
        self.n = 0


def draw_states(rng: random.Random, count: int) -> tuple[tuple[str, ...], ...]:
    """Per block, the stateful parts of a case (none for about half the cases)."""
    if rng.random() < 0.5:
        return ()
    return tuple(tuple(rng.sample(STATES, rng.randint(0, 2))) for _ in range(count))


def init_state(block: nn.Module, parts: tuple[str, ...], width: int, shared: Shared) -> None:
    """Give ``block`` the attributes its stateful ``parts`` change."""
    block.states = parts
    block.shared = shared
    block.history = {"inner": {"calls": 0}}
    block.rows = [[]]
    block.seen = []
    block.recent = collections.deque(maxlen=2)
    block.first_shape = None
    block.ema_holder = Tracker(width)
    block._private_calls = 0
    block.arrays = {"hits": np.zeros(1)}
    block.pair = (torch.zeros(1), [])
    block._private_hits = np.zeros(1)
    block.config = types.SimpleNamespace(counts={"inner": {"n": 0}}, history=[])
    block.slots = Slots()


def apply_state(block: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """Run the block's stateful parts on ``h``: each changes its state, then scales ``h`` by what it reads."""
    for part in block.states:
        h = h * _scale(block, part, h) if part != "nested_tensor" else _subtract_ema(block.ema_holder, h)
    return h


def _scale(block: nn.Module, part: str, h: torch.Tensor) -> float:
    shared = block.shared
    if part == "nested_counter":
        block.history["inner"]["calls"] += 1
        return 1.0 + 0.125 * block.history["inner"]["calls"]
    if part == "nested_list":
        block.rows[0].append(h.shape[0])
        return 1.0 + 0.0625 * len(block.rows[0])
    if part == "public_list":
        block.seen.append(len(block.seen))
        return 1.0 + 0.0625 * len(block.seen)
    if part == "deque":
        block.recent.append(len(block.recent) + 1)
        return 1.0 + 0.03125 * sum(block.recent)
    if part == "shared_object":
        shared.index += 1
        return 1.0 + 0.03125 * (shared.index % 8)
    if part == "first_call_config":  # as Hugging Face heads set config.problem_type on their first call
        first = shared.problem_type is None
        if first:
            shared.problem_type = "regression"
        return 2.0 if first else 1.0
    if part == "cached_property":
        return shared.scale
    if part == "first_call_attribute":
        first = block.first_shape is None
        if first:
            block.first_shape = tuple(h.shape)
        return 1.5 if first else 1.0
    if part in ("array_in_dict", "private_array"):
        hits = block.arrays["hits"] if part == "array_in_dict" else block._private_hits
        hits += 1
        return 1.0 + 0.125 * float(hits[0])
    if part == "tuple_held":
        block.pair[0].add_(1)
        block.pair[1].append(1)
        return 1.0 + 0.0625 * (float(block.pair[0][0]) + len(block.pair[1]))
    if part == "deep_config":
        block.config.counts["inner"]["n"] += 1
        block.config.history.append(len(block.config.history))
        return 1.0 + 0.0625 * (block.config.counts["inner"]["n"] + len(block.config.history))
    if part == "slots_object":
        block.slots.n += 1
        return 1.0 + 0.125 * block.slots.n
    block._private_calls += 1  # private_counter
    return 1.0 + 0.125 * block._private_calls


def _subtract_ema(tracker: Tracker, h: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        tracker.ema.mul_(0.5).add_(h.detach().float().mean(0), alpha=0.5)
    return h - tracker.ema.to(h.dtype)


def state_of(model: nn.Module) -> list[Any]:
    """The Python-side state of every block and of the object they share, as comparable values."""
    blocks = [{"history": block.history["inner"]["calls"], "rows": list(block.rows[0]), "seen": list(block.seen),
               "recent": list(block.recent), "first_shape": block.first_shape, "ema": block.ema_holder.ema.clone(),
               "private": block._private_calls, "arrays": torch.from_numpy(block.arrays["hits"].copy()),
               "pair": [block.pair[0].clone(), list(block.pair[1])],
               "private_hits": torch.from_numpy(block._private_hits.copy()),
               "config": [block.config.counts["inner"]["n"], list(block.config.history)], "slots": block.slots.n,
               "hook_log": list(getattr(block, "hook_log", ()))}
              for block in model]
    shared = model[0].shared
    norm = vars(shared).get("norm")  # a BatchNorm the blocks call outside their modules()
    outside = {} if norm is None else {"norm": {k: v.clone() for k, v in norm.state_dict().items()},
                                       "norm_grads": [None if p.grad is None else p.grad.clone() for p in norm.parameters()]}
    return [*blocks, {"index": shared.index, "problem_type": shared.problem_type, "scale": vars(shared).get("scale"), **outside}]


def refusal_accepted(states: tuple[tuple[str, ...], ...], message: str) -> bool:
    """Whether a :class:`~tba.errors.TbaError` with ``message`` names state of a drawn part tba does not put back."""
    return any(REFUSED[part] in message for parts in states for part in parts if part in REFUSED)
