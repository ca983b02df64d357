"""A recomputed layer replays a generator its code reaches the ways user code plausibly does beyond a plain name: a
``super().forward()`` into a base class's forward, a forward wrapped by a decorator (``functools.wraps``, a
``torch.autocast`` one, one without ``functools.wraps``), a class used as a namespace (``Noise.rng``), a forward made
with ``functools.partialmethod`` or ``functools.partial``, a mixin after ``nn.Module`` in the bases, a dict of
generators an imported module or a namespace class (one the module holds too) holds, a custom
``torch.autograd.Function``'s forward, and a helper reached through a longer chain first
(Note [Generators a layer's code names] in ``tba/runtime/_code_named.py``). Each drew its next numbers in the
recomputation, silently, before."""

from __future__ import annotations

import contextlib
import functools
import sys
import types

import pytest
import torch
from torch import nn

import tba

WIDTH = 8
SEEDS = {"parent": 21, "wrapped": 22, "autocast": 23, "namespace": 24, "partial": 25, "chain": 26, "table": 27,
         "class_table": 28, "mixin": 29, "function": 30, "closure": 31,
         "plain_partial": 32, "nested": 33}
GENERATORS = {name: torch.Generator().manual_seed(seed) for name, seed in SEEDS.items()}
PARENT, WRAPPED, AUTOCAST, PARTIAL, CHAIN = (GENERATORS[name] for name in ("parent", "wrapped", "autocast", "partial",
                                                                          "chain"))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.linear(x))
        return h * torch.rand(x.shape, generator=PARENT) + x


class Super(Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 2


def traced(function):
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        return function(*args, **kwargs)
    return wrapper


class Wrapped(Block):
    @traced
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x)) * torch.rand(x.shape, generator=WRAPPED) + x


def plain_decorator(function):
    def wrapper(self, x):
        return function(self, x)
    return wrapper


class Closure(Block):
    """A forward decorated without ``functools.wraps``, drawing from a generator its class holds."""

    rng = GENERATORS["closure"]

    @plain_decorator
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x)) * torch.rand(x.shape, generator=self.rng) + x


class Autocast(Block):
    @torch.autocast("cpu", enabled=False)
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x)) * torch.rand(x.shape, generator=AUTOCAST) + x


class Noise:
    """A class used as a namespace of settings."""

    rng = GENERATORS["namespace"]


noise_config = types.ModuleType("tba_test_reach_noise_config")
noise_config.TABLE = {"train": GENERATORS["table"]}
sys.modules[noise_config.__name__] = noise_config


noise_package = types.ModuleType("tba_test_reach_noise_package")
noise_package.Settings = type("Settings", (), {"by_phase": {"train": GENERATORS["nested"]}, "__module__": __name__})
sys.modules[noise_package.__name__] = noise_package


class Nested(Block):
    """Draws from a generator in a dict a class that an imported module holds holds."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x)) * torch.rand(x.shape, generator=noise_package.Settings.by_phase["train"]) + x


class Tables:
    """A class used as a namespace, holding a dict of generators."""

    by_phase = {"train": GENERATORS["class_table"]}


class Table(Block):
    """Draws from a generator in a dict that an imported module, or a class used as a namespace, holds."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.linear(x)) * torch.rand(x.shape, generator=noise_config.TABLE["train"])
        return h * torch.rand(x.shape, generator=Tables.by_phase["train"]) + x


class NoiseMixin:
    rng = GENERATORS["mixin"]

    def noise(self, x: torch.Tensor) -> torch.Tensor:
        return torch.rand(x.shape, generator=self.rng)


class Mixin(Block, NoiseMixin):
    """A mixin after ``nn.Module`` in the class's bases."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x)) * self.noise(x) + x


class StochasticScale(torch.autograd.Function):
    """A custom autograd function that draws its scale."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        noise = torch.rand(x.shape, generator=GENERATORS["function"])
        ctx.save_for_backward(noise)
        return x * noise

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (noise,) = ctx.saved_tensors
        return grad * noise


class Function(Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return StochasticScale.apply(torch.tanh(self.linear(x))) + x


class Namespace(Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x)) * torch.rand(x.shape, generator=Noise.rng) + x


def _scaled(self: nn.Module, x: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.tanh(self.linear(x)) * torch.rand(x.shape, generator=PARTIAL) * scale + x


class Partial(Block):
    forward = functools.partialmethod(_scaled, scale=2.0)


def _noisy_tanh(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    return torch.tanh(x) * torch.rand(x.shape, generator=generator) + x


class PlainPartial(Block):
    """A forward that is a ``functools.partial`` (called without ``self``), its generator among its arguments."""

    forward = functools.partial(_noisy_tanh, generator=GENERATORS["plain_partial"])


def _draw(x: torch.Tensor) -> torch.Tensor:
    return torch.rand(x.shape, generator=CHAIN)


def _noise(x: torch.Tensor) -> torch.Tensor:
    return _draw(x)


def _inner(x: torch.Tensor) -> torch.Tensor:
    return x * _noise(x)


def _deep(x: torch.Tensor) -> torch.Tensor:
    return _inner(x)


class Chain(Block):
    """Names ``_deep`` (searched first: names are taken sorted), which reaches ``_noise`` three calls deep, where the
    search stopped; ``_noise``, named here too, was then not searched again."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _deep(torch.tanh(self.linear(x))) + _noise(x) * x


def _train(kind: type[nn.Module], spill_dir: str | None) -> list[torch.Tensor]:
    torch.manual_seed(0)
    for name, seed in SEEDS.items():
        GENERATORS[name].manual_seed(seed)
    blocks = nn.ModuleList([kind(), kind()])
    result = []
    for step in range(2):
        x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(step)).requires_grad_()
        plan = tba.Plan(("recompute", "recompute"), window_bytes=1 << 20)
        with (tba.offload_activations(spill_dir, layers=list(blocks), policy=plan) if spill_dir
              else contextlib.nullcontext()):
            h = x
            for block in blocks:
                h = block(h)
            loss = h.pow(2).mean()
        loss.backward()
        result += [loss.detach(), x.grad, *(p.grad.clone() for p in blocks.parameters() if p.grad is not None)]
        blocks.zero_grad()
    return result + [generator.get_state() for generator in GENERATORS.values()]


@pytest.mark.parametrize("kind", [Super, Wrapped, Closure, Autocast, Namespace, Partial, PlainPartial,
                                  Chain, Table, Nested, Mixin, Function])
def test_recomputed_layer_replays_a_generator_its_code_reaches(tmp_path, kind):
    expected = _train(kind, None)
    got = _train(kind, str(tmp_path))
    assert len(got) == len(expected)
    for index, (a, b) in enumerate(zip(expected, got)):
        assert torch.equal(a, b), f"{kind.__name__}: tensor {index} differs from training without tba"
