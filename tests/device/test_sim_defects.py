"""The CUDA defects of issue 22, each shown on the simulated device (tba/device/sim) and fixed.

Each test failed on the code before its fix; docs/gpu.md lists the failures.
"""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch
from model_cases import tiny_gpt
from sim_helpers import CheckedEngine
from utils import run_step, steps_equal

import tba
from tba.bench.models import PRESETS
from tba.device import CudaOps, gds_unavailable_reason
from tba.device.sim import fake_kvikio
from tba.errors import TbaReadError

BLOCK = 8192
SMALL = dict(min_offload_bytes=0, block_size_bytes=BLOCK, staging_bytes=8 * BLOCK)


def test_1_auto_backend_finds_gds_with_the_current_kvikio_api(sim):
    with fake_kvikio(sim, gds=True):
        assert gds_unavailable_reason() is None
    with fake_kvikio(sim, gds=False):
        assert "GDS" in gds_unavailable_reason() or "compatibility" in gds_unavailable_reason()


def test_2_a_raising_completion_callback_does_not_stop_later_completions(sim):
    ops = CudaOps(torch.device("cpu"))
    reached = threading.Event()

    def boom(error):
        raise RuntimeError("callback failed")

    try:
        ops.when_done(ops.mark_ready(), boom)
        ops.when_done(ops.mark_ready(), lambda error: reached.set())
        assert reached.wait(5), "the waiter thread died with the first callback's exception"
    finally:
        ops.close()


def test_2_close_after_a_forward_that_raised_with_copies_still_queued(sim, tmp_path):
    model, forward = tiny_gpt()
    offloader = tba.Offloader(tmp_path, backend="threads", layers=model, **SMALL)
    sim.stall()
    threading.Timer(0.5, sim.stall, args=(False,)).start()
    with pytest.raises(ValueError):
        with offloader:
            forward(model)
            routes = offloader._store.routes
            raise ValueError("forward failed")
    offloader.close()
    pool = routes.staging_pool
    assert pool.free_blocks == pool.capacity_blocks, "a staging block was never returned"


def test_3_waiter_threads_do_not_busy_wait(sim, tmp_path):
    model, forward = tiny_gpt()
    engine = CheckedEngine(sim)
    offloader = tba.Offloader(tmp_path, backend=engine, layers=model, **SMALL)
    run_step(model, forward, offloader)
    offloader.close()
    engine.close()
    assert sim.busy_wait_syncs == 0, f"{sim.busy_wait_syncs} event synchronize calls spun a CPU core"


def test_4_staging_pool_is_pinned_exactly_and_before_the_first_pack(sim, tmp_path):
    model, forward = tiny_gpt()
    engine = CheckedEngine(sim)
    offloader = tba.Offloader(tmp_path, backend=engine, layers=model, **SMALL)
    with offloader:
        pinned_at_entry = sim.pinned.pinned_bytes
        loss = forward(model)
    loss.backward()
    offloader.close()
    engine.close()
    assert pinned_at_entry == 8 * BLOCK, f"{pinned_at_entry} bytes pinned before the first pack"
    assert sim.pinned.peak_pinned_bytes == 8 * BLOCK, f"{sim.pinned.peak_pinned_bytes} bytes pinned for a pool of {8 * BLOCK}"
    assert sim.pinned.pinned_bytes == 0, "the staging slab stays pinned after close"


def test_5_read_back_tensors_come_from_the_compute_streams_pool(sim, tmp_path):
    model, forward = tiny_gpt()
    engine = CheckedEngine(sim)
    offloader = tba.Offloader(tmp_path, backend=engine, layers=model, **SMALL)
    reference = run_step(model, forward)
    assert steps_equal(reference, run_step(model, forward, offloader))
    assert offloader.stats.bytes_read > 0
    offloader.close()
    engine.close()
    assert set(sim.allocator.allocations_by_stream) == {sim.default_stream.name}, sim.allocator.allocations_by_stream
    assert sim.allocator.record_stream_calls == 0


