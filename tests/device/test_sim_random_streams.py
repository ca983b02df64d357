"""Randomized steps on the simulated device: user streams around forward and backward, failing writes, tiny pools.

Each step draws the stream of forward and of backward (the default one, or one of two side streams),
whether the writes finish before backward, and a pool of one or three 4 KiB blocks; one write in
seven fails (its storage stays in memory). Side streams lag often. Gradients must equal keep-all,
the race checker stay silent (with Note [A read keeps the write it follows] in
``tba/device/sim/_checker.py``) and no pinned byte stay locked. Found nothing in tba (helper-104).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import random
from concurrent.futures import Future

import pytest
import torch
from sim_helpers import CheckedEngine
from torch import nn
from utils import steps_equal

import tba
from tba.device.sim import fake_kvikio, simulate
from tba.io import Op

STEPS = 5


class FlakyEngine(CheckedEngine):
    """A checked engine whose writes fail now and then."""

    def __init__(self, sim, rng: random.Random, share: float) -> None:
        super().__init__(sim)
        self.rng, self.share, self.failed = rng, share, 0

    def submit_many(self, requests):
        out = []
        for request in requests:
            if request.op is Op.WRITE and self.rng.random() < self.share:
                future: Future = Future()
                future.set_exception(OSError(errno.EIO, "injected write failure"))
                self.failed += 1
                out.append(future)
            else:
                out.extend(super().submit_many([request]))
        return out


def wait_stream(sim, waiter, on) -> None:
    """``waiter.wait_stream(on)``."""
    event = sim.Event()
    event.record(on)
    waiter.wait_event(event)


@contextlib.contextmanager
def on_stream(sim, stream):
    """``with torch.cuda.stream(stream):``, ordered after and before the current stream."""
    if stream is None:
        yield
        return
    current = sim.current_stream()
    wait_stream(sim, stream, current)
    with sim.stream(stream):
        yield
    wait_stream(sim, current, stream)


@pytest.mark.parametrize("seed,backend", [(3, "staged"), (5, "staged"), (1, "kvikio")])
def test_random_streams_and_failing_writes_are_exact(tmp_path, caplog, seed, backend):
    caplog.set_level(logging.ERROR)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    width = rng.choice([8, 16, 40])
    net = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.LayerNorm(width)) for _ in range(4)])
    x = torch.randn(rng.choice([3, 17]), width)

    def step(offloader=None, sim=None, forward_stream=None, backward_stream=None, flush=False):
        net.zero_grad(set_to_none=True)
        with offloader if offloader is not None else contextlib.nullcontext():
            with on_stream(sim, forward_stream):
                loss = net(x).pow(2).sum()
            if offloader is not None and flush:
                offloader.flush()
        with on_stream(sim, backward_stream):
            loss.backward()
        return loss.detach(), {name: p.grad.clone() for name, p in net.named_parameters()}

    reference = step()
    with simulate(seed=seed, lag_probability=0.1, max_lag_s=0.01) as sim:
        streams = [None, sim.Stream(), sim.Stream()]
        with fake_kvikio(sim) if backend == "kvikio" else contextlib.nullcontext():
            engine = FlakyEngine(sim, rng, 1 / 7) if backend == "staged" else "kvikio"
            offloader = tba.Offloader(tmp_path, backend=engine, min_offload_bytes=0, block_size_bytes=4096,
                                      staging_bytes=rng.choice([1, 3]) * 4096)
            try:
                for index in range(STEPS):
                    got = step(offloader, sim, rng.choice(streams), rng.choice(streams), rng.random() < 0.5)
                    assert steps_equal(reference, got), f"step {index} differs from keep-all"
                assert offloader.stats.bytes_written > 0
            finally:
                offloader.close()
                tba.shutdown()
        assert sim.problems() == [], "\n".join(sim.problems())
        assert sim.pinned.pinned_bytes == 0
