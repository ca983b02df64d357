"""Differential fuzzing: random small models and steps, run with and without tba, compared bit for bit.

Each case is drawn from one integer seed (:func:`draw_case`, in ``_fuzz_case.py``): a stack of 2-5
blocks built from a menu (linear, layer norm, batch norm with running statistics, dropout, dropout on a
generator of its own, views and transposes, in-place activations, a weight shared between two blocks,
frozen weights, a running mean and a call counter that the forward updates and then reads, a scale
drawn from Python's and numpy's global generators, as stochastic depth is often written), a dtype, an
input that lives in torch memory, numpy memory (directly or through DLPack) or a bytearray, a placement
(the bare context, or a pinned plan that keeps, offloads, recomputes or recomputes with its input
offloaded each block; or the bare context under a policy object that plans given placements, one per
input shape, over more steps), a backend, a minimum offload size, the input's batch size per step (a
changing input shape), the steps whose backward runs twice through a retained graph, an event per step
(a normal step, a step that waits for its writes before backward (``flush()``), so that backward reads
the file instead of memory the writes had not yet freed, an exception raised inside the block, or a
dropped loss), whether writes queue and start late, in random order (Note [Writes that queue in the
fuzzer] in ``tba/bench/_fuzz_io.py``), and per block the Python-side state its forward changes and reads
(counters in nested dicts, lists, a deque, an object shared by every block, attributes set on the first
call, a cached property, a tensor in a plain object, a private counter: ``tba/bench/_fuzz_state.py``),
and parts real models write (``tba/bench/_fuzz_parts.py``: custom autograd Functions, hooks the program registers on a
block's linear layer, an argument besides the input passed to every block, a checkpoint of the
model's own inside a block, CPU bfloat16 autocast around the forward or each block's linear), a noise mask every
block draws from a generator held by the plain object the blocks share, per block an op real models run
(``tba/bench/_fuzz_ops.py``: convolutions, max-pooling, an embedding lookup, attention, a GRU cell, complex
views, overlapping and stride-0 views, views sharing one storage, an in-place op on a slice) and a call through
``functional_call`` with fast weights, and per step a mode (``tba/bench/_fuzz_steps.py``: gradient accumulation,
a forward under ``no_grad`` or ``inference_mode`` mixed in, a gradient penalty through double backward,
``zero_grad(set_to_none=False)``).
:func:`run_case` runs the same steps twice from the same seed, once without tba and once with it, and
compares losses, gradients, buffers, that Python-side state, SGD-with-momentum state and the input
tensors with ``torch.equal``; a run with tba may instead raise a :class:`~tba.errors.TbaError` that
names state tba does not put back for a recomputation (exact or loud); any other error is a finding.
It also checks that no descriptor, thread or file is left once tba has shut its runtimes down.
:func:`reproducer` prints the case as Python.

Note: [Custom generators under recompute]
A dropout drawn from a ``torch.Generator`` of the model's own is not covered by checkpoint's RNG
preservation (global generators only); recomputing its block is drawn like any other, so the
fuzzer checks that tba's recompute wrapper replays that generator: losses, gradients and each
generator's final state are compared.
"""

from __future__ import annotations

import math
import os
import random
import tempfile
import threading
from typing import Any

import numpy as np
import torch
from torch import nn

from tba.bench import _fuzz_steps as fuzz_steps
from tba.bench._fuzz_case import BLOCKS, DTYPES, EVENTS, PLACEMENTS, Block, Case, build, case_input, draw_case
from tba.bench._fuzz_io import late_engine
from tba.bench._fuzz_parts import autocast, step_extra
from tba.bench._fuzz_state import refusal_accepted, state_of

__all__ = ["BLOCKS", "DTYPES", "EVENTS", "PLACEMENTS", "Block", "Case", "build", "draw_case", "reproducer", "run_case"]

class _Raised(Exception):
    """Raised inside the offload block on purpose."""


def _train(case: Case, directory: str | None, engine: Any = None) -> dict[str, Any]:
    import tba

    model = build(case)
    trainable = [p for p in model.parameters() if p.requires_grad] or [nn.Parameter(torch.zeros(1))]
    optimizer = torch.optim.SGD(trainable, lr=0.01, momentum=0.9)
    plan = tba.Plan(case.placement, window_bytes=1 << 20) if case.placement is not None else None
    made: list[Any] = []

    def new_offloader() -> Any:
        if directory is None or plan is None:
            return None
        made.append(tba.Offloader(directory, layers=list(model), policy=plan, backend=engine or case.backend,
                                  min_offload_bytes=case.min_offload_bytes))
        return made[-1]

    try:
        return _steps(case, model, optimizer, directory, engine, new_offloader)
    except tba.TbaError:  # refused (run_case judges whether rightly): nothing may be left open
        for offloader in made:
            offloader.close()
        raise


