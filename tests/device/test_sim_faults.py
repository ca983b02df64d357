"""CUDA calls that fail mid-transfer, on the simulated device (Note [Injected CUDA faults] in tba/device/sim/_faults.py).

A failed call must not hand back memory that copies queued before it still use: not the staging
block (a read group's file read would land under a device-to-host copy still to run), not a
source storage (the caching allocator gives it to the next kernel while the side stream reads it).
"""

from __future__ import annotations

import gc
import os
import threading
from concurrent.futures import Future

import pytest
import torch
from model_cases import tiny_gpt
from sim_helpers import CheckedEngine
from utils import run_step, steps_equal

import tba
from tba.defaults import ALIGN_BYTES
from tba.device import CudaOps
from tba.device._pinned_pool import StagingPool
from tba.device._staged_route import StagedRoute

BLOCK = 16 * ALIGN_BYTES
SMALL = dict(min_offload_bytes=0, block_size_bytes=8192, staging_bytes=8 * 8192)


def _route(sim, tmp_path, blocks: int = 1):
    ops = CudaOps(torch.device("cpu"))
    engine = CheckedEngine(sim)
    pool = StagingPool(capacity_bytes=blocks * BLOCK, block_bytes=BLOCK)
    route = StagedRoute(ops, engine, pool)
    fd = os.open(tmp_path / "spill", os.O_RDWR | os.O_CREAT, 0o600)
    return route, engine, pool, fd


def _close(route, engine, pool, fd) -> None:
    route.stop()
    route.close()
    engine.close()
    pool.close()
    os.close(fd)


def _sources(sim, sizes: list[int]) -> list[torch.Tensor]:
    out = []
    for index, nbytes in enumerate(sizes):
        src = sim.empty(nbytes)
        src.fill_(index + 1)
        out.append(src)
    return out


def _fail_the_next_record(sim, after: int = 0) -> threading.Timer:
    """Stall the streams (the copies stay queued), make an event record fail after ``after`` more succeed
    (``cudaErrorMemoryAllocation`` creating it), and let the streams run again half a second later."""
    sim.stall()
    sim.inject_fault("record", RuntimeError("CUDA error: out of memory (cudaErrorMemoryAllocation)"), after=after)
    release = threading.Timer(0.5, sim.stall, args=(False,))
    release.start()
    return release


def _closes_clean(sim, release, route, engine, pool, fd) -> None:
    """Once the test dropped its references: every staging block came back, one fault was raised and the
    simulated device saw no race."""
    gc.collect()
    release.join()
    route.stop()
    assert pool.free_blocks == pool.capacity_blocks, "a staging block never came back"
    _close(route, engine, pool, fd)
    assert sim.faults_raised == 1
    assert sim.problems() == [], "\n".join(sim.problems())


def test_an_event_record_that_fails_after_a_groups_copies_were_queued(sim, tmp_path):
    """Three storages share a block; their copies are queued on a lagging side stream, then the event
    after them cannot be recorded (``cudaErrorMemoryAllocation`` creating it). Every member hears the
    error, and the program frees its storages: the block and the sources must still outlive the copies."""
    route, engine, pool, fd = _route(sim, tmp_path)
    sources = _sources(sim, [ALIGN_BYTES, 2 * ALIGN_BYTES, ALIGN_BYTES])
    gate = threading.Event()
    route._jobs.put((gate.wait, lambda error: None))
    outcomes: list[Future] = []
    offset = 0
    for src in sources:
        done: Future = Future()
        route.write(src, 0, fd, offset, done.set_result, route.mark_ready())
        offset += src.numel()
        outcomes.append(done)
    del src
    release = _fail_the_next_record(sim)  # the side stream lags: the copies are still queued when it fails
    gate.set()
    errors = [done.result(timeout=30) for done in outcomes]
    assert all(isinstance(error, RuntimeError) for error in errors), errors
    # The program frees its storages (the allocator's next kernel poisons them); the error's traceback held them too.
    del sources, errors, outcomes, done
    _closes_clean(sim, release, route, engine, pool, fd)


