"""Lifetimes of the staged route's device buffers on the simulated device, driven directly and deterministically.

Each case stalls the simulated device's asynchronous streams (``SimulatedCuda.stall``) so that the
route's copies are queued but not run, then drops every reference the caller has: whatever is still
alive then is held by the route, as it must be until its copy's event completed (the caching
allocator would otherwise hand the memory to the next allocation under the copy).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import threading
import time
from collections.abc import Iterator

import torch
from sim_helpers import CheckedEngine
from torch.multiprocessing.reductions import StorageWeakRef

from tba.device import CudaOps
from tba.device._pinned_pool import StagingPool
from tba.device._staged_route import StagedRoute

BLOCK = 8192
NBYTES = 3 * BLOCK + 100
"""Several pieces, the last one partial."""


def _expires(ref: StorageWeakRef, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        gc.collect()
        if ref.expired():
            return True
        time.sleep(0.02)
    return False


@dataclasses.dataclass
class _Route:
    """A staged route on the simulated device, its engine, ops, staging pool and spill file."""

    device: torch.device
    engine: CheckedEngine
    ops: CudaOps
    pool: StagingPool
    route: StagedRoute
    fd: int


@contextlib.contextmanager
def _staged_route(sim, tmp_path) -> Iterator[_Route]:
    device = torch.device("cpu")
    engine = CheckedEngine(sim)
    ops = CudaOps(device)
    pool = StagingPool(4 * BLOCK, BLOCK)
    route = StagedRoute(ops, engine, pool)
    fd = os.open(tmp_path / "spill", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        yield _Route(device, engine, ops, pool, route, fd)
    finally:
        sim.stall(False)
        route.stop()
        route.close()
        pool.close()
        engine.close()
        os.close(fd)


def test_a_read_whose_consumer_let_go_keeps_its_buffer_until_the_copies_ran(sim, tmp_path):
    """A read whose entry died before its host-to-device copies ran (backward no longer needs it).

    ``_block_read`` hands the read (and its destination) to the copy's completion: dropping it there
    let the destination die with the prefetch stream's copy still queued into it, and the compute
    stream's next kernel (the allocator's poison) write the block unordered with that copy. The
    offloader-level tests on the simulator passed with that mutant: their reads' buffers were
    still held by the store when the copies ran.
    """
    with _staged_route(sim, tmp_path) as staged:
        device, ops, pool, route, fd = staged.device, staged.ops, staged.pool, staged.route, staged.fd
        src = sim.empty(NBYTES)
        src.copy_(torch.arange(NBYTES, dtype=torch.int64).remainder(251).to(torch.uint8))
        written, errors = threading.Event(), []
        route.write(src, 0, fd, 0, lambda error: (errors.append(error), written.set()), ops.mark_ready())
        assert written.wait(10) and errors == [None]
        del src

        sim.stall()  # the prefetch stream will not run the copies
        seen: list = []
        handed = threading.Event()

        def on_done(error, data, event):
            seen.append((error, StorageWeakRef(data.untyped_storage()) if data is not None else None))
            handed.set()  # and lets go of ``data`` at once, as a store whose entry died

        route.read(device, NBYTES, 0, fd, 0, on_done)
        assert handed.wait(10)
        error, buffer = seen[0]
        assert error is None
        assert not _expires(buffer, 1.0), "the read's buffer was freed with its copies still queued"
        sim.stall(False)
        route.stop()
        assert _expires(buffer, 10.0), "the read's buffer outlived its copies"
        assert pool.free_blocks == pool.capacity_blocks


def test_stop_returns_once_every_queued_copy_has_submitted_its_file_write(sim, tmp_path):
    """``StagedRoute.stop`` waits for the copy completions it queued (``ops.drain()``).

    The runtime closes the host engine right after ``routes.stop()`` (``Runtime.close``): a copy still
    queued on a lagging side stream then submitted its file write to a closed engine, and the write
    failed. Without the drain no other test failed.
    """
    with _staged_route(sim, tmp_path) as staged:
        engine, ops, route, fd = staged.engine, staged.ops, staged.route, staged.fd
        src = sim.empty(NBYTES)
        src.fill_(7)
        done, errors = threading.Event(), []
        sim.stall()  # the side stream lags: the copies stay queued
        route.write(src, 0, fd, 0, lambda error: (errors.append(error), done.set()), ops.mark_ready())
        threading.Timer(0.5, sim.stall, args=(False,)).start()
        route.stop()
        engine.close()  # as Runtime.close does next
        assert done.wait(10)
        assert errors == [None], f"a write queued before stop() failed: {errors}"
        assert os.pread(fd, NBYTES, 0) == bytes([7]) * NBYTES
