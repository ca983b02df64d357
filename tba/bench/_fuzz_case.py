"""The cases of the differential fuzzer (``tba/bench/fuzz.py``): what one seed draws, and the model it builds.

:func:`draw_case` turns one integer seed into a :class:`Case`: a stack of 2-5 blocks built from a
menu (:data:`BLOCKS`: linear, layer norm, batch norm with running statistics, dropout, dropout on a
generator of its own, views and transposes, in-place activations, a weight shared between two
blocks, frozen weights, a running mean and a call counter that the forward updates and then reads,
a scale drawn from Python's and numpy's global generators, as stochastic depth is often written),
a dtype, an input source, a placement, a backend, a minimum offload size, the batch size per step,
the retained steps, the events per step, the late writes (``_fuzz_io.py``), the Python-side state
each block's forward changes and reads (``_fuzz_state.py``) and a BatchNorm all blocks call outside their
``modules()``, the parts of ``_fuzz_parts.py``, a noise mask every block draws from a generator held by the
plain object they share, the ops and calls of ``_fuzz_ops.py`` and the step modes of ``_fuzz_steps.py``. New fields are drawn
last, so every older field stays what it was for every seed (a printed reproducer keeps working).
:func:`build` makes the case's model (:class:`Block` per entry) and :func:`case_input` a step's
input, both from the seed alone, so the runs with and without tba see identical models and inputs.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import numpy as np
import torch
from torch import nn

from tba.bench import _fuzz_ops as fuzz_ops
from tba.bench import _fuzz_parts as fuzz_parts
from tba.bench import _fuzz_steps as fuzz_steps
from tba.bench._fuzz_io import LateWrites, draw_late_writes
from tba.bench._fuzz_state import Shared, apply_state, draw_states, init_state

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
BLOCKS = ("linear", "layernorm", "batchnorm", "dropout", "generator_dropout", "view", "inplace", "frozen", "centering",
          "host_random")
EVENTS = ("step", "step", "flush", "step", "raise", "drop")
PLACEMENTS = ("keep", "offload", "recompute", "offloaded_recompute")


@dataclasses.dataclass(frozen=True)
class Case:
    """One randomised scenario; every field is drawn from ``seed``."""

    seed: int
    blocks: tuple[tuple[str, ...], ...]
    width: int
    batch: int
    dtype: torch.dtype
    source: str
    placement: tuple[str, ...] | None
    backend: str
    min_offload_bytes: int
    shared_weight: bool
    events: tuple[str, ...]
    batches: tuple[int, ...] = ()
    """Per step, the input's batch size (a new input shape); empty: ``batch`` every step."""
    plans_in_turn: tuple[tuple[str, ...], ...] = ()
    """With the bare context: a policy object whose plans are these, one per input shape in the order
    the shapes are planned (Note [A step whose shape has a plan follows it]); empty: the default policy."""
    retained: tuple[int, ...] = ()
    """Steps whose backward runs twice, the first with ``retain_graph=True``: the second pass needs every storage
    again, after the first released what it unpacked (writes skipped as not needed, bytes held by the window)."""
    late_writes: LateWrites | None = None
    """Writes queue in tba and the engine and start late, in random order; None: as the backend runs them."""
    states: tuple[tuple[str, ...], ...] = ()
    """Per block, the Python-side state its forward changes and reads (``_fuzz_state.py``); empty: none."""
    outside_norm: bool = False
    """Every block calls a BatchNorm held by the object they share, outside each block's ``modules()`` (Note [A
    recomputation puts back the modules outside its layer that it calls] in ``tba/runtime/_outside_state.py``)."""
    functions: tuple[str, ...] = ()
    """Per block, the custom autograd Function its forward applies ("" none; ``_fuzz_parts.py``); empty: none."""
    hooks: tuple[str, ...] = ()
    """Per block, a hook the program registers on its linear layer ("" none; ``_fuzz_parts.py``); empty: none."""
    extra: str = ""
    """An argument every block takes besides ``x``, new each step (``_fuzz_parts.py``); "": none."""
    checkpoints: tuple[str, ...] = ()
    """Per block, the checkpoint of its own it runs a piece of its forward under ("" none; ``_fuzz_parts.py``)."""
    autocast: str = ""
    """Where CPU bfloat16 autocast is entered: around the model's forward or each block's linear (``_fuzz_parts.py``)."""
    shared_noise: bool = False
    """Every block scales its activation by a mask drawn from a ``torch.Generator`` held by the plain object the blocks
    share (Note [Generators of a recomputed layer] in ``tba/runtime/_generators.py``)."""
    ops: tuple[str, ...] = ()
    """Per block, an op real models run (conv, pooling, embedding, attention, ...; ``_fuzz_ops.py``); empty: none."""
    calls: tuple[str, ...] = ()
    """Per block, "functional" when it is called through ``functional_call`` with fast weights (``_fuzz_ops.py``)."""
    modes: tuple[str, ...] = ()
    """Per step, how the step trains besides its event (accumulation, an extra forward without grad, double
    backward, ``zero_grad(set_to_none=False)``: ``_fuzz_steps.py``); empty: plainly every step."""


