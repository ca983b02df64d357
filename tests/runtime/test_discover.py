"""Layers found during forward when ``layers=`` is left out; an explicit ``layers=`` wins."""

from __future__ import annotations

import torch
from torch import nn

import tba
from tba.bench.models import PRESETS, make_batch, make_gpt
from tests.utils import run_step


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


def sequential(blocks: int = 4, width: int = 64) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[Block(width) for _ in range(blocks)])


def _tags(off) -> list[int | None]:
    return sorted({entry.layer for entry in off._store.window._order}, key=lambda t: -1 if t is None else t)


def test_finds_the_blocks_of_the_gpt_and_tags_storages_by_block(spill_dir, backend):
    config = PRESETS["tiny"]
    model = make_gpt(config)
    tokens, targets = make_batch(config)
    off = tba.offload_activations(spill_dir, backend=backend, min_offload_bytes=0)
    ref_loss, ref_grads = run_step(model, lambda m: m(tokens, targets))
    loss, grads = run_step(model, lambda m: m(tokens, targets), off)
    assert off.discovered_layers == list(model.blocks)
    assert torch.equal(loss, ref_loss) and all(torch.equal(grads[k], ref_grads[k]) for k in ref_grads)


def test_finds_identical_blocks_of_a_sequential_and_prefetches_by_layer(spill_dir, backend):
    model = sequential()
    x = torch.randn(32, 64)
    off = tba.offload_activations(spill_dir, backend=backend, min_offload_bytes=0)
    with off:
        out = model(x.requires_grad_())
        off.flush()  # the deferred saves have run
        assert _tags(off) == [None], "tags are known only once forward ends"
    assert off.discovered_layers == list(model)
    assert _tags(off) == [0, 1, 2, 3]
    out.sum().backward()


def test_explicit_layers_win(spill_dir):
    model = sequential()
    off = tba.offload_activations(spill_dir, backend="threads", min_offload_bytes=0, layers=[model[1], model[3]])
    with off:
        out = model(torch.randn(32, 64, requires_grad=True))
    assert off.discovered_layers == []
    assert {entry.layer for entry in off._store.window._order} >= {0, 1}
    out.sum().backward()


def test_no_repeated_blocks_leaves_storages_untagged(spill_dir):
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Tanh())
    off = tba.offload_activations(spill_dir, backend="threads", min_offload_bytes=0)
    with off:
        out = model(torch.randn(32, 64, requires_grad=True))
    assert off.discovered_layers == []
    assert {entry.layer for entry in off._store.window._order} == {None}
    out.sum().backward()


def test_blocks_called_in_a_plain_loop_are_found(spill_dir):
    blocks = list(sequential(3))
    off = tba.offload_activations(spill_dir, backend="threads", min_offload_bytes=0)
    x = torch.randn(32, 64, requires_grad=True)
    with off:
        for block in blocks:
            x = block(x)
    assert off.discovered_layers == blocks
    x.sum().backward()


class Mixer(nn.Module):
    """A second kind of block (norm, linear, tanh), unlike ``Block``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mix = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.mix(self.norm(x)))


class Stack(nn.Module):
    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def hybrid(pairs: int = 3, width: int = 64) -> Stack:
    """Mixer and MLP blocks alternating in one list, as hybrid models (Jamba-like) lay them out."""
    torch.manual_seed(0)
    return Stack([m for _ in range(pairs) for m in (Mixer(width), Block(width))])


class EncoderDecoder(nn.Module):
    """Two stacks of one class, each of its own kind of block, as T5's encoder and decoder are."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = Stack([Block(width) for _ in range(3)])
        self.decoder = Stack([Mixer(width) for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.encoder(x))


def test_two_kinds_of_blocks_in_one_list_are_all_layers_in_forward_order(spill_dir, backend):
    model = hybrid()
    x = torch.randn(32, 64)
    off = tba.offload_activations(spill_dir, backend=backend, min_offload_bytes=0)
    ref_loss, ref_grads = run_step(model, lambda m: m(x).pow(2).sum())
    model.zero_grad(set_to_none=True)
    with off:
        out = model(x).pow(2).sum()
    assert off.discovered_layers == list(model.blocks)
    assert _tags(off)[-len(model.blocks):] == list(range(len(model.blocks)))
    out.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    assert torch.equal(out, ref_loss) and all(torch.equal(grads[k], ref_grads[k]) for k in ref_grads)


def test_encoder_and_decoder_blocks_are_both_found(spill_dir):
    model = EncoderDecoder()
    off = tba.offload_activations(spill_dir, backend="threads", min_offload_bytes=0)
    with off:
        out = model(torch.randn(32, 64, requires_grad=True))
    assert off.discovered_layers == [*model.encoder.blocks, *model.decoder.blocks]
    assert _tags(off) == [0, 1, 2, 3, 4]
    out.sum().backward()
