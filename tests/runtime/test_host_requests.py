"""HostBatch sends storages whose extents touch as one vectored request (Note [Adjacent storages, one
request] in ``tba/runtime/_host_requests.py``); each storage still hears its own outcome."""

from __future__ import annotations

import errno
import functools
import gc

import pytest
import torch
from test_host_io import HeldEngine

from tba import _control
from tba.device import WRITE_NOT_NEEDED
from tba.errors import EngineClosedError
from tba.io import BufferPool, Op
from tba.runtime import _host_requests
from tba.runtime._host_io import HostBatch

C_LOOP = _host_requests._requests
"""tba._requests, or None where it is not built."""

KIB = 1 << 10
STORAGE_BYTES = 64 * KIB
BLOCK_BYTES = 1 << 20


@pytest.fixture(autouse=True, params=["c", "python"])
def forming(request, monkeypatch):
    """Every test with the C loop of tba._requests and with the Python one (Note [Requests formed in C])."""
    if request.param == "c" and not _host_requests.NATIVE:
        pytest.skip("the native extension tba._requests is not built")
    if request.param == "python":
        monkeypatch.setattr(_host_requests, "_requests", None)
    return request.param


class VectoredEngine(HeldEngine):
    vectored = True

    def fail(self, error: BaseException) -> None:
        sent, self.sent = self.sent, []
        for _, callback in sent:
            callback(error)


def _writes(batch: HostBatch, offsets: list[int], fd: int = 3, nbytes: int = STORAGE_BYTES) -> tuple[list, dict]:
    """Queue a write per offset as one batch of deferred saves does: in one control-thread job, so that
    they are sent together once it ends (deferred one by one, the control thread's poll could split them)."""
    storages, heard = [], {}
    for i in range(len(offsets)):
        storages.append(torch.full((nbytes,), i, dtype=torch.uint8))

    def queue_all() -> None:
        for i, (data, offset) in enumerate(zip(storages, offsets)):
            batch.write(data, 0, fd, offset, lambda error, i=i: heard.setdefault(i, []).append(error))

    _control.call(queue_all)
    return storages, heard


def test_adjacent_writes_go_as_one_request_and_each_storage_hears_its_end():
    engine = VectoredEngine()
    storages, heard = _writes(HostBatch(engine, BufferPool(0), BLOCK_BYTES), [i * STORAGE_BYTES for i in range(5)])
    [(request, _)] = engine.sent
    assert request.op is Op.WRITE and request.offset == 0 and request.nbytes == 5 * STORAGE_BYTES
    assert request.pieces == tuple((s.data_ptr(), STORAGE_BYTES) for s in storages)
    assert all(a is b for a, b in zip(request.owner, storages)), "the request must keep every storage alive"
    engine.complete(Op.WRITE)
    assert heard == {i: [None] for i in range(5)}


def test_a_failed_request_goes_again_one_storage_at_a_time_and_each_hears_its_own_outcome():
    """The file-size limit's case: the whole request fails, the storages that end below the limit are
    then written, and only the one that crosses it fails."""
    engine = VectoredEngine()
    _, heard = _writes(HostBatch(engine, BufferPool(0), BLOCK_BYTES), [i * STORAGE_BYTES for i in range(3)])
    engine.fail(OSError(errno.EINVAL, "cut at the limit"))
    assert [(r.offset, r.pieces) for r, _ in engine.sent] == [(i * STORAGE_BYTES, None) for i in range(3)]
    assert heard == {}, "a storage heard the whole request's error"
    too_large = OSError(errno.EFBIG, "past the limit")
    (*written, (_, last)) = engine.sent
    engine.sent = []
    for _, callback in written:
        callback(None)
    last(too_large)
    assert heard == {0: [None], 1: [None], 2: [too_large]}


