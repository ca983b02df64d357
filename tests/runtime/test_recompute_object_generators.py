"""A recomputed layer that draws from a generator held by a plain object (a context object passed in its call, a config
object its modules hold) draws the same numbers again (Note [Generators of a recomputed layer] in
``tba/runtime/_generators.py``).

Found by an adversarial review (helper-117): the generators were looked for in the modules' attributes and the call's
arguments, and in dicts, lists and tuples there, but not in a plain object's attributes. The recomputation drew the
next numbers from such a generator, a noise mask other than the first call's, and the gradients of every pinned plan
that recomputed the layer differed from training without tba, silently; the adaptive default recomputed such layers
too (nothing in their profiled steps tells). Nor were the generators of modules outside the layer: a noise module
passed to every block, held in a list, or reached through the module's globals and called (its state put back for the
recomputation as the layer's own modules' is, its generator not).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import random

import numpy as np
import pytest
import torch
from torch import nn

import tba

WIDTH = 8


class Context:
    """A per-step context the loop passes to every block."""

    def __init__(self, step: int) -> None:
        self.generator = torch.Generator().manual_seed(100 + step)


@dataclasses.dataclass
class Config:
    """A config object every block holds, with the generators of each kind tba replays."""

    torch_rng: torch.Generator = dataclasses.field(default_factory=lambda: torch.Generator().manual_seed(3))
    python_rng: random.Random = dataclasses.field(default_factory=lambda: random.Random(4))
    numpy_rng: np.random.Generator = dataclasses.field(default_factory=lambda: np.random.default_rng(5))


class Noisy(nn.Module):
    """Scales its activation by noise drawn from the passed context's generator and from the held config's."""

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.config = config

    def forward(self, x: torch.Tensor, context: Context) -> torch.Tensor:
        h = torch.tanh(self.linear(x)) * torch.rand(x.shape, generator=context.generator)
        h = h * torch.rand(x.shape, generator=self.config.torch_rng)
        return h * (self.config.python_rng.random() + float(self.config.numpy_rng.random())) + x


def _train(spill_dir: str, plan: tuple[str, ...] | None) -> list[torch.Tensor]:
    torch.manual_seed(0)
    config = Config()
    blocks = nn.ModuleList([Noisy(config), Noisy(config)])
    result = []
    for step in range(2):
        x, context = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(step)), Context(step)
        with (tba.offload_activations(spill_dir, layers=list(blocks), policy=tba.Plan(plan, window_bytes=1 << 20))
              if plan else contextlib.nullcontext()):
            h = x
            for block in blocks:
                h = block(h, context)
            loss = h.pow(2).mean()
        loss.backward()
        result += [loss.detach(), *(p.grad.clone() for p in blocks.parameters())]
        result += [context.generator.get_state(), config.torch_rng.get_state(),
                   torch.tensor([config.python_rng.random(), config.numpy_rng.random()])]
        blocks.zero_grad()
    return result


@pytest.mark.parametrize("plan", [("recompute", "offloaded_recompute"), ("offloaded_recompute", "recompute")])
def test_generators_held_by_plain_objects_draw_the_same_again(spill_dir, plan):
    reference = _train(spill_dir, None)
    result = _train(spill_dir, plan)
    assert all(torch.equal(a, b) for a, b in zip(reference, result, strict=True))


class Noise(nn.Module):
    """Drops a fifth of its input with a generator of its own: a module the blocks share without holding it as a
    submodule."""

    def __init__(self) -> None:
        super().__init__()
        self.generator = torch.Generator().manual_seed(11)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h * (torch.rand(h.shape, generator=self.generator) > 0.2).to(h.dtype)


GLOBAL_NOISE = Noise()
"""Reached by the blocks through this module's globals: found only when it is called (Note [A recomputation puts back
the modules outside its layer that it calls] in tba/runtime/_outside_state.py)."""


class Reaching(nn.Module):
    """Calls the noise module passed to it, calls one held in a list, draws from that one's generator directly, and calls
    a module-level one."""

    def __init__(self, noise: Noise) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.refs = [noise]

    def forward(self, x: torch.Tensor, passed: Noise) -> torch.Tensor:
        h = passed(torch.tanh(self.linear(x)))
        h = self.refs[0](h) * torch.rand(h.shape, generator=self.refs[0].generator)
        return GLOBAL_NOISE(h) + x


def _train_reaching(spill_dir: str, plan: tuple[str, ...] | None) -> list[torch.Tensor]:
    torch.manual_seed(0)
    GLOBAL_NOISE.generator.manual_seed(12)
    passed, held = Noise(), Noise()
    blocks = nn.ModuleList([Reaching(held), Reaching(held)])
    result = []
    for step in range(2):
        x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(step))
        with (tba.offload_activations(spill_dir, layers=list(blocks), policy=tba.Plan(plan, window_bytes=1 << 20))
              if plan else contextlib.nullcontext()):
            h = x
            for block in blocks:
                h = block(h, passed)
            loss = h.pow(2).mean()
        loss.backward()
        result += [loss.detach(), *(p.grad.clone() for p in blocks.parameters())]
        result += [noise.generator.get_state() for noise in (passed, held, GLOBAL_NOISE)]
        blocks.zero_grad()
    return result


@pytest.mark.parametrize("plan", [("recompute", "offloaded_recompute"), ("offloaded_recompute", "recompute")])
def test_generators_of_modules_outside_the_layer_draw_the_same_again(spill_dir, plan):
    reference = _train_reaching(spill_dir, None)
    result = _train_reaching(spill_dir, plan)
    assert all(torch.equal(a, b) for a, b in zip(reference, result, strict=True))


def _drop(h: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    return h * (torch.rand(h.shape, generator=generator) > 0.2).to(h.dtype)


class Calling(nn.Module):
    """Applies the noise function it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, noise: object) -> torch.Tensor:
        return noise(torch.tanh(self.linear(x))) + x


def _noise(kind: str, step: int) -> object:
    generator = torch.Generator().manual_seed(20 + step)
    if kind == "lambda":
        return lambda h: _drop(h, generator)
    if kind == "partial":
        return functools.partial(_drop, generator=generator)
    return Noise().__call__ if kind == "bound method" else None


@pytest.mark.parametrize("kind", ["lambda", "partial", "bound method"])
@pytest.mark.parametrize("plan", [("recompute", "recompute"), ("offloaded_recompute", "recompute")])
def test_generators_held_by_a_passed_function_draw_the_same_again(spill_dir, kind, plan):
    def train(plan: tuple[str, ...] | None) -> list[torch.Tensor]:
        torch.manual_seed(0)
        blocks = nn.ModuleList([Calling(), Calling()])
        result = []
        for step in range(2):
            x, noise = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(step)), _noise(kind, step)
            with (tba.offload_activations(spill_dir, layers=list(blocks), policy=tba.Plan(plan, window_bytes=1 << 20))
                  if plan else contextlib.nullcontext()):
                h = x
                for block in blocks:
                    h = block(h, noise)
                loss = h.pow(2).mean()
            loss.backward()
            result += [loss.detach(), *(p.grad.clone() for p in blocks.parameters())]
            blocks.zero_grad()
        return result

    reference = train(None)
    assert all(torch.equal(a, b) for a, b in zip(reference, train(plan), strict=True))
