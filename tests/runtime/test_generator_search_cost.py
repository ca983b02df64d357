"""The generator search of a recomputed layer skips a container of plain values, tensors and arrays after one pass over
their types, at C speed (Note [The generator search skips containers of plain values] in tba/runtime/_plain_containers.py):
a metrics list in a config every block holds was walked item by item at every call, 100,000 floats making a step of
8 recomputed blocks 8x slower. Counted in calls of the search, not timed."""

from __future__ import annotations

import dataclasses
import sys
import types
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from tba.runtime._generators import generator_states


class Config:
    """A config the blocks share, with histories that grow every step and a vocabulary."""

    def __init__(self, size: int) -> None:
        self.history = [float(i) for i in range(size)]
        self.losses = [(i, float(i)) for i in range(size)]
        self.vocabulary = {f"token{i}": i for i in range(size)}
        self.cache = [torch.zeros(1) for _ in range(64)] + [np.zeros(1), None, "name"]
        self.rng = torch.Generator().manual_seed(1)
        self.mixed = [0.5] * size + [torch.Generator().manual_seed(2)]
        self.paired = [(0, 0.5), (1, torch.Generator().manual_seed(3))]


class Block(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.config = config


def test_containers_of_plain_values_are_not_walked_item_by_item(search_calls):
    config = Config(2_000)
    states = generator_states(Block(config), (torch.zeros(4), list(range(2_000))), {"scale": (1.0,) * 2_000})
    found = (config.rng, config.mixed[-1], config.paired[1][1])
    assert all(id(generator) in states for generator in found), "a generator beside plain values is still found"
    assert search_calls[0] < 2_000 + 100, f"{search_calls[0]} calls of the search: containers of plain values walked item by item"


VOCABULARY = {f"token{i}": [i, i + 1] for i in range(2_000)}
"""A module-level table a forward names (Note [Generators a layer's code names]): a dict of lists."""

ROWS = [{"id": i, "weight": 0.5} for i in range(2_000)]
TABLE = [[float(i)] for i in range(2_000)]
NESTED = {"plain": [[1, 2]] * 2_000, "noise": [[torch.Generator().manual_seed(4)]]}


class Lookup(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = len(VOCABULARY) + len(ROWS) + len(TABLE)
        return self.linear(x) * scale * torch.rand(x.shape, generator=NESTED["noise"][0][0])


def test_containers_of_containers_of_plain_values_are_not_walked_item_by_item(search_calls):
    """A module-level vocabulary of lists, a list of dicts or of lists, that a forward names: each inner container was
    one call of the search at every call of the layer, 100,000 of them made each call 126 ms."""
    states = generator_states(Lookup())
    assert id(NESTED["noise"][0][0]) in states, "a generator nested beside containers of plain values is still found"
    assert search_calls[0] < 100, (f"{search_calls[0]} calls of the search: containers of containers of plain values "
                                   "walked one by one")


noise_lib = types.ModuleType("tba_test_search_noise_lib")
noise_lib.G = torch.Generator().manual_seed(5)
sys.modules[noise_lib.__name__] = noise_lib
BACKENDS = types.SimpleNamespace(torch=torch, np=np, noise=noise_lib)
"""A module-level config holding modules, which a forward names."""


class Backend(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return BACKENDS.torch.tanh(x) * torch.rand(x.shape, generator=BACKENDS.noise.G)


def test_a_module_held_as_a_value_is_not_walked_as_a_plain_object(search_calls):
    """torch held by a config a forward names was searched as a plain object: its 2,000 attributes and their
    submodules', 11,000 calls of the search (60 ms) at every call of the layer, and the deprecated ones it touched
    warned (``torch.distributed.reduce_op``), an error out of the layer's forward under ``-W error``. A module is
    searched for the generators it holds itself, one of torch, numpy or the standard library not at all."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        states = generator_states(Backend())
    assert id(noise_lib.G) in states, "a generator a module held as a value holds is still found"
    assert search_calls[0] < 100, f"{search_calls[0]} calls of the search: a module held as a value walked as a plain object"


@dataclasses.dataclass
class Token:
    id: int
    text: str
    counts: list


TOKENS = [Token(i, str(i), [i]) for i in range(2_000)]
"""A module-level table of plain objects (dataclass rows) a forward names."""

NOISY_ROWS = [Token(0, "a", [0])] * 2_000 + [Token(1, "b", [torch.Generator().manual_seed(6)])]


class Rows(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * len(TOKENS) * torch.rand(x.shape, generator=NOISY_ROWS[-1].counts[0])


def test_containers_of_plain_objects_of_plain_values_are_not_walked_item_by_item(search_calls):
    """100,000 dataclass rows in a list a forward names were 300,000 calls of the search (360 ms) at every call of the
    layer: rows whose fields are plain values or containers of them are skipped after a pass over each level's types."""
    states = generator_states(Rows())
    assert id(NOISY_ROWS[-1].counts[0]) in states, "a generator a row holds is still found"
    assert search_calls[0] < 2_000 + 100, (f"{search_calls[0]} calls of the search: plain objects of plain values walked "
                                           "one by one")


def test_a_value_is_told_a_generator_by_its_type_not_by_torchs_instance_check(monkeypatch):
    """Note [A generator is told by its type] in tba/runtime/_code_named.py: ``isinstance(value, torch.Generator)`` runs
    torch's metaclass in Python (0.5 us), once per value the search met: most of a recomputed block's search."""
    meta = type(torch.Generator)
    if "__instancecheck__" not in vars(meta):
        pytest.skip("this torch's Generator answers isinstance in C")
    calls = []
    check = vars(meta)["__instancecheck__"]

    def counted(cls, instance):
        calls.append(type(instance))
        return check(cls, instance)

    monkeypatch.setattr(meta, "__instancecheck__", counted)
    block = Block(Config(10))
    block.extra = [{"a": [1.5, object()], "b": (types.SimpleNamespace(x=[2, 3]),)} for _ in range(50)]
    states = generator_states(block, (torch.randn(2, 4),), {})
    assert sum(isinstance(generator, torch.Generator) for generator, _ in states.values()) == 3  # rng, mixed, paired
    assert len(calls) <= 5, f"{len(calls)} isinstance checks through torch.Generator's metaclass"