def test_a_retry_the_engine_refuses_fails_each_storage():
    engine = VectoredEngine()
    _, heard = _writes(HostBatch(engine, BufferPool(0), BLOCK_BYTES), [i * STORAGE_BYTES for i in range(2)])
    closed = RuntimeError("engine failed")

    def refuse(requests, on_done):
        raise closed

    engine.submit_calls = refuse
    engine.fail(OSError(errno.EIO, "bad block"))
    assert heard == {0: [closed], 1: [closed]}


def test_a_joined_write_failing_while_closing_is_not_needed_rather_than_refused_again():
    """The retry of a joined write that failed during close() meets the closed engine: as for a write sent
    alone, its storages hear WRITE_NOT_NEEDED, not each an EngineClosedError."""
    engine = VectoredEngine()
    batch = HostBatch(engine, BufferPool(0), BLOCK_BYTES)
    _, heard = _writes(batch, [i * STORAGE_BYTES for i in range(2)])
    batch.drop_waiting_writes()

    def refuse(requests, on_done):
        raise EngineClosedError("engine is closed")

    engine.submit_calls = refuse
    engine.fail(OSError(errno.EIO, "cancelled at close"))
    assert heard == {0: [WRITE_NOT_NEEDED], 1: [WRITE_NOT_NEEDED]}


def test_adjacent_writes_taken_before_closing_that_the_closed_engine_refuses_are_not_needed():
    """As for writes sent alone (test_host_io.py): the closed engine's refusal is no failed write, so the
    joined request's storages hear WRITE_NOT_NEEDED, not a retry's EngineClosedError."""
    engine = VectoredEngine()

    def refuse(requests, on_done):
        raise EngineClosedError("engine is closed")

    engine.submit_calls = refuse
    batch = HostBatch(engine, BufferPool(0), BLOCK_BYTES)
    storages, heard = [torch.zeros(STORAGE_BYTES, dtype=torch.uint8) for _ in range(2)], {}
    sent = []

    def queue_both() -> None:  # one control-thread job: both writes are taken by one flush
        for i, data in enumerate(storages):
            batch.write(data, 0, 3, i * STORAGE_BYTES, lambda error, i=i: heard.setdefault(i, []).append(error),
                        lambda: sent.append(1) or batch.drop_waiting_writes() or True)

    _control.call(queue_both)
    assert len(sent) == 2, "the two writes were not taken together"
    assert heard == {0: [WRITE_NOT_NEEDED], 1: [WRITE_NOT_NEEDED]}


def test_only_touching_extents_of_one_file_small_enough_are_joined():
    engine = VectoredEngine()
    batch = HostBatch(engine, BufferPool(0), BLOCK_BYTES)
    _writes(batch, [0, STORAGE_BYTES, 3 * STORAGE_BYTES, 4 * STORAGE_BYTES])  # a gap after the second
    _writes(batch, [8 * STORAGE_BYTES], fd=4)
    _writes(batch, [9 * STORAGE_BYTES, 9 * STORAGE_BYTES + BLOCK_BYTES], nbytes=BLOCK_BYTES)
    _writes(batch, [12 * STORAGE_BYTES + 2 * BLOCK_BYTES + i * STORAGE_BYTES for i in range(20)])
    sizes = [(r.offset, r.nbytes, len(r.pieces or ())) for r, _ in engine.sent]
    assert sizes[:3] == [(0, 2 * STORAGE_BYTES, 2), (3 * STORAGE_BYTES, 2 * STORAGE_BYTES, 2),
                         (8 * STORAGE_BYTES, STORAGE_BYTES, 0)]
    assert [n for _, n, _ in sizes[3:5]] == [BLOCK_BYTES, BLOCK_BYTES], "two whole blocks are two requests"
    assert [(n, p) for _, n, p in sizes[5:]] == [(BLOCK_BYTES, 16), (4 * STORAGE_BYTES, 4)], "a request stays within a block"


