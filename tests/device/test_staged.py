"""The staged route (device -> staging block -> file and back), driven on CPU by an asynchronous fake device."""

from __future__ import annotations

import errno
import logging
import threading

import pytest
import torch
from torch import nn
from utils import FakeDeviceOps, FaultyEngine, assert_exact, backward_twice_past_held_writes

import tba
from tba import _control
from tba.bench.models import PRESETS, make_batch, make_gpt
from tba.device import Routes
from tba.device._pinned_pool import StagingPool
from tba.errors import TbaConfigError, TbaReadError

BLOCK_BYTES = 8192


def staged_options(ops: FakeDeviceOps, staging_blocks: int = 64) -> dict:
    return dict(_device_ops=ops, _staged_devices=("cpu",), block_size_bytes=BLOCK_BYTES,
                staging_bytes=staging_blocks * BLOCK_BYTES)


@pytest.mark.parametrize("staging_blocks", [1, 64], ids=["one-block", "many-blocks"])
@pytest.mark.parametrize("flush", [True, False], ids=["written-first", "racing-writes"])
def test_gpt_through_the_staged_route_is_exact(spill_dir, backend, staging_blocks, flush):
    config = PRESETS["tiny"]
    model = make_gpt(config)
    tokens, targets = make_batch(config)
    ops = FakeDeviceOps()
    calls = []

    def forward(m):
        # The second call runs under tba. Racing writes may all be skipped once backward has used
        # their storages, so backward starts only after one device copy has begun; the rest still race.
        calls.append(None)
        loss = m(tokens, targets)
        if len(calls) == 2:
            assert ops.wait_for("d2h", timeout_s=60.0), "no staged write started within 60 s"
        return loss

    offloader = assert_exact(model, forward, spill_dir, backend, layers=model,
                             flush=flush, **staged_options(ops, staging_blocks))
    assert offloader.stats.tensors_offloaded > 10
    assert "d2h" in ops.log
    if flush:
        assert "h2d" in ops.log and offloader.stats.bytes_read > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int64, torch.bool])
def test_views_and_dtypes_round_trip(spill_dir, dtype):
    ops = FakeDeviceOps()
    base = (torch.randn(300, 70) * 50).to(dtype)
    views = [base, base.t(), base[7:, 3:], base.view(-1)[5:4000]]
    with tba.Offloader(spill_dir, backend="threads", min_offload_bytes=0, **staged_options(ops, 4)) as off:
        packed = [off.pack(v) for v in views]
        off.flush()
        for view, p in zip(views, packed):
            got = off.unpack(p)
            assert got.stride() == view.stride() and got.storage_offset() == view.storage_offset()
            assert torch.equal(got, view)
    assert off.stats.storages_written == 1
    del packed
    off.close()


def test_copy_waits_for_the_producer_and_memory_waits_for_the_write(spill_dir):
    producer = threading.Event()
    write_gate = threading.Event()
    ops = FakeDeviceOps(producer_gate=producer)
    engine = FaultyEngine(gate=write_gate)
    x = torch.randn(10_000)
    with tba.Offloader(spill_dir, backend=engine, min_offload_bytes=0, **staged_options(ops)) as off:
        packed = off.pack(x)
        _control.settle()  # the deferred save has run (Note [A device save is deferred too])
        off._store.routes.for_device(x.device).drain()
        assert ops.log == [], "a device-to-host copy started before the producer's event"
        producer.set()
        while ops.log.count("d2h") < 5:
            threading.Event().wait(0.01)
        assert off.stats.resident_bytes == x.nbytes, "device memory was released before the write completed"
        write_gate.set()
        off.flush()
        assert off.stats.resident_bytes == 0 and off.stats.storages_written == 1
        got = off.unpack(packed)
        assert torch.equal(got, x)
        assert len(ops.consumed) == 1 and ops.consumed[0].done()
    del packed, got
    off.close()
    engine.close()


def test_write_failure_keeps_the_storage_and_read_failure_is_loud(spill_dir, caplog):
    ops = FakeDeviceOps()
    x = torch.randn(5000)
    full = FaultyEngine(write_errno=errno.ENOSPC)
    with tba.Offloader(spill_dir, backend=full, min_offload_bytes=0, **staged_options(ops)) as off:
        packed = off.pack(x)
        off.flush()
        assert off.stats.tensors_kept_on_error == 1
        assert torch.equal(off.unpack(packed), x)
    del packed
    off.close()
    broken = FaultyEngine(read_errno=errno.EIO)
    with tba.Offloader(spill_dir, backend=broken, min_offload_bytes=0, **staged_options(FakeDeviceOps())) as off:
        packed = off.pack(x)
        off.flush()
        with pytest.raises(TbaReadError, match="offset"):
            off.unpack(packed)
    del packed
    off.close()
    full.close()
    broken.close()