def test_6_tensors_saved_during_graph_capture_stay_in_memory(sim, tmp_path):
    model, forward = tiny_gpt()
    engine = CheckedEngine(sim)
    offloader = tba.Offloader(tmp_path, backend=engine, layers=model, **SMALL)
    with sim.graph_capture(), offloader:
        loss = forward(model)
    loss.backward()
    offloader.close()
    engine.close()
    stats = offloader.stats
    assert stats.tensors_offloaded == 0 and stats.bytes_written == 0
    assert stats.kept_by_reason.get("CUDA graph capture", 0) > 0, stats.kept_by_reason


def test_7_kvikio_reads_do_not_queue_behind_writes(sim, tmp_path):
    model, forward = tiny_gpt()
    with fake_kvikio(sim, gds=True) as kvikio:
        offloader = tba.Offloader(tmp_path, backend="kvikio", layers=model, **SMALL)
        with offloader:
            x = torch.randn(4096)
            first = offloader.pack(x * 2)
            offloader.flush()
            kvikio.write_gate = threading.Event()
            threading.Timer(5, kvikio.write_gate.set).start()  # bounds the test where reads do queue behind writes
            second = offloader.pack(x * 3)
            started = time.monotonic()
            got = offloader.unpack(first)
            waited = time.monotonic() - started
            kvikio.write_gate.set()
            assert torch.equal(got, x * 2)
            assert offloader.unpack(second) is not None
        assert kvikio.settings["num_threads"] > 1 and kvikio.settings["task_size"] >= 8 << 20
        offloader.close()
    assert waited < 2


def test_9_tensor_subclasses_are_kept_with_a_warning(sim, tmp_path, caplog):
    class Scaled(torch.Tensor):
        pass

    engine = CheckedEngine(sim)
    offloader = tba.Offloader(tmp_path, backend=engine, **SMALL)
    x = torch.randn(64, 64).as_subclass(Scaled).requires_grad_()
    with caplog.at_level(logging.WARNING, logger="tba"), offloader:
        loss = (x * x).sum()
    loss.backward()
    offloader.close()
    engine.close()
    assert offloader.stats.kept_by_reason.get("tensor subclass", 0) > 0
    assert any("Scaled" in record.getMessage() for record in caplog.records), caplog.text


def test_10_kvikio_read_errors_are_tba_read_errors(sim, tmp_path):
    with fake_kvikio(sim, gds=True) as kvikio:
        offloader = tba.Offloader(tmp_path, backend="kvikio", **SMALL)
        with offloader:
            packed = offloader.pack(torch.randn(4096) * 2)
            offloader.flush()
            kvikio.fail_reads = RuntimeError("cuFile error: Input/output error")
            with pytest.raises(TbaReadError, match="cuFile"):
                offloader.unpack(packed)
        offloader.close()


def test_staged_route_holds_the_source_until_its_copy_ran(sim, tmp_path):
    model, forward = tiny_gpt()
    engine = CheckedEngine(sim)
    offloader = tba.Offloader(tmp_path, backend=engine, layers=model, **SMALL)
    reference = run_step(model, forward)
    for _ in range(3):
        assert steps_equal(reference, run_step(model, forward, offloader, flush=False))
    offloader.close()
    engine.close()




def test_8_bench_step_time_waits_for_the_device(sim, tmp_path, monkeypatch):
    from tba.bench.harness import run_mode

    synchronize = sim.synchronize

    def slow_device(device=None):
        time.sleep(1.0)
        synchronize(device)

    monkeypatch.setattr(sim, "synchronize", slow_device)
    result = run_mode("tba", PRESETS["tiny"], steps=1, warmup=1, directory=str(tmp_path))
    assert min(result.step_s) >= 1.0, f"step time {result.step_s} was read before the device finished"
    assert result.pinned_bytes > 0, "pinned bytes are not reported"