def _steps(case: Case, model: nn.Sequential, optimizer: Any, directory: str | None, engine: Any,
           new_offloader: Any) -> dict[str, Any]:
    import tba

    offloader = new_offloader()
    bare = {"policy": _plans_in_turn(case.plans_in_turn), "profile_steps": 1} if case.plans_in_turn else {}
    losses, inputs = [], []
    torch.manual_seed(case.seed + 7)
    random.seed(case.seed + 7)
    np.random.seed((case.seed + 7) % 2**32)
    for step, event in enumerate(case.events):
        x, owner = case_input(case, step)
        before = _owner_values(owner)
        if not any(p.requires_grad for p in model.parameters()):
            x = x.detach().requires_grad_(True)
        if directory is None:
            context = torch.enable_grad()
        elif offloader is not None:
            context = offloader
        else:
            context = tba.offload_activations(directory, backend=engine or case.backend, min_offload_bytes=case.min_offload_bytes,
                                              **bare)
        mode, batch = case.modes[step] if case.modes else "", x.shape[0]

        def forward(inputs: torch.Tensor, step: int = step) -> torch.Tensor:
            with autocast(case.autocast == "model"):
                out = model(inputs, step_extra(case.extra, case.seed, step, inputs.shape[0], case.width))
            return out.float().pow(2).mean()

        try:
            with context:
                fuzz_steps.without_grad(mode, forward, case, step, batch, after=False)
                loss = forward(x)
                del x  # as in a training loop: only autograd (and tba) hold the input now
                if mode == "accumulate":
                    loss = loss + forward(fuzz_steps.second_input(case, step, batch))
                fuzz_steps.without_grad(mode, forward, case, step, batch, after=True)
                if event == "raise":
                    raise _Raised
                if event == "flush" and directory is not None:
                    context.flush()
        except _Raised:
            if offloader is not None:
                offloader = new_offloader()
            continue
        if event == "drop":
            del loss
            continue
        optimizer.zero_grad(set_to_none=mode != "keep_grads")
        fuzz_steps.backward(loss, model, mode, step in case.retained)
        optimizer.step()
        losses.append(loss.detach())
        inputs.append((before, owner))
    if offloader is not None:
        offloader.close()
    return {"python_state": state_of(model), "losses": losses, "state": {k: v.clone() for k, v in model.state_dict().items()},
            "grads": [None if p.grad is None else p.grad.clone() for p in model.parameters()],
            "momentum": [optimizer.state[p].get("momentum_buffer") for p in optimizer.param_groups[0]["params"]],
            "generators": [block.generator.get_state() for block in model if block.generator is not None]
            + [torch.tensor([random.random(), float(np.random.rand())], dtype=torch.float64)],
            "inputs_unchanged": all(torch.equal(before, _owner_values(owner)) for before, owner in inputs)}


def _plans_in_turn(plans: tuple[tuple[str, ...], ...]) -> Any:
    """A :class:`tba.Policy` whose plans are ``plans`` in turn, one per shape planned (repeated or cut to the
    number of layers the profile has)."""
    import tba

    class InTurn(tba.Policy):
        def __init__(self) -> None:
            self.made = 0

        def plan(self, profile: Any) -> Any:
            # As many decisions as the layers found (blocks that save nothing are not layers to discovery).
            drawn = plans[self.made % len(plans)]
            self.made += 1
            decisions = tuple(drawn[i % len(drawn)] for i in range(len(profile.layers)))
            return tba.Plan(decisions, window_bytes=1 << 20, goal="plans in turn")

    return InTurn()


def _owner_values(owner: Any) -> torch.Tensor:
    """A copy of the bytes the owner of an input holds (its numpy array, bytearray or tensor)."""
    if isinstance(owner, torch.Tensor):
        return owner.detach().clone()
    return torch.frombuffer(bytearray(memoryview(owner).cast("B")), dtype=torch.uint8)


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and (torch.equal(a, b) or _equal_with_nan(a, b))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))  # Note [A case that diverges]
    return a == b


def _equal_with_nan(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` have NaN in the same places and are equal everywhere else.

    Note: [A case that diverges]
    A case's training may diverge (float16 overflowing, a product of an activation with itself in every
    block): its losses and gradients are NaN in both runs, and ``torch.equal`` calls NaN unequal to itself,
    so the fuzzer reported a difference that training without tba had with itself. The places of the NaNs
    must match, and every other value exactly (a NaN's payload is not compared); a Python float of the blocks'
    state (a hook's log of sums) that is NaN in both runs is no difference either.
    """
    if not (a.is_floating_point() or a.is_complex()):
        return False
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a[~nan], b[~nan])


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def run_case(case: Case) -> list[str]:
    """Differences between the case with and without tba, and anything tba left behind; empty when clean."""
    import tba

    problems = []
    want = _train(case, None)
    fds, threads = _open_fds(), threading.active_count()
    with (tempfile.TemporaryDirectory(prefix="tba-fuzz-") as directory,
          late_engine(case.late_writes, case.seed, case.backend) as engine):
        try:
            got = _train(case, directory, engine)
        except tba.TbaError as err:
            got = {"refused": err}
        tba.shutdown()
        left = os.listdir(directory)
    if "refused" in got:
        if not refusal_accepted(case.states, str(got["refused"])):
            problems.append(f"tba raised {type(got['refused']).__name__}: {got['refused']}")
    else:
        problems += _differences(got, want)
    if left:
        problems.append(f"files left in the directory: {left}")
    if _open_fds() > fds:
        problems.append(f"{_open_fds() - fds} descriptors left")
    if threading.active_count() > threads + 1:
        problems.append(f"{threading.active_count() - threads} threads left")
    return problems


def _differences(got: dict[str, Any], want: dict[str, Any]) -> list[str]:
    problems = [f"{key} differ" for key in ("losses", "grads", "state", "python_state", "momentum", "generators")
                if not _equal(got[key], want[key])]
    if not got["inputs_unchanged"]:
        problems.append("the user's input tensors changed")
    return problems


def reproducer(case: Case) -> str:
    """Python that replays ``case`` (with tba installed and this module importable)."""
    return (f"from tba.bench.fuzz import draw_case, run_case\n"
            f"case = draw_case({case.seed})  # {case}\n"
            f"print(run_case(case))\n")
