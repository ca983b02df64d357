"""HostBatch: writes wait in tba's queue, reads go ahead of them, unwanted writes are never sent.

Note [Writes wait in tba's queue, not the engine's] in ``tba/runtime/_host_io.py``.
"""

from __future__ import annotations

import errno
import logging
import threading

import torch
from utils import FaultyEngine, backward_twice_past_held_writes

import tba
from tba import _control
from tba.device import WRITE_NOT_NEEDED
from tba.io import BufferPool, Engine, Op
from tba.runtime import _host_io
from tba.runtime._host_io import HostBatch

KIB = 1 << 10
STORAGE_BYTES = 64 * KIB


class HeldEngine(Engine):
    """Records what is submitted and completes nothing until the test says so."""

    name = "held"

    def __init__(self) -> None:
        self.sent: list[tuple] = []
        self._lock = threading.Lock()

    def submit_many(self, requests):
        raise AssertionError("HostBatch submits with submit_calls")

    def submit_calls(self, requests, on_done) -> None:
        with self._lock:
            self.sent.extend(zip(requests, on_done))

    def complete(self, op: Op) -> int:
        """Complete every sent request of ``op`` not yet completed; returns how many."""
        with self._lock:
            done = [(r, cb) for r, cb in self.sent if r.op is op and r.owner is not None]
            self.sent = [(r._replace(owner=None), cb) if r.op is op else (r, cb) for r, cb in self.sent]
        for _, callback in done:
            callback(None)
        return len(done)

    def ops(self) -> list[Op]:
        return [r.op for r, _ in self.sent]

    def close(self) -> None:
        pass


def _batch(engine: HeldEngine, write_ahead_bytes: int) -> HostBatch:
    return HostBatch(engine, BufferPool(0), 1 << 20, write_ahead_bytes=write_ahead_bytes)


def test_at_most_the_allowance_is_in_the_engine_and_reads_go_first():
    engine, heard = HeldEngine(), []
    batch = _batch(engine, 2 * STORAGE_BYTES)
    storages = [torch.zeros(STORAGE_BYTES, dtype=torch.uint8) for _ in range(5)]
    for i, data in enumerate(storages):
        batch.write(data, 0, 3, i * STORAGE_BYTES, lambda error, i=i: heard.append((i, error)))
    batch.flush()
    assert engine.ops() == [Op.WRITE, Op.WRITE] and batch.waiting_writes == 3
    batch.read(STORAGE_BYTES, 0, 3, 0, lambda error, data, event: heard.append(("read", error)))
    batch.flush()
    assert engine.ops() == [Op.WRITE, Op.WRITE, Op.READ], "a read waited behind writes not yet sent"
    assert engine.complete(Op.WRITE) == 2
    assert heard[:2] == [(0, None), (1, None)]
    assert engine.ops().count(Op.WRITE) == 4 and batch.waiting_writes == 1
    engine.complete(Op.WRITE)
    engine.complete(Op.WRITE)
    assert [i for i, _ in heard if i != "read"] == [0, 1, 2, 3, 4] and batch.waiting_writes == 0