def draw_case(seed: int) -> Case:
    """The case of ``seed``."""
    rng = random.Random(seed)
    count = rng.randint(2, 5)
    blocks = tuple(tuple(rng.sample(BLOCKS, rng.randint(1, 3))) for _ in range(count))
    placement = None if rng.random() < 0.4 else tuple(rng.choice(PLACEMENTS) for block in blocks)
    case = Case(seed=seed, blocks=blocks, width=rng.choice((16, 64, 96)), batch=rng.choice((8, 32, 64, 512)),
                dtype=rng.choice(DTYPES), source=rng.choice(("torch", "numpy", "dlpack", "bytearray")), placement=placement,
                backend=rng.choice(("auto", "threads")), min_offload_bytes=rng.choice((0, 4096, 65536)),
                shared_weight=rng.random() < 0.3, events=tuple(rng.choice(EVENTS) for _ in range(rng.randint(1, 3))))
    # Drawn last, so that the fields above stay what they were for every seed.
    events, plans = case.events, ()
    if placement is None and rng.random() < 0.5:  # enough steps to find the layers, profile and follow plans
        events += tuple(rng.choice(EVENTS) for _ in range(rng.randint(4, 6)))
        plans = tuple(tuple(rng.choice(PLACEMENTS) for _ in blocks) for _ in range(2))
    batches = ()
    if rng.random() < 0.4:
        other = rng.choice([size for size in (8, 32, 64) if size != case.batch])
        batches = tuple(rng.choice((case.batch, other)) for _ in events)
    retained = tuple(step for step in range(len(events)) if rng.random() < 0.25)
    late_writes = draw_late_writes(rng)
    states = draw_states(rng, count)
    outside_norm = rng.random() < 0.3
    case = dataclasses.replace(case, events=events, batches=batches, plans_in_turn=plans, retained=retained,
                               late_writes=late_writes, states=states, outside_norm=outside_norm,
                               functions=fuzz_parts.draw_functions(rng, count), hooks=fuzz_parts.draw_hooks(rng, count),
                               extra=fuzz_parts.draw_extra(rng), checkpoints=fuzz_parts.draw_checkpoints(rng, count),
                               autocast=fuzz_parts.draw_autocast(rng), shared_noise=rng.random() < 0.25)
    case = dataclasses.replace(case, ops=fuzz_ops.draw_ops(rng, count), calls=fuzz_ops.draw_calls(rng, count))
    return dataclasses.replace(case, modes=fuzz_steps.draw_modes(rng, case))


