"""A recomputed layer that draws from a generator its code names, a module-level one or a class attribute, draws the
same numbers again (Note [Generators a layer's code names] in ``tba/runtime/_code_named.py``).

The generators were looked for in what the layer's modules hold, in the call's arguments and in what those hold, but
not in the globals its code reads: a ``torch.Generator`` made at module level and passed as ``generator=`` in
``forward`` (or in a module-level helper that ``forward`` calls, or in the forward of a module-level module that it
calls), or one held by the class, drew its next numbers in
the recomputation, a noise mask other than the first call's, and every plan that recomputed the layer (the adaptive
default among them: nothing in a profiled step tells) trained with gradients other than those of training without tba,
silently.
"""

from __future__ import annotations

import functools
import sys
import types

import numpy as np
import pytest
import torch
from torch import nn
from utils import pinned_steps

import tba

WIDTH = 8

NOISE = torch.Generator().manual_seed(7)
"""A module-level generator, named in :meth:`Direct.forward`."""



HELPER_NOISE = torch.Generator().manual_seed(14)


def masked(x: torch.Tensor) -> torch.Tensor:
    """A module-level helper that draws from a module-level generator."""
    return x * torch.rand(x.shape, generator=HELPER_NOISE)


SETTINGS = types.SimpleNamespace(rng=torch.Generator().manual_seed(10))
"""A module-level plain object holding a generator."""

noise_lib = types.ModuleType("tba_test_noise_lib")
noise_lib.G = torch.Generator().manual_seed(11)
sys.modules[noise_lib.__name__] = noise_lib


OUTSIDE_NOISE = torch.Generator().manual_seed(13)


class GlobalNoise(nn.Module):
    """A module outside the layer, at module level, whose forward names a module-level generator."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rand(x.shape, generator=OUTSIDE_NOISE)


NOISE_MODULE = GlobalNoise()


class Direct(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x)) * torch.rand(x.shape, generator=NOISE) + x


class Helper(Direct):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return masked(torch.tanh(self.linear(x))) + x


class ClassHeld(Direct):
    rng = torch.Generator().manual_seed(12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x)) * self._mask(x) + x

    def _mask(self, x: torch.Tensor) -> torch.Tensor:
        return torch.rand(x.shape, generator=self.rng)


class Namespaced(Direct):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.linear(x)) * torch.rand(x.shape, generator=SETTINGS.rng)
        return h * torch.rand(x.shape, generator=noise_lib.G) + x


class Outside(Direct):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return NOISE_MODULE(torch.tanh(self.linear(x))) + x


PER_CALL = torch.Generator()
"""Rebound by :meth:`Rebinding.forward` at every call, a new generator seeded the same."""


class Rebinding(Direct):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        global PER_CALL
        PER_CALL = torch.Generator().manual_seed(15)
        return torch.tanh(self.linear(x)) * torch.rand(x.shape, generator=PER_CALL) + x


def _generators() -> list[torch.Tensor]:
    return [NOISE.get_state(), OUTSIDE_NOISE.get_state(), HELPER_NOISE.get_state(), SETTINGS.rng.get_state(),
            noise_lib.G.get_state(), ClassHeld.rng.get_state()]


def _seed() -> None:
    NOISE.manual_seed(7)
    SETTINGS.rng.manual_seed(10)
    noise_lib.G.manual_seed(11)
    ClassHeld.rng.manual_seed(12)
    OUTSIDE_NOISE.manual_seed(13)
    HELPER_NOISE.manual_seed(14)


def _train(kind: type[nn.Module], spill_dir: str | None) -> list[torch.Tensor]:
    """Two steps, every block recomputed under tba when ``spill_dir`` is given: losses, gradients, generator states."""
    _seed()
    steps, _ = pinned_steps(kind, WIDTH, spill_dir, ("recompute", "recompute") if spill_dir else None)
    return steps + _generators()


@pytest.mark.parametrize("kind", [Direct, Helper, ClassHeld, Namespaced, Outside, Rebinding])
def test_recomputed_layer_replays_the_generators_its_code_names(tmp_path, kind):
    expected = _train(kind, None)
    got = _train(kind, str(tmp_path))
    assert len(got) == len(expected)
    for index, (a, b) in enumerate(zip(expected, got)):
        assert torch.equal(a, b), f"{kind.__name__}: tensor {index} differs from training without tba"


def test_a_generator_rebound_between_forward_and_backward_is_refused(tmp_path):
    """A module-level generator rebound after the forward (another pass re-seeds it as a new generator): the
    recomputation drew from the new one, other numbers than the forward's, and gradients differed, silently. It is
    refused: the recomputation draws from a generator its first call's search did not find (Note [A generator bound
    after the first call is refused] in ``tba/runtime/_generators.py``); :class:`Rebinding`, which binds a new one at
    every call, is not."""
    global NOISE
    kept = NOISE
    try:
        blocks = nn.ModuleList([Direct(), Direct()])
        x = torch.randn(4, WIDTH)
        with tba.offload_activations(str(tmp_path), layers=list(blocks), policy=tba.Plan(("recompute", "recompute"),
                                                                                         window_bytes=1 << 20)):
            loss = blocks[1](blocks[0](x)).pow(2).mean()
        NOISE = torch.Generator().manual_seed(100)
        with pytest.raises(tba.TbaError, match="its first call's search did not find"):
            loss.backward()
    finally:
        NOISE = kept


class Lazy(Direct):
    """Makes its generator at its first call (a ``functools.cached_property``), after the search has looked."""

    @functools.cached_property
    def rng(self) -> torch.Generator:
        return torch.Generator().manual_seed(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x)) * torch.rand(x.shape, generator=self.rng) + x


def test_a_generator_made_by_the_first_call_is_refused(tmp_path):
    """The recomputation drew from the generator the first call made, moved by it: other numbers, silently."""
    blocks = nn.ModuleList([Lazy(), Lazy()])
    with tba.offload_activations(str(tmp_path), layers=list(blocks), policy=tba.Plan(("recompute", "recompute"),
                                                                                     window_bytes=1 << 20)):
        loss = blocks[1](blocks[0](torch.randn(4, WIDTH))).pow(2).mean()
    with pytest.raises(tba.TbaError, match="its first call's search did not find"):
        loss.backward()


NUMPY_NOISE = np.random.Generator(np.random.MT19937(17))
"""A module-level numpy generator whose state holds an array (MT19937's key)."""


class NumpyNoise(Direct):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        noise = torch.from_numpy(NUMPY_NOISE.random(tuple(x.shape), dtype=np.float32))
        return torch.tanh(self.linear(x)) * noise + x


@pytest.mark.parametrize("bits", [np.random.MT19937, np.random.SFC64, np.random.PCG64])
def test_a_numpy_generator_rebound_between_forward_and_backward_is_refused(tmp_path, bits):
    """Its state compared before and after the recomputation: an array in it (MT19937's key, SFC64's state) made the
    comparison raise numpy's ValueError out of backward instead of the TbaError."""
    global NUMPY_NOISE
    kept = NUMPY_NOISE
    try:
        blocks = nn.ModuleList([NumpyNoise(), NumpyNoise()])
        with tba.offload_activations(str(tmp_path), layers=list(blocks), policy=tba.Plan(("recompute", "recompute"),
                                                                                         window_bytes=1 << 20)):
            loss = blocks[1](blocks[0](torch.randn(4, WIDTH))).pow(2).mean()
        NUMPY_NOISE = np.random.Generator(bits(18))
        with pytest.raises(tba.TbaError, match="its first call's search did not find"):
            loss.backward()
    finally:
        NUMPY_NOISE = kept