def test_an_event_record_that_fails_after_a_read_groups_copies_were_queued(sim, tmp_path):
    """The mirror: a read group's copies into new device memory are queued on a lagging prefetch stream,
    then the event after them cannot be recorded. The readers hear the error and drop their buffers: the
    block and the buffers must outlive the copies."""
    route, engine, pool, fd = _route(sim, tmp_path)
    sizes = [ALIGN_BYTES, 2 * ALIGN_BYTES, ALIGN_BYTES]
    sources = _sources(sim, sizes)
    offsets = [0, ALIGN_BYTES, 3 * ALIGN_BYTES]
    written = []
    for src, offset in zip(sources, offsets):
        done: Future = Future()
        route.write(src, 0, fd, offset, done.set_result, route.mark_ready())
        written.append(done)
    assert [done.result(timeout=30) for done in written] == [None] * 3
    route.drain()
    route.ops.drain()
    gate = threading.Event()
    route._jobs.put((gate.wait, lambda error: None))
    outcomes: list[Future] = []
    for nbytes, offset in zip(sizes, offsets):
        done = Future()
        route.read(torch.device("cpu"), nbytes, 0, fd, offset, lambda *outcome, done=done: done.set_result(outcome))
        outcomes.append(done)
    release = _fail_the_next_record(sim, after=1)
    gate.set()
    errors = [done.result(timeout=30)[0] for done in outcomes]
    assert all(isinstance(error, RuntimeError) for error in errors), errors
    del errors, outcomes, done, sources, written
    _closes_clean(sim, release, route, engine, pool, fd)


def test_a_cuda_error_reading_back_a_saved_tensor_is_a_tba_read_error(sim, tmp_path):
    """Backward's host-to-device copies fail (a broken context): backward raises TbaReadError naming the
    tensor and file, with the CUDA error as its cause, not the bare RuntimeError of whichever copy failed.
    Every staging block comes back, and once the device recovered the next step is exact."""
    model, forward = tiny_gpt()
    engine = CheckedEngine(sim)
    reference = run_step(model, forward)
    offloader = tba.Offloader(tmp_path, backend=engine, layers=model, **SMALL)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1234)
    with offloader:
        loss = forward(model)
        offloader.flush()
    sim.inject_fault("copy", times=None)
    with pytest.raises(tba.TbaReadError, match="cannot read back") as raised:
        loss.backward()
    assert "illegal memory access" in str(raised.value.__cause__)
    sim.clear_faults()
    del loss, raised
    assert steps_equal(reference, run_step(model, forward, offloader))
    routes = offloader._store.routes
    offloader.close()
    engine.close()
    pool = routes.staging_pool
    assert pool.free_blocks == pool.capacity_blocks, "a staging block was never returned"


def test_a_staging_slab_that_cannot_be_page_locked_falls_back_to_pageable_memory(sim, tmp_path, caplog):
    """``cudaHostRegister`` of the staging slab fails (``cudaErrorMemoryAllocation``: the page-locked limit
    reached): the offloader warns and stages through pageable memory, exactly, instead of failing to open."""
    model, forward = tiny_gpt()
    engine = CheckedEngine(sim)
    reference = run_step(model, forward)
    sim.inject_fault("pin", RuntimeError("cudaHostRegister of 65536 bytes failed with CUDA error 2"))
    offloader = tba.Offloader(tmp_path, backend=engine, layers=model, **SMALL)
    with caplog.at_level("WARNING", logger="tba"):
        assert steps_equal(reference, run_step(model, forward, offloader))
    assert offloader.stats.bytes_read > 0
    assert "cannot page-lock" in caplog.text
    routes = offloader._store.routes
    offloader.close()
    engine.close()
    assert not routes.staging_pool.pinned and sim.pinned.pinned_bytes == 0


def test_an_event_record_that_fails_after_the_middle_pieces_copy_was_queued(sim, tmp_path):
    """A storage of three blocks goes piece by piece; the event after the middle piece's copy cannot be
    recorded. The write fails, and neither that piece's block nor the storage is given back under the copy."""
    route, engine, pool, fd = _route(sim, tmp_path, blocks=2)
    (src,) = _sources(sim, [3 * BLOCK - 100])
    done: Future = Future()
    ready = route.mark_ready()
    release = _fail_the_next_record(sim, after=1)
    route.write(src, 0, fd, 0, done.set_result, ready)
    del src, ready
    error = done.result(timeout=30)
    assert isinstance(error, RuntimeError), error
    del error, done
    _closes_clean(sim, release, route, engine, pool, fd)
