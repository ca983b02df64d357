"""Gradients with tba are torch.equal to gradients without it, across models, dtypes and backends."""

from __future__ import annotations

import pytest
import torch
from model_cases import SharedStorage, ViewsModel
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint
from utils import assert_exact

import tba
from tba.bench.models import PRESETS, make_batch, make_gpt


def mlp(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 8)).to(dtype)


def mlp_forward(dtype: torch.dtype = torch.float32):
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(1)).to(dtype)
    return lambda model: model(x).float().square().mean()


def test_mlp(spill_dir, backend):
    offloader = assert_exact(mlp(), mlp_forward(), spill_dir, backend)
    stats = offloader.stats
    assert stats.storages_written > 0 and stats.bytes_read > 0
    assert stats.resident_bytes == 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_mlp_dtypes(spill_dir, backend, dtype):
    offloader = assert_exact(mlp(dtype), mlp_forward(dtype), spill_dir, backend)
    assert offloader.stats.storages_written > 0


@pytest.mark.parametrize("flush", [True, False], ids=["written-first", "racing-writes"])
def test_gpt_block_with_dropout(spill_dir, backend, flush):
    config = PRESETS["tiny"]
    model = make_gpt(config)
    tokens, targets = make_batch(config)
    offloader = assert_exact(model, lambda m: m(tokens, targets), spill_dir, backend, layers=model, flush=flush)
    assert offloader.stats.tensors_offloaded > 10
    if flush:
        assert offloader.stats.storages_written > 10 and offloader.stats.bytes_read > 0


def test_cnn(spill_dir, backend):
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        nn.Flatten(), nn.Linear(32, 10),
    )
    images = torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    labels = torch.arange(8) % 10
    assert_exact(model, lambda m: F.cross_entropy(m(images), labels), spill_dir, backend)


@pytest.mark.parametrize(("make", "shape", "seed"), [(ViewsModel, (64, 48), 3), (SharedStorage, (32, 128), 4)],
                         ids=["views_slices_transposes_inplace", "shared_storages"])
def test_storages_saved_through_several_tensors_are_deduplicated(spill_dir, backend, make, shape, seed):
    torch.manual_seed(0)
    model = make()
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    offloader = assert_exact(model, lambda m: m(x), spill_dir, backend)
    assert offloader.stats.bytes_deduplicated > 0


def test_retain_graph_double_backward(spill_dir, backend):
    offloader = assert_exact(mlp(), mlp_forward(), spill_dir, backend, backward_passes=2)
    assert offloader.stats.bytes_read > 0


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpoint_inside_block(spill_dir, backend, reentrant):
    torch.manual_seed(0)
    blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)) for _ in range(3))
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(5), requires_grad=reentrant)

    def forward(model: nn.Module) -> torch.Tensor:
        h = x
        for index, block in enumerate(model):
            h = checkpoint(block, h, use_reentrant=reentrant) if index == 1 else block(h)
        return h.square().mean()

    assert_exact(blocks, forward, spill_dir, backend)


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool])
def test_integer_and_bool_saved_tensors(spill_dir, backend, dtype):
    torch.manual_seed(0)
    model = nn.Embedding(50, 16)
    indices = torch.randint(50, (64, 33), generator=torch.Generator().manual_seed(6))
    mask = indices % 3 == 0

    def forward(m: nn.Module) -> torch.Tensor:
        emb = m(indices)
        if dtype is torch.bool:
            emb = emb.masked_fill(mask.unsqueeze(-1), 0.0) * torch.where(mask, 2.0, 1.0).unsqueeze(-1)
        else:
            emb = emb * torch.gather(emb, 1, (indices % 16).unsqueeze(1).expand(-1, 33, -1)[:, :, :16])
        return emb.square().sum()

    offloader = assert_exact(model, forward, spill_dir, backend)
    assert offloader.stats.storages_written > 0


def test_non_contiguous_inputs(spill_dir, backend):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(40, 40), nn.Softplus())
    base = torch.randn(40, 120, generator=torch.Generator().manual_seed(7))
    x = base.t()[::3]

    def forward(m: nn.Module) -> torch.Tensor:
        return (m(x) * x[:, ::2].repeat(1, 2)).sum()

    assert not x.is_contiguous()
    assert_exact(model, forward, spill_dir, backend)


def test_pieces_of_one_storage_with_counters_of_their_own(spill_dir, backend):
    """Note [One entry per version counter]: ``unsafe_chunk``'s pieces (an LSTM cell's gates) share a storage but
    not a version counter. The second piece, changed in place after the first one was saved and written, and then
    saved at the same version number on its own counter, gets its own entry: its bytes are the changed ones."""
    torch.manual_seed(0)
    linear = nn.Linear(16, 32)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(8))

    def forward(flush) -> torch.Tensor:
        first, second = linear(x).unsafe_chunk(2, 1)
        first = first.sigmoid_()
        flush()
        second = second.sigmoid_()
        return (first * second).sum()

    want_loss = forward(lambda: None)
    want_loss.backward()
    want = [p.grad.clone() for p in linear.parameters()]
    linear.zero_grad()
    offloader = tba.offload_activations(spill_dir, backend=backend, min_offload_bytes=0, policy="offload")
    with offloader:
        loss = forward(offloader.flush)
    loss.backward()
    assert torch.equal(loss, want_loss)
    assert all(torch.equal(p.grad, g) for p, g in zip(linear.parameters(), want))
    assert offloader.stats.storages_written >= 2


def test_lstm_cell(spill_dir, backend):
    """ATen's LSTM cell changes its gates in place, piece by piece, between saves (Note [One entry per version
    counter])."""
    torch.manual_seed(0)
    cell = nn.LSTMCell(32, 32)
    xs = torch.randn(6, 16, 32, generator=torch.Generator().manual_seed(9))

    def forward(m: nn.Module) -> torch.Tensor:
        h = c = torch.zeros(16, 32)
        for x in xs:
            h, c = m(x, (h, c))
        return h.square().sum()

    assert_exact(cell, forward, spill_dir, backend, flush=False)


def test_a_dead_roots_address_taken_by_another_family_is_not_its_entry(spill_dir, backend):
    """Note [One entry per version counter]: ``a`` (a ``.data`` alias, a counter of its own) is saved, written and
    dropped; ``b``, a new alias of the same storage, often gets ``a``'s freed address and is saved at the same
    version number. Matched by address, ``b`` shared ``a``'s entry and its bytes."""
    x = torch.randn(4096, generator=torch.Generator().manual_seed(10))
    want_first, want_second = 2 * x, 2 * x + 1
    w1, w2 = torch.ones(4096, requires_grad=True), torch.ones(4096, requires_grad=True)
    offloader = tba.offload_activations(spill_dir, backend=backend, min_offload_bytes=0, policy="offload")
    with offloader:
        first = x.data
        first.mul_(2)
        out1 = first * w1
        offloader.flush()
        del first
        second = x.data
        second.add_(1)
        out2 = second * w2
        del second
        offloader.flush()
    del x
    (out1 + out2).sum().backward()
    assert torch.equal(w1.grad, want_first) and torch.equal(w2.grad, want_second)
