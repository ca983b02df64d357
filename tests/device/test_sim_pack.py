"""The pack of a device tensor on the simulated device: no hop to the control thread, ordered on the caller's stream.

Note [A device save is deferred too] in ``tba/runtime/_hooks.py``: the pack marks the producer on
the training thread's current stream and defers the save, as the host path does.
"""

from __future__ import annotations

import threading
import time

import torch
from model_cases import tiny_gpt
from sim_helpers import CheckedEngine
from utils import backward_twice_past_held_writes, run_step, steps_equal

import tba
from tba import _control

BLOCK = 8192
SMALL = dict(min_offload_bytes=0, block_size_bytes=BLOCK, staging_bytes=8 * BLOCK)
BLOCKED_S = 10.0
"""How long the control thread stays busy while forward runs; a forward that hops to it waits that long."""


def test_forward_does_not_wait_for_a_busy_control_thread(sim, tmp_path):
    model, forward = tiny_gpt()
    reference = run_step(model, forward)
    started, release = threading.Event(), threading.Event()
    blocker = threading.Thread(target=_control.call, args=(lambda: (started.set(), release.wait(BLOCKED_S)),))
    engine = CheckedEngine(sim)
    off = tba.Offloader(tmp_path, backend=engine, **SMALL)
    run_step(model, forward, off)  # the first pack on a device has the control thread build its route
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1234)
    with off:
        blocker.start()
        assert started.wait(5)
        begin = time.perf_counter()
        loss = forward(model)
        took_s = time.perf_counter() - begin
        release.set()
    blocker.join()
    assert off.stats.tensors_offloaded > 0
    assert took_s < BLOCKED_S / 2, f"forward took {took_s:.1f} s: its packs waited for the busy control thread"
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    assert steps_equal(reference, (loss.detach(), grads))
    off.close()
    engine.close()


def test_forward_on_a_side_stream_is_copied_after_its_kernels(sim, tmp_path):
    """The mark is taken on the caller's stream: a copy ordered on the control thread's stream would race."""
    model, forward = tiny_gpt()
    reference = run_step(model, forward)
    side = sim.Stream()

    def on_side_stream(m):
        before = sim.Event()
        before.record(sim.current_stream())
        side.wait_event(before)  # the side stream reuses memory the compute stream used last step
        with sim.stream(side):
            loss = forward(m)
        done = sim.Event()
        done.record(side)
        sim.current_stream().wait_event(done)
        return loss

    sim.checking_compute = True
    engine = CheckedEngine(sim)
    off = tba.Offloader(tmp_path, backend=engine, **SMALL)
    for _ in range(6):
        assert steps_equal(reference, run_step(model, on_side_stream, off, flush=False))
    assert off.stats.bytes_written > 0
    off.close()
    engine.close()


def test_the_kvikio_route_skips_a_write_that_backward_no_longer_needs(sim, tmp_path, monkeypatch):
    """Note [A write nobody needs is not started] on the kvikio route: its write thread held up, the queued writes are skipped."""
    from tba.device._kvikio import KvikioRoute
    from tba.device.sim import fake_kvikio

    gate = threading.Event()
    opened = KvikioRoute._file

    def held_up(self, fd):  # the write thread waits here, as behind a slow producer on a GPU
        assert gate.wait(10)
        return opened(self, fd)

    xs = [torch.randn(2048, requires_grad=True) for _ in range(12)]
    with fake_kvikio(sim, gds=True):
        monkeypatch.setattr(KvikioRoute, "_file", held_up)
        off = tba.Offloader(tmp_path, backend="kvikio", min_offload_bytes=0, block_size_bytes=BLOCK)
        losses = backward_twice_past_held_writes(off, xs, gate, min_skipped=len(xs) - 1)
        del losses
        off.close()


def test_kvikio_is_handed_few_writes_so_that_queued_ones_can_be_skipped(sim, tmp_path, monkeypatch):
    """Note [kvikio gets writes a few at a time]: with kvikio's transfers held up, the write thread
    hands it one storage's bytes at a time, and the writes that backward made unnecessary are skipped.
    Without the bound every write was already in kvikio's queue (an H200 offload-all step: 18.8 s
    through kvikio against 0.51 s staged)."""
    from tba.device import _kvikio
    from tba.device.sim import fake_kvikio

    monkeypatch.setattr(_kvikio, "KVIKIO_WRITE_BYTES_IN_FLIGHT", 2048 * 4, raising=False)
    xs = [torch.randn(2048, requires_grad=True) for _ in range(12)]
    with fake_kvikio(sim, gds=True) as kvikio:
        kvikio.write_gate = threading.Event()
        off = tba.Offloader(tmp_path, backend="kvikio", min_offload_bytes=0, block_size_bytes=BLOCK,
                            prefetch_budget_bytes=2048 * 4)  # the window would keep these tiny writes in memory
        losses = backward_twice_past_held_writes(off, xs, kvikio.write_gate, min_skipped=len(xs) - 1)
        del losses
        off.close()
