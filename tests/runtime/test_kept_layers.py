"""Plans that keep some layers: backward reads an offloaded layer only once it gets near it, and the
idle read buffers do not sit through forward, and the reads reuse what the kept layers free (Notes
[Backward through kept layers] in ``tba/runtime/_prefetch.py``, [Idle read buffers and kept layers]
in ``tba/policy/_memory.py`` and [Reads reuse what kept layers free] in ``tba/io/_read_pool.py``)."""

from __future__ import annotations

import time

import torch
from torch import nn

import tba

MIB = 1 << 20
CODES = {"O": "offload", "K": "keep", "R": "recompute"}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(256, 256)
        self.outer = nn.Linear(256, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Saves its input (which the layer below, or the caller, holds anyway) and tanh's 256 KiB
        # output, which only autograd holds: the one storage of the layer that is read back.
        return self.outer(torch.tanh(self.inner(x)))


def model_and_input() -> tuple[nn.Sequential, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Sequential(*[Block() for _ in range(3)]), torch.randn(256, 256)


def grads_without_tba(steps: int = 2) -> list[torch.Tensor]:
    model, x = model_and_input()
    for _ in range(steps):
        model(x).square().sum().backward()
    return [p.grad for p in model.parameters()]


def test_an_offloaded_layer_under_kept_ones_is_read_when_backward_reaches_the_layer_above(tmp_path):
    model, x = model_and_input()
    plan = tba.Plan(tuple(CODES[c] for c in "OKK"), window_bytes=64 * MIB)
    offloader = tba.Offloader(str(tmp_path), layers=list(model), policy=plan)
    try:
        for _ in range(2):
            with offloader:
                loss = model(x).square().sum()
                offloader.flush()  # every write done: a read at the end of forward would start at once
            time.sleep(0.2)
            written, read = offloader.stats.bytes_written, offloader.stats.bytes_read
            assert written > 0
            assert read == 0, "layer 0 was read back before backward reached layer 1"
            loss.backward()
            assert offloader.stats.bytes_read == 256 * 256 * 4
            offloader.reset_stats()
    finally:
        offloader.close()
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads_without_tba()))


def test_a_recomputed_layer_tells_backward_where_it_is(tmp_path):
    """Plan ORK: the recomputed layer's inputs never reach tba's unpack; its recomputation starts the read of
    layer 0, which is done by the time the gradient reaches layer 0's output."""
    model, x = model_and_input()
    plan = tba.Plan(tuple(CODES[c] for c in "ORK"), window_bytes=64 * MIB)
    offloader = tba.Offloader(str(tmp_path), layers=list(model), policy=plan)
    read_then = []

    def at_layer_0_output(grad: torch.Tensor) -> None:
        # Waits for the read rather than a fixed time (a loaded machine can take longer): without the
        # recomputation's signal no read starts before layer 0's own unpack, which comes after this hook.
        deadline = time.monotonic() + 10.0
        while offloader.stats.bytes_read == 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        read_then.append(offloader.stats.bytes_read)

    try:
        with offloader:
            h = model[0](x)
            h.register_hook(at_layer_0_output)
            loss = model[2](model[1](h)).square().sum()
            offloader.flush()
        time.sleep(0.2)
        assert offloader.stats.bytes_read == 0
        loss.backward()
        assert read_then == [256 * 256 * 4]
    finally:
        offloader.close()
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads_without_tba(steps=1)))


def test_a_plan_that_keeps_a_layer_frees_the_idle_read_buffers_before_forward(tmp_path):
    idle = {}
    for code in ("OKK", "OOO"):
        model, x = model_and_input()
        plan = tba.Plan(tuple(CODES[c] for c in code), window_bytes=64 * MIB)
        offloader = tba.Offloader(str(tmp_path / code), layers=list(model), policy=plan)
        try:
            for _ in range(2):
                with offloader:
                    idle.setdefault(code, []).append(offloader.pool_idle_bytes)
                    loss = model(x).square().sum()
                    offloader.flush()  # written: backward reads layer 0 back into a pooled buffer
                loss.backward()
                del loss
                offloader.flush()  # the read buffers backward dropped are back in the pool
                assert offloader.pool_idle_bytes > 0
        finally:
            offloader.close()
        assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads_without_tba()))
    assert idle["OKK"] == [0, 0]
    assert idle["OOO"][0] == 0 and idle["OOO"][1] > 0  # kept for the next backward's reads
    huge = {}
    for code in ("OKK", "OOO"):
        model, x = model_and_input()
        with tba.Offloader(str(tmp_path / f"huge-{code}"), layers=list(model),
                           policy=tba.Plan(tuple(CODES[c] for c in code), window_bytes=64 * MIB)) as offloader:
            huge[code] = offloader._store.read_pool.huge_pages
            model(x).sum().backward()
        offloader.close()
    assert huge == {"OKK": False, "OOO": True}
