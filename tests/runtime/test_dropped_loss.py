"""A forward whose loss is dropped without backward leaks nothing: no file space, no descriptor."""

from __future__ import annotations

import torch
from torch import nn

import tba
from tba._control import settle


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(256, 256), nn.GELU()) for _ in range(4)))


def test_reusable_offloader_reuses_space_after_dropped_losses(spill_dir, backend, no_gc):
    model = make_model()
    x = torch.randn(512, 256)
    off = tba.Offloader(spill_dir, backend=backend, layers=list(model))
    store = off._store
    sizes, saved = [], []
    for _ in range(4):
        offloaded = off.stats.tensors_offloaded
        with off:
            loss = model(x).logsumexp(-1).mean()
        del loss
        off.flush()
        # flush() waits for writes only: the reads that exit started ahead of backward hold their
        # extents until they end, and a step started before that grew the file past them (beside a
        # CPU hog, or with reads heard 0.3 s late: every time). Their end frees the space.
        store._wait_until(lambda: store._reading == 0)
        assert store.live_entries == 0 and not off.spill._allocator.in_use
        sizes.append(off.spill.size_bytes)
        saved.append(off.stats.tensors_offloaded - offloaded)
    # An extent keeps its storage's address modulo 4096, so a step whose tensors landed at other
    # addresses may need one page more per storage (a step saves at most ``saved`` storages; the plan
    # may keep layers, so fewer are written); a leak would grow the file by a whole step.
    assert sizes[-1] - sizes[0] <= 4096 * max(saved), (sizes, saved)
    off.close()


def test_one_shot_context_closes_its_file_after_dropped_loss(spill_dir, backend, open_fds, no_gc):
    model = make_model()
    x = torch.randn(512, 256)
    before = open_fds()
    for _ in range(3):
        with tba.offload_activations(spill_dir, backend=backend) as off:
            loss = model(x).logsumexp(-1).mean()
        del loss
        settle()
        assert off._runtime is None, "the context did not give its file back after its loss was dropped"
    tba.shutdown()
    assert off.spill.closed and open_fds() == before


def test_reusable_offloader_reclaims_leftovers_on_entry(spill_dir, backend, no_gc):
    """A cycle made by user code keeps a dropped graph alive; entering again collects it."""
    model = make_model()
    x = torch.randn(512, 256)
    off = tba.Offloader(spill_dir, backend=backend, layers=list(model))
    for _ in range(3):
        with off:
            out = model(x)
            loss = out.logsumexp(-1).mean()
        holder: dict = {"loss": loss}
        holder["self"] = holder
        del holder, loss, out
        off.flush()
    with off:
        pass
    assert off._store.live_entries == 0
    off.close()


def test_dropped_then_trained_steps_are_exact(spill_dir, backend):
    model = make_model()
    x = torch.randn(512, 256)
    model(x).logsumexp(-1).mean().backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    off = tba.Offloader(spill_dir, backend=backend, layers=list(model))
    for step in range(3):
        with off:
            loss = model(x).logsumexp(-1).mean()
        if step != 1:
            continue
        loss.backward()
    assert all(torch.equal(p.grad, w) for p, w in zip(model.parameters(), want))
    off.close()
