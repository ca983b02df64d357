"""Injected I/O faults: a full disk keeps training going; a failed read is loud, never zeros."""

from __future__ import annotations

import errno
import logging
import os
import threading

import pytest
import torch
from model_cases import tiny_gpt
from python_runs import run_python
from utils import FaultyEngine, assert_exact, run_step

import tba
from tba.errors import TbaReadError


def test_disk_full_keeps_tensors_in_memory_with_one_warning(spill_dir, caplog):
    model, forward = tiny_gpt()
    engine = FaultyEngine(write_errno=errno.ENOSPC)
    with caplog.at_level(logging.WARNING, logger="tba"):
        offloader = assert_exact(model, forward, spill_dir, engine)
    warnings = [r for r in caplog.records if "failed" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in caplog.records]
    assert "No space left on device" in warnings[0].getMessage() or "ENOSPC" in warnings[0].getMessage()
    stats = offloader.stats
    assert stats.storages_written == 0 and stats.bytes_written == 0 and stats.bytes_read == 0
    assert 0 < stats.tensors_kept_on_error <= stats.tensors_offloaded
    assert stats.bytes_kept_on_error > 0 and stats.unpacks_from_memory > 0
    assert engine.failed > 0
    engine.close()


def test_disk_full_warns_once_across_successive_contexts(spill_dir, caplog):
    model, forward = tiny_gpt()
    engine = FaultyEngine(write_errno=errno.ENOSPC)
    with caplog.at_level(logging.WARNING, logger="tba"):
        for _ in range(3):
            assert_exact(model, forward, spill_dir, engine)
    warnings = [r for r in caplog.records if "failed" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in caplog.records]
    engine.close()


@pytest.mark.parametrize("fault", [{"read_errno": errno.EIO}, {"short_reads": True}], ids=["eio", "short"])
def test_failed_read_raises_naming_tensor_file_and_offset(spill_dir, fault):
    model, forward = tiny_gpt()
    engine = FaultyEngine(**fault)
    offloader = tba.offload_activations(spill_dir, backend=engine, min_offload_bytes=0, layers=model)
    with pytest.raises(TbaReadError) as info:
        run_step(model, forward, offloader)
    message = str(info.value)
    assert "storage #" in message and spill_dir in message and "offset" in message
    assert isinstance(info.value.__cause__, OSError)
    assert info.value.__cause__.errno == errno.EIO
    engine.close()


class _OutOfMemoryReads(FaultyEngine):
    """Every read fails as running out of memory does (a read buffer that could not be allocated)."""

    def _failure(self, request):
        return MemoryError("no memory for the read buffer") if request.op.name == "READ" else None


@pytest.mark.parametrize("engine_type", [FaultyEngine, _OutOfMemoryReads], ids=["eio", "memory"])
def test_a_failed_read_caught_by_the_loop_keeps_nothing_of_its_step(spill_dir, engine_type):
    """Note [A raised error is no local of the frame it leaves] in tba/_control.py: the read's error, kept by its
    Outcome, held the frames that waited for it, and through them (f_back) backward's frames and the loss: the step's
    graph and offloader lived on, after a loop caught the error and dropped the loss, until the cycle collector ran."""
    import gc
    import weakref

    model, forward = tiny_gpt()
    engine = engine_type(read_errno=errno.EIO)

    def step() -> tuple[weakref.ref, weakref.ref, BaseException]:
        offloader = tba.offload_activations(spill_dir, backend=engine, min_offload_bytes=0, layers=model)
        with offloader:
            loss = forward(model)
            offloader.flush()
        try:
            loss.backward()
        except (TbaReadError, MemoryError) as err:
            return weakref.ref(loss), weakref.ref(offloader), type(err)
        raise AssertionError("the read did not fail")

    gc.disable()
    try:
        loss, offloader, raised = step()
        tba._control.call(len, ())  # the control thread is past the failed read
        assert raised is (TbaReadError if engine_type is FaultyEngine else MemoryError)
        assert loss() is None and offloader() is None, "the failed read's error kept the step's graph and offloader"
    finally:
        gc.enable()
        engine.close()


def test_failed_read_never_returns_data(spill_dir):
    engine = FaultyEngine(read_errno=errno.EIO)
    with tba.Offloader(spill_dir, backend=engine, min_offload_bytes=0) as off:
        packed = off.pack(torch.randn(1 << 16))  # nothing else holds it: unpack must read the file
        off.flush()
        for _ in range(2):
            with pytest.raises(TbaReadError):
                off.unpack(packed)
    del packed
    off.close()
    engine.close()


def test_close_with_a_shared_engine_waits_for_its_transfers(spill_dir):
    """An engine the offloader does not own outlives it: close waits for the writes on its file.

    Closing the file first failed them with EBADF, or, once the number was reused by the next
    spill file, sent the old step's bytes into the new file (wrong gradients in the soak test).
    """
    gate = threading.Event()
    engine = FaultyEngine(gate=gate)
    off = tba.Offloader(spill_dir, backend=engine, min_offload_bytes=0)
    with off:
        packed = off.pack(torch.randn(1 << 16))
    closing = threading.Thread(target=off.close)
    closing.start()
    closing.join(0.2)
    assert closing.is_alive(), "close returned while a write on its file was queued"
    gate.set()
    closing.join(10)
    assert not closing.is_alive()
    assert off.stats.tensors_kept_on_error == 0 and off.stats.storages_written == 1
    del packed
    engine.close()