def test_staging_pool_blocks_are_aligned_and_acquire_waits():
    pool = StagingPool(capacity_bytes=3 * BLOCK_BYTES, block_bytes=BLOCK_BYTES, pinned=False)
    blocks = [pool.acquire() for _ in range(3)]
    assert all(b.data_ptr() % 4096 == 0 and b.numel() == BLOCK_BYTES for b in blocks)
    assert len({b.data_ptr() for b in blocks}) == 3 and pool.free_blocks == 0
    got = []
    waiter = threading.Thread(target=lambda: got.append(pool.acquire()))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive() and not got
    pool.release(blocks[1])
    waiter.join(5)
    assert got[0].data_ptr() == blocks[1].data_ptr() and pool.waits == 1


@pytest.mark.parametrize("capacity, block", [(4096, 8192), (65536, 1000)])
def test_staging_pool_bad_sizes(capacity, block):
    with pytest.raises(TbaConfigError):
        StagingPool(capacity_bytes=capacity, block_bytes=block, pinned=False)


def test_kvikio_backend_without_kvikio_or_cuda_is_a_clear_error(spill_dir):
    from tba.device._router import kvikio_unavailable_reason

    if kvikio_unavailable_reason() is None:
        pytest.skip("kvikio and CUDA are available here")
    with pytest.raises(TbaConfigError, match="backend 'kvikio' is not available: .*use backend='auto'"):
        tba.offload_activations(spill_dir, backend="kvikio")


def test_unsupported_device_is_kept(spill_dir):
    off = tba.Offloader(spill_dir, min_offload_bytes=0)
    assert off.keep_reason(torch.empty(1000, device="meta")) == "not a plain strided tensor"
    module = nn.Linear(2, 2)
    assert off.keep_reason(module.weight) == "parameter"


def test_a_write_that_backward_no_longer_needs_is_not_started(spill_dir):
    """Note [A write nobody needs is not started]: writes still queued when backward has used their storages are skipped."""
    gate = threading.Event()
    engine = FaultyEngine(gate=gate)
    xs = [torch.randn(BLOCK_BYTES // 4, requires_grad=True) for _ in range(12)]
    off = tba.Offloader(spill_dir, backend=engine, min_offload_bytes=0, **staged_options(FakeDeviceOps(), staging_blocks=1))
    # The first write holds the only staging block, so the others are still queued.
    losses = backward_twice_past_held_writes(off, xs, gate, min_skipped=len(xs) - 3)
    assert off.stats.bytes_write_skipped == off.stats.writes_skipped * BLOCK_BYTES
    assert off.stats.storages_written + off.stats.writes_skipped == len(xs)
    del losses
    _control.settle()
    assert off.stats.resident_bytes == 0 and off.stats.staging_blocks_in_use == 0
    off.close()
    engine.close()


def test_a_device_route_that_cannot_be_built_keeps_the_tensor_with_a_warning(spill_dir, monkeypatch, caplog):
    """The first pack on a device has the control thread build its route; a failure there must not reach forward."""
    def cannot_pin(self, device):
        raise RuntimeError("cannot pin staging memory")

    monkeypatch.setattr(Routes, "_make", cannot_pin)
    x = torch.randn(10_000, requires_grad=True)
    with caplog.at_level(logging.WARNING, logger="tba"):
        with tba.Offloader(spill_dir, backend="threads", min_offload_bytes=0, **staged_options(FakeDeviceOps())) as off:
            y = torch.tanh(x)
        y.pow(2).sum().backward()
    want = torch.autograd.grad(torch.tanh(x).pow(2).sum(), x)[0]
    assert torch.equal(x.grad, want)
    assert off.stats.storages_written == 0
    assert any("cannot pin staging memory" in r.getMessage() and "stays in memory" in r.getMessage() for r in caplog.records)
    off.close()


def test_a_staging_slab_the_host_cannot_hold_is_a_config_error_naming_staging_bytes():
    with pytest.raises(TbaConfigError, match="lower staging_bytes"):
        StagingPool(capacity_bytes=1 << 50, block_bytes=4 << 20, pinned=False)
