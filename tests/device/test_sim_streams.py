"""User streams around forward and backward on the simulated device: exact, and no race.

``with torch.cuda.stream(s):`` around forward or backward runs the model's kernels on ``s``; the
simulator runs them on the host at once, after what is queued on ``s`` (Note [A kernel on a side
stream runs after that stream's queue] in ``tba/device/sim/_compute.py``). Before that, an
operator on ``s`` ran before the ``wait_event`` tba had queued there for a read's copies, and read
bytes no copy had written yet: wrong gradients and an out-of-bounds gather, where a GPU is exact.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from model_cases import SharedStorage, ViewsModel
from torch import nn
from utils import run_step, steps_equal

import tba
from tba.device.sim import fake_kvikio

BLOCK = 8192
OPTIONS = dict(min_offload_bytes=0, block_size_bytes=BLOCK, staging_bytes=4 * BLOCK)


def wait_stream(sim, waiter, on):
    """``waiter.wait_stream(on)``."""
    event = sim.Event()
    event.record(on)
    waiter.wait_event(event)


@contextlib.contextmanager
def on_stream(sim, stream):
    """``with torch.cuda.stream(stream):``, ordered after and before the current stream as a program must."""
    current = sim.current_stream()
    if stream is None:
        yield
        return
    wait_stream(sim, stream, current)
    with sim.stream(stream):
        yield
    wait_stream(sim, current, stream)


def step(sim, model, forward, offloader, forward_stream, backward_stream, passes):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1234)
    with offloader:
        with on_stream(sim, forward_stream):
            loss = forward(model)
        offloader.flush()  # backward reads every storage back
    with on_stream(sim, backward_stream):
        for index in range(passes):
            loss.backward(retain_graph=index + 1 < passes)
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def models():
    torch.manual_seed(0)
    views, shared = ViewsModel(), SharedStorage()
    x = torch.randn(64, 48, generator=torch.Generator().manual_seed(3))
    y = torch.randn(32, 128, generator=torch.Generator().manual_seed(4))
    return {"views": (views, lambda m: m(x)), "shared": (shared, lambda m: m(y))}


@pytest.mark.parametrize("backend", ["threads", "kvikio"])
@pytest.mark.parametrize("streams", ["forward", "both", "backward", "forward-other-backward"])
@pytest.mark.parametrize("passes", [1, 2])
def test_user_streams_around_forward_and_backward_are_exact(sim, tmp_path, backend, streams, passes):
    side, other = sim.Stream(), sim.Stream()
    forward_stream = side if streams in ("forward", "both", "forward-other-backward") else None
    backward_stream = {"both": side, "backward": other, "forward-other-backward": other}.get(streams)
    kvikio = fake_kvikio(sim) if backend == "kvikio" else contextlib.nullcontext()
    with kvikio:
        for name, (model, forward) in models().items():
            reference = run_step(model, forward, backward_passes=passes)
            offloader = tba.Offloader(tmp_path / name, backend=backend, **OPTIONS)
            try:
                for _ in range(3):
                    got = step(sim, model, forward, offloader, forward_stream, backward_stream, passes)
                    assert steps_equal(reference, got), f"{name} differs from keep-all"
                assert offloader.stats.bytes_written > 0
            finally:
                offloader.close()


def test_a_read_allocated_before_the_compute_stream_moved_is_recorded_on_its_consumer(sim, tmp_path):
    """Note [A read buffer's own stream] in tba/device/_cuda_ops.py.

    Two micro-batches, the model under a side stream and the first loss on the default stream:
    the reads prefetched at the end of the first block are allocated on the default stream, the
    second block's packs move ``compute_stream`` to the side stream, and backward (under the side
    stream) consumes those buffers there. Without a ``record_stream`` they went back to the default
    stream's pool when freed while the side stream still read them.
    """
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(4)])
    xa, xc = torch.randn(32, 64), torch.randn(32, 64)
    (net(xa).pow(2).sum() + net(xc).pow(2).sum()).backward()
    reference = {name: p.grad.clone() for name, p in net.named_parameters()}
    net.zero_grad(set_to_none=True)
    side = sim.Stream()
    offloader = tba.Offloader(tmp_path, block_size_bytes=BLOCK, staging_bytes=8 * BLOCK, min_offload_bytes=0)
    try:
        with offloader:
            with on_stream(sim, side):
                h = net(xa)
            first = h.pow(2).sum()  # saved on the default stream
            offloader.flush()
        # The route allocates each read's buffer on its own thread, on the compute stream of that moment: wait for
        # the reads the end of forward started, or on a loaded machine they were allocated after the second block
        # had moved the compute stream (the assert below failed, 'nothing was prefetched', in a full run with -n 2).
        store = offloader._store
        store._wait_until(lambda: store._reading == 0)
        assert sim.allocator.allocations_by_stream.get(sim.default_stream.name, 0) > 0, "nothing was prefetched"
        with offloader, on_stream(sim, side):
            second = net(xc).pow(2).sum()
        with on_stream(sim, side):
            (first + second).backward()
        assert all(torch.equal(reference[name], p.grad) for name, p in net.named_parameters())
    finally:
        offloader.close()