FILE_SIZE_LIMIT_STEP = """
import logging, resource, sys, torch, tba
logging.basicConfig(level=logging.WARNING, format="%(message)s")
resource.setrlimit(resource.RLIMIT_FSIZE, (3_000_000, resource.RLIM_INFINITY))
xs = [torch.randn(300_000, requires_grad=True) for _ in range(20)]
want = [torch.autograd.grad(torch.tanh(x).sum(), x)[0] for x in xs]
for step in range(2):
    for x in xs:
        x.grad = None
    with tba.offload_activations(directory=sys.argv[1], policy="offload", backend=sys.argv[2]) as off:
        ys = [torch.tanh(x) for x in xs]
        if step == 0:
            off.flush()  # the writes end while their storages live: the failed ones are kept, and counted
    sum(y.sum() for y in ys).backward()
    del ys
    assert all(torch.equal(x.grad, w) for x, w in zip(xs, want)), "gradients differ"
    if step == 0:
        assert off.stats.bytes_kept_on_error > 0 and off.stats.bytes_written > 0, off.stats
print("exact")
"""


@pytest.mark.parametrize("backend", ["threads", "io_uring"])
def test_a_file_size_limit_keeps_tensors_in_memory_with_one_warning_naming_it(spill_dir, backend):
    # Note [A file-size limit is one cause] in tba/runtime/_release.py: the write cut at the limit fails
    # with EINVAL under O_DIRECT and the later ones with EFBIG; one warning, naming ulimit -f. The second
    # step's writes race backward: under load every one of them failed after its storage died, which
    # counted nothing and, before Note [A write that fails after its storage died still warns] in
    # tba/runtime/_writes.py, warned nothing either.
    if backend not in tba.available_backends():
        pytest.skip(f"{backend} is not available here")
    done = run_python(["-c", FILE_SIZE_LIMIT_STEP, spill_dir, backend], timeout=120)
    assert done.returncode == 0 and "exact" in done.stdout, done.stderr[-3000:]
    warnings = [line for line in done.stderr.splitlines() if "failed" in line]
    assert len(warnings) == 1, done.stderr[-3000:]
    assert "file-size limit of 3000000 bytes (ulimit -f)" in warnings[0] and "ulimit -f unlimited" in warnings[0]
    assert "Free space" not in warnings[0]


def test_only_a_write_crossing_the_file_size_limit_is_blamed_on_it(monkeypatch):
    from tba.runtime import _release

    monkeypatch.setattr(_release.resource, "getrlimit", lambda which: (1 << 20, _release.resource.RLIM_INFINITY))
    einval = OSError(errno.EINVAL, "Invalid argument")
    assert _release.write_error_cause(einval, (1 << 20) + 4096)[0] == errno.EFBIG
    cause, fix = _release.write_error_cause(einval, 1 << 19)  # below the limit: another cause (alignment, say)
    assert cause == errno.EINVAL and "ulimit" not in fix


def test_a_failed_read_nobody_waited_for_leaves_the_storage_on_disk(spill_dir):
    """Mutant: a prefetched (unwatched) read that failed was taken as read back, with no bytes.

    The entry must stay on disk with nothing counted resident or read; the unpack then reads again and raises.
    """
    engine = FaultyEngine(read_errno=errno.EIO)
    off = tba.Offloader(spill_dir, backend=engine, min_offload_bytes=0)
    with off:
        packed = off.pack(torch.randn(1 << 16))
        off.flush()
    store = off._store  # leaving the block prefetched the storage: nobody waits for that read
    store._wait_until(lambda: store._reading == 0)
    assert engine.failed > 0, "the prefetch did not read"
    assert packed.entry.data is None and packed.entry.state.name == "ON_DISK"
    assert off.stats.resident_bytes == 0 and off.stats.bytes_read == 0
    with pytest.raises(TbaReadError):
        off.unpack(packed)
    del packed
    off.close()
    engine.close()


@pytest.mark.parametrize(("number", "says"), [(errno.ENOSPC, "Free space there"), (errno.EDQUOT, "Free space there"),
                                              (errno.EROFS, "became read-only"), (errno.EIO, "Check the disk")])
def test_only_a_full_disk_is_told_to_free_space(number, says):
    # A file system remounted read-only after a disk error (ext4 errors=remount-ro) was told "Free space there".
    from tba.runtime import _release

    cause, fix = _release.write_error_cause(OSError(number, os.strerror(number)), 1 << 20)
    assert cause == number and says in fix
    assert ("Free space" in fix) == (number in (errno.ENOSPC, errno.EDQUOT))


def test_writes_refused_by_a_closed_engine_do_not_blame_the_disk(spill_dir, caplog):
    # An engine passed as backend= and closed (or, in a forked child, one made by the parent) failed every write with
    # EngineClosedError, and the one warning said "Check the disk (dmesg) or pass another directory".
    engine = tba.io.ThreadEngine(workers=2)
    offloader = tba.Offloader(spill_dir, backend=engine, policy="offload", min_offload_bytes=0)
    engine.close()
    lin = torch.nn.Linear(256, 256)
    with caplog.at_level(logging.WARNING, logger="tba"):
        with offloader:
            loss = lin(torch.randn(512, 256)).relu().sum()
        loss.backward()
    offloader.close()
    failed = [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
    assert len(failed) == 1 and "passed as backend= is closed" in failed[0] and "disk" not in failed[0], failed


def test_an_engine_that_cannot_start_a_thread_is_not_blamed_on_the_disk():
    # A thread engine whose pool could not start a worker failed each write with RuntimeError("can't start new thread"),
    # and the one warning said "Check the disk (dmesg) or pass another directory".
    from tba.runtime import _release

    cause, fix = _release.write_error_cause(RuntimeError("can't start new thread"), 1 << 20)
    assert cause == "RuntimeError" and "not the disk" in fix and "dmesg" not in fix