def test_the_piece_cap(monkeypatch):
    monkeypatch.setattr(_host_requests, "MAX_PIECES", 3)
    engine = VectoredEngine()
    _writes(HostBatch(engine, BufferPool(0), BLOCK_BYTES), [i * 4 * KIB for i in range(7)], nbytes=4 * KIB)
    assert [len(r.pieces or ()) for r, _ in engine.sent] == [3, 3, 0]


def test_an_engine_without_vectored_requests_gets_one_per_storage():
    engine = HeldEngine()
    _writes(HostBatch(engine, BufferPool(0), BLOCK_BYTES), [i * STORAGE_BYTES for i in range(4)])
    assert [r.pieces for r, _ in engine.sent] == [None] * 4


def test_reads_in_reverse_file_order_go_as_one_request_in_file_order():
    """Backward reads a forward batch's extents last first: the request's pieces are in file order,
    each into its own buffer, and each read's callback gets its own bytes."""
    engine = VectoredEngine()
    pool = BufferPool(0)
    batch = HostBatch(engine, pool, BLOCK_BYTES)
    taken, take = [], pool.take
    pool.take = lambda nbytes: taken.append(take(nbytes)) or taken[-1]
    heard = {}
    for i in (3, 2, 1, 0, 7):
        batch.read(STORAGE_BYTES - 100, 0, 3, i * STORAGE_BYTES, lambda error, data, event, i=i: heard.__setitem__(i, data))
    batch.flush()
    (first, _), (second, _) = engine.sent
    assert (first.offset, first.nbytes, second.pieces) == (0, 4 * STORAGE_BYTES, None)
    assert first.pieces == tuple((buffer.data_ptr(), STORAGE_BYTES) for buffer in reversed(taken[:4])), \
        "the pieces are not the buffers of offsets 0, 1, 2, 3 in file order"
    for index, ((address, _), buffer) in enumerate(zip(first.pieces, first.owner)):
        assert buffer.data_ptr() == address
        buffer.fill_(index + 1)  # piece k is the extent at k * STORAGE_BYTES, read i = k
    engine.complete(Op.READ)
    assert sorted(heard) == [0, 1, 2, 3, 7]
    for i in range(4):
        # Each piece's own value: filled with address % 251, two buffers' addresses could agree (CI, once).
        assert heard[i].numel() == STORAGE_BYTES - 100 and bool((heard[i] == i + 1).all()), f"read {i} got other bytes"


def test_a_request_stays_within_the_join_cap_under_a_larger_block():
    engine = VectoredEngine()
    _writes(HostBatch(engine, BufferPool(0), 4 * BLOCK_BYTES), [i * STORAGE_BYTES for i in range(20)])
    assert [(r.nbytes, len(r.pieces)) for r, _ in engine.sent] == [(_host_requests.JOIN_MAX_BYTES, 16),
                                                                   (4 * STORAGE_BYTES, 4)]


def test_a_joined_write_lets_go_of_its_storages_before_they_hear_their_end():
    """As a request sent alone: the engine drops the request (and its owners) before the callback, and a
    storage whose write completed must find tba holding it no more (its pages go back to the kernel, and
    backward reads it from the file); the group's list of transfers held every one of them."""
    engine = VectoredEngine()
    batch = HostBatch(engine, BufferPool(0), BLOCK_BYTES)
    storages = [torch.full((STORAGE_BYTES,), i, dtype=torch.uint8) for i in range(3)]
    holders = []

    def on_done(error, data):
        holders.append([r for r in gc.get_referrers(data) if isinstance(r, _host_requests.Transfer)])

    def queue_all() -> None:
        for i, data in enumerate(storages):
            batch.write(data, 0, 3, i * STORAGE_BYTES, functools.partial(on_done, data=data))

    _control.call(queue_all)
    [(request, _)] = engine.sent
    assert len(request.pieces) == 3
    del request
    engine.complete(Op.WRITE)
    assert holders == [[], [], []], "a transfer of the joined request still held a storage when it heard its end"