def test_unwanted_writes_are_never_sent_and_give_their_room_to_the_next():
    """Every write the first refill takes is unwanted, with nothing in the engine: the wanted ones behind
    them must still go out (no completion would ever send them otherwise)."""
    engine, heard = HeldEngine(), {}
    batch = _batch(engine, 2 * STORAGE_BYTES)
    storages = [torch.zeros(STORAGE_BYTES, dtype=torch.uint8) for _ in range(6)]
    for i, data in enumerate(storages):
        batch.write(data, 0, 3, i * STORAGE_BYTES, lambda error, i=i: heard.setdefault(i, error),
                    wanted=lambda i=i: i >= 4)
    batch.flush()
    assert [r.offset // STORAGE_BYTES for r, _ in engine.sent] == [4, 5]
    assert all(heard[i] is WRITE_NOT_NEEDED for i in range(4)) and 4 not in heard
    engine.complete(Op.WRITE)
    assert heard[4] is None and heard[5] is None


def test_closing_drops_the_waiting_writes():
    engine, heard = HeldEngine(), []
    batch = _batch(engine, STORAGE_BYTES)
    for i in range(3):
        batch.write(torch.zeros(STORAGE_BYTES, dtype=torch.uint8), 0, 3, i * STORAGE_BYTES,
                    lambda error, i=i: heard.append((i, error)))
    batch.flush()
    batch.drop_waiting_writes()
    assert heard == [(1, WRITE_NOT_NEEDED), (2, WRITE_NOT_NEEDED)]
    engine.complete(Op.WRITE)
    assert heard[-1] == (0, None) and engine.ops() == [Op.WRITE], "a write was sent after closing"


class OneWriteAtATime(HeldEngine):
    """A :class:`HeldEngine` that asks tba for one write at a time (``Engine.write_ahead_bytes``)."""

    write_ahead_bytes = 1


def test_an_engine_sets_the_allowance_of_writes_it_is_handed(spill_dir):
    """``Engine.write_ahead_bytes`` is the allowance (the fuzzer's late writes use it): with one byte, one storage's
    write goes to the engine and the others wait in tba's queue; the default engine keeps the default."""
    engine = OneWriteAtATime()
    xs = [torch.randn(STORAGE_BYTES // 4, requires_grad=True) for _ in range(3)]
    off = tba.Offloader(spill_dir, backend=engine, min_offload_bytes=0)
    with off:
        losses = [torch.tanh(x).pow(2).sum() for x in xs]
    _control.settle()
    assert engine.ops() == [Op.WRITE] and off._store._host.waiting_writes == 2
    while engine.complete(Op.WRITE):
        _control.settle()
    del losses
    off.close()
    default = tba.Offloader(spill_dir, backend=HeldEngine(), min_offload_bytes=0)
    with default:
        pass
    assert default._store._host.write_ahead_bytes == _host_io.HOST_WRITE_AHEAD_BYTES
    default.close()


def test_host_writes_backward_took_from_memory_are_skipped_and_exact(spill_dir, monkeypatch):
    """Forward saves faster than the disk writes (the engine's writes wait for a gate): backward takes
    the storages whose writes are still waiting in tba's queue from memory, and they are never written;
    a second backward through the retained graph still finds them, exactly."""
    monkeypatch.setattr(_host_io, "HOST_WRITE_AHEAD_BYTES", 2 * STORAGE_BYTES)
    gate = threading.Event()
    xs = [torch.randn(STORAGE_BYTES // 4, requires_grad=True) for _ in range(12)]
    off = tba.Offloader(spill_dir, backend=FaultyEngine(gate=gate), min_offload_bytes=0)
    losses = backward_twice_past_held_writes(off, xs, gate, min_skipped=len(xs) - 3)
    assert off.stats.bytes_written <= 3 * STORAGE_BYTES, str(off.stats.as_dict())
    del losses
    off.close()


def _forward_behind_gate(spill_dir, engine, count: int):
    """Forward ``tanh(x).pow(2).sum()`` of ``count`` leaves under an offloader on ``engine`` (whose writes
    wait for the caller's gate); returns the leaves, their gradients without tba, the offloader and the losses."""
    xs = [torch.randn(STORAGE_BYTES // 4, requires_grad=True) for _ in range(count)]
    want = [torch.autograd.grad(torch.tanh(x).pow(2).sum(), x)[0] for x in xs]
    off = tba.Offloader(spill_dir, backend=engine, min_offload_bytes=0)
    with off:
        losses = [torch.tanh(x).pow(2).sum() for x in xs]
    return xs, want, off, losses


def test_writes_of_storages_the_window_holds_for_backward_are_skipped(spill_dir, monkeypatch):
    """At the end of forward the prefetch window holds the last storages in memory for backward: their
    writes, still waiting, serve nothing and are skipped before backward starts; backward stays exact."""
    monkeypatch.setattr(_host_io, "HOST_WRITE_AHEAD_BYTES", 2 * STORAGE_BYTES)
    gate = threading.Event()
    xs, want, off, losses = _forward_behind_gate(spill_dir, FaultyEngine(gate=gate), 12)
    gate.set()
    off.flush()
    assert off.stats.writes_skipped >= len(xs) - 3, str(off.stats.as_dict())
    torch.autograd.backward(losses)
    assert all(torch.equal(x.grad, g) for x, g in zip(xs, want))
    off.close()


class RefusingEngine(HeldEngine):
    """Refuses every batch, as a failed or closed engine does."""

    def __init__(self, error: BaseException) -> None:
        super().__init__()
        self.error = error

    def submit_calls(self, requests, on_done) -> None:
        raise self.error


def test_an_engine_that_refuses_every_batch_fails_every_waiting_write_without_recursing():
    """Each failed write's completion asks for the next ones: that must loop, not nest one call per batch
    (thousands of waiting writes reached Python's recursion limit and stranded the rest)."""
    error = OSError(5, "engine failed")
    batch = _batch(RefusingEngine(error), 4096)
    heard = []
    count = 3000
    def save_all():  # on the control thread, so that every write waits for the batch's one flush
        for i in range(count):
            batch.write(torch.zeros(4096, dtype=torch.uint8), 0, 3, i * 4096, heard.append)

    _control.call(save_all)
    _control.settle()
    assert len(heard) == count and all(e is error for e in heard) and batch.waiting_writes == 0


def test_a_zero_allowance_sends_one_write_at_a_time_and_strands_none():
    engine, heard = HeldEngine(), []
    batch = _batch(engine, 0)
    for i in range(3):
        batch.write(torch.zeros(STORAGE_BYTES, dtype=torch.uint8), 0, 3, i * STORAGE_BYTES, heard.append)
    batch.flush()
    for sent in (1, 2, 3):
        assert engine.ops() == [Op.WRITE] * sent
        engine.complete(Op.WRITE)
    assert heard == [None] * 3


def test_after_closing_writes_are_not_needed_even_those_the_closed_engine_refuses():
    from tba.errors import EngineClosedError

    batch = _batch(RefusingEngine(EngineClosedError("engine is closed")), STORAGE_BYTES)
    heard = []
    batch.drop_waiting_writes()
    batch.write(torch.zeros(STORAGE_BYTES, dtype=torch.uint8), 0, 3, 0, heard.append)
    assert heard == [WRITE_NOT_NEEDED] and batch.waiting_writes == 0
    # Taken before closing, sent after it: the closed engine's refusal is not a failed write.
    batch = _batch(RefusingEngine(EngineClosedError("engine is closed")), STORAGE_BYTES)
    batch.write(torch.zeros(STORAGE_BYTES, dtype=torch.uint8), 0, 3, 0, heard.append,
                wanted=lambda: batch.drop_waiting_writes() or True)
    batch.flush()
    assert heard[-1] is WRITE_NOT_NEEDED


class FailAfterGate(FaultyEngine):
    """Writes wait for the gate, then fail with ENOSPC (a disk that filled up after forward)."""

    def _gated_write(self, request):
        self.gate.wait()
        raise OSError(errno.ENOSPC, "No space left on device")


def test_a_held_storage_whose_write_failed_still_counts_against_the_window(spill_dir):
    """Held for backward while its write was in the engine, then the write failed: the storage is
    kept in memory until unpacked, and the prefetch window must keep counting it (a walk that stopped
    counting it read another budget's worth beside it)."""
    gate = threading.Event()
    xs, want, off, losses = _forward_behind_gate(spill_dir, FailAfterGate(gate=gate), 6)
    window = off._store.window
    held = window._held
    assert held > 0
    gate.set()
    off.flush()
    assert off.stats.tensors_kept_on_error > 0
    assert window._held == held, "a held storage kept after a failed write stopped counting"
    torch.autograd.backward(losses)
    assert all(torch.equal(x.grad, g) for x, g in zip(xs, want))
    off.close()


def test_a_write_that_fails_after_its_storage_died_still_warns_once(spill_dir, caplog):
    """Note [A write that fails after its storage died still warns] in tba/runtime/_writes.py: backward took
    every storage from memory while the writes waited, the storages died, then the disk refused the writes.
    Nothing is kept or written, but the full disk is reported, once."""
    gate = threading.Event()
    xs, want, off, losses = _forward_behind_gate(spill_dir, FailAfterGate(gate=gate), 6)
    torch.autograd.backward(losses)
    del losses
    _control.settle()  # the storages' deaths are noted on tba's control thread
    assert all(torch.equal(x.grad, g) for x, g in zip(xs, want))
    with caplog.at_level(logging.WARNING, logger="tba"):
        gate.set()
        off.flush()
    assert off.stats.tensors_kept_on_error == 0 and off.stats.bytes_written == 0, str(off.stats.as_dict())
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "failed" in r.getMessage()]
    assert len(warned) == 1 and "No space left on device" in warned[0], warned
    assert "nothing was kept" in warned[0], "the warning claimed stats.bytes_kept_on_error counts what it never kept"
    off.close()
