"""Staged transfers queued together share a block (Note [Storages queued together share a block]).

The route is driven directly: a job that waits on a gate holds the stager, the writes are queued
behind it, and the gate lets the stager take them all at once, as it takes a batch of forward's saves.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from concurrent.futures import Future

import pytest
import torch
from utils import FakeDeviceOps

from tba.defaults import ALIGN_BYTES
from tba.device._pinned_pool import StagingPool
from tba.device._protocol import WRITE_NOT_NEEDED
from tba.device._staged_route import StagedRoute
from tba.io import Engine, Op, Request, ThreadEngine, round_up

BLOCK = 16 * ALIGN_BYTES


class RecordingEngine(Engine):
    """A thread engine that records every request it is given; reads fail with ``read_error`` when set, and are
    refused at submit with ``refuse_reads``."""

    name = "recording"

    def __init__(self) -> None:
        self.inner = ThreadEngine(workers=2)
        self.requests: list[Request] = []
        self.read_error: OSError | None = None
        self.refuse_reads = False

    def submit_many(self, requests: Sequence[Request]) -> list[Future]:
        if self.refuse_reads and requests[0].op is Op.READ:
            raise OSError(11, "EAGAIN: read refused at submit")
        self.requests.extend(requests)
        if self.read_error is not None and requests[0].op is Op.READ:
            failed: Future = Future()
            failed.set_exception(self.read_error)
            return [failed]
        return self.inner.submit_many(requests)

    def close(self) -> None:
        self.inner.close()


class FailingCopies(FakeDeviceOps):
    """Copies (both ways) fail from the ``fail_at``-th on (counting from 0)."""

    def __init__(self, fail_at: int) -> None:
        super().__init__()
        self.fail_at = fail_at
        self.copies = 0

    def _count(self) -> None:
        self.copies += 1
        if self.copies > self.fail_at:
            raise RuntimeError("copy refused")

    def copy_to_host(self, src, dst, after):
        self._count()
        return super().copy_to_host(src, dst, after)

    def copy_to_device(self, src, dst):
        self._count()
        return super().copy_to_device(src, dst)


class RefusedWaits(FakeDeviceOps):
    """Nothing can wait for a host-to-device copy: ``when_done`` refuses its events."""

    def copy_to_device(self, src, dst):
        event = super().copy_to_device(src, dst)
        event.h2d = True
        return event

    def when_done(self, event, callback):
        if getattr(event, "h2d", False):
            raise RuntimeError("no waiter")
        super().when_done(event, callback)


@pytest.fixture
def route(tmp_path, request):
    ops = getattr(request, "param", None) or FakeDeviceOps()
    engine = RecordingEngine()
    pool = StagingPool(capacity_bytes=BLOCK, block_bytes=BLOCK, pinned=False)
    route = StagedRoute(ops, engine, pool)
    fd = os.open(tmp_path / "spill", os.O_RDWR | os.O_CREAT, 0o600)
    route.fd = fd
    yield route
    route.stop()
    route.close()
    engine.close()
    os.close(fd)


def write_all(route: StagedRoute, writes: list[tuple[torch.Tensor, int]], wanted=None, fd=None) -> list[Future]:
    """Queue every ``(src, offset)`` behind a held stager, release it, and wait for every outcome."""
    gate = threading.Event()
    route._jobs.put((gate.wait, lambda error: None))
    outcomes = []
    for i, (src, offset) in enumerate(writes):
        done: Future = Future()
        check = None if wanted is None else (lambda i=i: wanted(i))
        route.write(src, 0, route.fd if fd is None else fd[i], offset, done.set_result, route.mark_ready(), check)
        outcomes.append(done)
    gate.set()
    for done in outcomes:
        done.result(timeout=30)
    return outcomes


def laid_out(sizes: list[int], start: int = 0) -> list[tuple[torch.Tensor, int]]:
    """Random storages of ``sizes`` bytes at consecutive extents from ``start``, as the spill file gives them."""
    out, offset = [], start
    for size in sizes:
        out.append((torch.randint(0, 256, (size,), dtype=torch.uint8), offset))
        offset += round_up(size, ALIGN_BYTES)
    return out


def on_file(route: StagedRoute, src: torch.Tensor, offset: int) -> bool:
    return os.pread(route.fd, src.numel(), offset) == bytes(src.numpy())


def test_adjacent_writes_share_one_block_and_one_request(route):
    writes = laid_out([5000, 4096, 100, 20000])
    outcomes = write_all(route, writes)
    assert [done.result() for done in outcomes] == [None] * 4
    assert [(r.offset, r.nbytes) for r in route.engine.requests] == [(0, round_up(5000, 4096) + 4096 + 4096 + 20480)]
    assert all(on_file(route, src, offset) for src, offset in writes)
    assert route.ops.log.count("d2h") == 4
    assert route.pool.free_blocks == 1


def test_a_group_ends_at_a_gap_another_file_or_the_blocks_end(route, tmp_path):
    other = os.open(tmp_path / "other", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        writes = laid_out([4096] * 3) + laid_out([8192], start=3 * 4096 + 4096) + laid_out([4096], start=4 * 4096 + 8192)
        writes += laid_out([BLOCK - 4096, 8192], start=5 * 4096 + 8192)
        fds = [route.fd] * 4 + [other] + [route.fd] * 2
        write_all(route, writes, fd=fds)
        spans = [(r.fd == other, r.offset, r.nbytes) for r in route.engine.requests]
        assert spans == [(False, 0, 3 * 4096), (False, 4 * 4096, 8192), (True, 4 * 4096 + 8192, 4096),
                         (False, 5 * 4096 + 8192, BLOCK - 4096), (False, 5 * 4096 + 8192 + BLOCK - 4096, 8192)]
        assert all(on_file(route, src, offset) for (src, offset), fd in zip(writes, fds) if fd == route.fd)
        src, offset = writes[4]
        assert os.pread(other, src.numel(), offset) == bytes(src.numpy())
    finally:
        os.close(other)


def test_a_skipped_write_splits_the_group_and_its_extent_is_not_written(route):
    writes = laid_out([4096, 6000, 4096])
    outcomes = write_all(route, writes, wanted=lambda i: i != 1)
    assert outcomes[1].result() is WRITE_NOT_NEEDED
    assert [(r.offset, r.nbytes) for r in route.engine.requests] == [(0, 4096), (4096 + 8192, 4096)]
    assert os.pread(route.fd, 8192, 4096) == bytes(8192)  # never written: a hole
    assert on_file(route, *writes[0]) and on_file(route, *writes[2])


def test_a_storage_larger_than_a_block_goes_piece_by_piece_with_one_block_in_the_pool(route):
    writes = laid_out([4096, 3 * BLOCK + 100, 4096, 4096])
    outcomes = write_all(route, writes)
    assert [done.result() for done in outcomes] == [None] * 4
    assert [(r.offset, r.nbytes) for r in route.engine.requests] == [
        (0, 4096), (4096, BLOCK), (4096 + BLOCK, BLOCK), (4096 + 2 * BLOCK, BLOCK), (4096 + 3 * BLOCK, 4096),
        (8192 + 3 * BLOCK, 8192)]
    assert all(on_file(route, src, offset) for src, offset in writes)
    assert route.pool.free_blocks == 1


@pytest.mark.parametrize("route", [FailingCopies(fail_at=2)], indirect=True)
def test_a_copy_that_fails_fails_its_storage_and_the_rest_of_its_group(route):
    writes = laid_out([4096] * 5)
    outcomes = write_all(route, writes)
    results = [done.result() for done in outcomes]
    assert results[:2] == [None, None]
    assert all(isinstance(error, RuntimeError) for error in results[2:])
    assert [(r.offset, r.nbytes) for r in route.engine.requests] == [(0, 8192)]
    assert on_file(route, *writes[0]) and on_file(route, *writes[1])
    assert route.pool.free_blocks == 1


def test_a_callback_that_raises_does_not_stop_the_others(route, caplog):
    writes = laid_out([4096] * 3)
    gate = threading.Event()
    route._jobs.put((gate.wait, lambda error: None))
    heard: list[int] = []

    def callback(i, error):
        heard.append(i)
        if i == 0:
            raise ValueError("a store callback failed")

    for i, (src, offset) in enumerate(writes):
        route.write(src, 0, route.fd, offset, lambda error, i=i: callback(i, error), route.mark_ready())
    gate.set()
    route.drain()
    route.ops.drain()
    for _ in range(3000):
        if len(heard) == 3:
            break
        threading.Event().wait(0.01)
    assert sorted(heard) == [0, 1, 2]
    assert "completion callback failed" in caplog.text


def read_all(route: StagedRoute, extents: list[tuple[int, int]], fd=None) -> list[tuple]:
    """Queue a read of every ``(offset, nbytes)`` behind a held stager, release it; every ``(error, data)``."""
    gate = threading.Event()
    route._jobs.put((gate.wait, lambda error: None))
    outcomes = []
    for i, (offset, nbytes) in enumerate(extents):
        done: Future = Future()

        def heard(error, data, event, done=done):
            if event is not None:
                event.result()
            done.set_result((error, None if data is None else data.clone()))

        route.read(torch.device("cpu"), nbytes, 0, route.fd if fd is None else fd[i], offset, heard)
        outcomes.append(done)
    gate.set()
    return [done.result(timeout=30) for done in outcomes]


def test_adjacent_reads_share_one_block_and_one_request_in_either_order(route):
    writes = laid_out([5000, 4096, 100, 9000])
    write_all(route, writes)
    route.engine.requests.clear()
    order = [3, 2, 1, 0]  # a prefetch step reads the extents backward wants next: the last first
    got = read_all(route, [(writes[i][1], writes[i][0].numel()) for i in order])
    assert all(error is None and torch.equal(data, writes[i][0]) for i, (error, data) in zip(order, got))
    assert [(r.op, r.offset, r.nbytes) for r in route.engine.requests] == [(Op.READ, 0, 8192 + 4096 + 4096 + 12288)]
    assert route.pool.free_blocks == 1


def test_reads_split_at_a_gap_and_larger_than_a_block_go_piece_by_piece(route):
    writes = laid_out([4096, 2 * BLOCK + 10, 4096]) + laid_out([4096], start=4 * 4096 + 2 * BLOCK)
    write_all(route, writes)
    route.engine.requests.clear()
    got = read_all(route, [(offset, src.numel()) for src, offset in reversed(writes)])
    assert all(error is None and torch.equal(data, src) for (error, data), (src, _) in zip(got, reversed(writes)))
    end = 2 * 4096 + 2 * BLOCK
    assert [(r.offset, r.nbytes) for r in route.engine.requests] == [
        (end + 8192, 4096), (end, 4096), (4096, BLOCK), (4096 + BLOCK, BLOCK), (4096 + 2 * BLOCK, 4096), (0, 4096)]
    assert route.pool.free_blocks == 1


def test_a_failed_file_read_fails_every_read_of_its_block(route):
    writes = laid_out([4096] * 3)
    write_all(route, writes)
    route.engine.read_error = OSError(5, "EIO")
    got = read_all(route, [(offset, src.numel()) for src, offset in writes])
    assert [(type(error), data) for error, data in got] == [(OSError, None)] * 3
    assert route.pool.free_blocks == 1


@pytest.mark.parametrize("route", [FailingCopies(fail_at=4)], indirect=True)
def test_a_copy_in_that_fails_fails_its_read_and_the_rest_of_its_block(route):
    writes = laid_out([4096] * 3)
    write_all(route, writes)
    assert route.ops.copies == 3
    got = read_all(route, [(offset, src.numel()) for src, offset in writes])
    assert got[0][0] is None and torch.equal(got[0][1], writes[0][0])
    assert isinstance(got[1][0], RuntimeError) and got[1][1] is None and isinstance(got[2][0], RuntimeError)
    assert route.pool.free_blocks == 1


@pytest.mark.parametrize("route", [RefusedWaits()], indirect=True)
def test_reads_whose_copies_cannot_be_waited_for_still_arrive_and_their_block_is_not_reused(route, caplog):
    writes = laid_out([4096, 100])
    write_all(route, writes)
    got = read_all(route, [(offset, src.numel()) for src, offset in writes])
    assert all(error is None and torch.equal(data, src) for (error, data), (src, _) in zip(got, writes))
    assert route.pool.free_blocks == 0
    assert "staging block is not reused" in caplog.text


@pytest.mark.parametrize("route", [FailingCopies(fail_at=1)], indirect=True)
def test_a_failed_members_callback_that_raises_stops_neither_the_group_nor_the_block(route, caplog):
    """A copy fails mid-group and the first failed member's callback raises: the members copied are
    still written and every other member hears its outcome; the block goes back to the pool."""
    writes = laid_out([4096] * 4)
    gate = threading.Event()
    route._jobs.put((gate.wait, lambda error: None))
    heard: dict[int, Future] = {i: Future() for i in range(4)}

    def callback(i, error):
        heard[i].set_result(error)
        if i == 1:
            raise ValueError("a store callback failed")

    for i, (src, offset) in enumerate(writes):
        route.write(src, 0, route.fd, offset, lambda error, i=i: callback(i, error), route.mark_ready())
    gate.set()
    results = [heard[i].result(timeout=30) for i in range(4)]
    assert results[0] is None and all(isinstance(error, RuntimeError) for error in results[1:])
    assert on_file(route, *writes[0])
    route.drain()
    route.ops.drain()
    assert route.pool.free_blocks == 1


def test_a_large_read_refused_at_submit_gives_its_blocks_back(route):
    """Found by a review's stress test (already so before the groups): the piece path's block leaked, and the
    next transfer waited for ever on the one-block pool."""
    writes = laid_out([2 * BLOCK + 10])
    write_all(route, writes)
    route.engine.refuse_reads = True
    (error, data), = read_all(route, [(0, writes[0][0].numel())])
    assert isinstance(error, OSError) and data is None
    assert route.pool.free_blocks == 1
    route.engine.refuse_reads = False
    write_all(route, laid_out([4096], start=3 * BLOCK))


def test_a_skipped_writes_callback_that_raises_is_not_called_again(route, caplog):
    writes = laid_out([4096, 4096])
    calls: list[object] = []
    gate = threading.Event()
    route._jobs.put((gate.wait, lambda error: None))

    def skipped(error):
        calls.append(error)
        raise ValueError("a store callback failed")

    done: Future = Future()
    route.write(writes[0][0], 0, route.fd, writes[0][1], skipped, route.mark_ready(), lambda: False)
    route.write(writes[1][0], 0, route.fd, writes[1][1], done.set_result, route.mark_ready())
    gate.set()
    assert done.result(timeout=30) is None
    assert calls == [WRITE_NOT_NEEDED]
    assert "completion callback failed" in caplog.text