class Block(nn.Module):
    """One fuzzed block: its parts applied in order, then a residual connection."""

    def __init__(self, parts: tuple[str, ...], width: int, seed: int, states: tuple[str, ...] = (),
                 shared: Shared | None = None) -> None:
        super().__init__()
        init_state(self, states, width, shared if shared is not None else Shared())
        self.parts = parts
        self.linear = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width) if "layernorm" in parts else None
        self.batchnorm = nn.BatchNorm1d(width) if "batchnorm" in parts else None
        self.generator = torch.Generator().manual_seed(seed) if "generator_dropout" in parts else None
        self.register_buffer("center", torch.zeros(width) if "centering" in parts else None)
        self.calls = 0
        self.outside_norm = False
        self.function = ""
        self.hook_log: list[float] = []
        self.checkpoint = ""
        self.autocast = False
        self.shared_noise = False
        if "frozen" in parts:
            self.linear.requires_grad_(False)

    def forward(self, x: torch.Tensor, extra: Any = None) -> torch.Tensor:
        with fuzz_parts.autocast(self.autocast):
            h = self.linear(x)
        h = h.to(x.dtype)
        if extra is not None:
            h = fuzz_parts.apply_extra(h, extra)
        for part in self.parts:
            if part == "layernorm":
                h = self.norm(h)
            elif part == "batchnorm":
                h = self.batchnorm(h)
            elif part == "dropout":
                h = nn.functional.dropout(h, 0.2, self.training)
            elif part == "generator_dropout":
                keep = torch.rand(h.shape, generator=self.generator) > 0.2
                h = h * keep.to(h.dtype) / 0.8
            elif part == "view":
                h = h.t().contiguous().t()[:, : h.shape[1]].reshape(h.shape)
            elif part == "inplace":
                h = (h * 2).relu_()
            elif part == "host_random":  # Note [Generators of a recomputed layer] in tba/runtime/_generators.py
                h = h * (1.0 + (random.random() < 0.5) + float(np.random.rand()))
            elif part == "centering":  # Note [Side effects of a recomputed forward] in tba/runtime/_layer_state.py
                self.calls += 1
                with torch.no_grad():
                    self.center.mul_(0.5).add_(h.detach().float().mean(0).to(self.center.dtype), alpha=0.5)
                h = (h - self.center) / self.calls
        h = fuzz_ops.apply_op(self, h)
        if self.shared_noise:
            h = h * (torch.rand(h.shape, generator=self.shared.generator) > 0.1).to(h.dtype)
        if self.outside_norm:
            h = self.shared.norm(h)
        if self.function:
            h = fuzz_parts.apply_function(self.function, h)
        if self.checkpoint:
            h = fuzz_parts.apply_checkpoint(self.checkpoint, h)
        return torch.sin(apply_state(self, h)) + x


def build(case: Case) -> fuzz_parts.Stack:
    """The case's model, from its seed (identical on every call)."""
    torch.manual_seed(case.seed)
    shared = Shared()
    model = fuzz_parts.Stack(*[Block(parts, case.width, case.seed + i, case.states[i] if case.states else (), shared)
                              for i, parts in enumerate(case.blocks)])
    if case.shared_weight and len(model) > 1:
        model[-1].linear.weight = model[0].linear.weight
    for block, function in zip(model, case.functions):
        block.function = function
    for block, hook in zip(model, case.hooks):
        fuzz_parts.register_hook(block, hook)
    for block, kind in zip(model, case.checkpoints):
        block.checkpoint = kind
    for block, op in zip(model, case.ops):
        fuzz_ops.attach(block, op, case.width)
    for block, how in zip(model, case.calls):
        block.call = how
    for block in model:
        block.autocast = case.autocast == "linear"
        block.shared_noise = case.shared_noise
    if case.shared_noise:
        shared.generator = torch.Generator().manual_seed(case.seed + 7)
    if case.outside_norm:
        shared.norm = nn.BatchNorm1d(case.width).to(case.dtype)
        for block in model:
            block.outside_norm = True
    return model.to(case.dtype)


def case_input(case: Case, step: int) -> tuple[torch.Tensor, Any]:
    """The step's input and the object that owns its memory (numpy array, bytearray or the tensor)."""
    batch = case.batches[step] if case.batches else case.batch
    values = np.random.default_rng(case.seed * 131 + step).standard_normal((batch, case.width)).astype(np.float32)
    if case.source in ("numpy", "dlpack"):
        padded = np.empty(values.size + 16, dtype=np.float32)
        start = next(i for i in range(16) if padded[i:].ctypes.data % 64 == 0)
        owner = padded[start:start + values.size].reshape(values.shape)
        owner[...] = values
        tensor = torch.from_numpy(owner) if case.source == "numpy" else torch.from_dlpack(owner)
        return (tensor.to(case.dtype) if case.dtype != torch.float32 else tensor), owner
    if case.source == "bytearray":
        owner = bytearray(values.tobytes())
        tensor = torch.frombuffer(owner, dtype=torch.float32).view(batch, case.width)
        return (tensor.to(case.dtype) if case.dtype != torch.float32 else tensor), owner
    tensor = torch.from_numpy(values.copy()).to(case.dtype)
    return tensor, tensor
