"""The engine contract, run against every backend: round trips, errors, concurrency, cleanup."""

from __future__ import annotations

import errno
import os
import threading

import numpy as np
import pytest
from engine_helpers import MIB, aligned_empty, direct_io_unsupported, open_fd_count, random_bytes

from tba.defaults import ALIGN_BYTES
from tba.errors import ShortTransferError, TbaConfigError
from tba.io import ThreadEngine
from tba.io._engine import Op, Request

SIZES_BYTES = [1, 4095, 4096, 4097, MIB + 1, 64 * MIB]
BLOCK_BYTES = MIB


def _make(name: str):
    if name == "threads":
        return ThreadEngine(workers=8)
    from tba.io._io_uring import IoUringEngine

    return IoUringEngine(queue_depth=32)


@pytest.fixture(params=["threads", pytest.param("io_uring", marks=pytest.mark.requires_io_uring)])
def engine(request):
    eng = _make(request.param)
    yield eng
    eng.close()


@pytest.fixture
def rw_fd(tmp_path):
    fd = os.open(tmp_path / "data", os.O_RDWR | os.O_CREAT, 0o600)
    yield fd
    os.close(fd)


@pytest.fixture
def direct_fd(tmp_path):
    reason = direct_io_unsupported(str(tmp_path))
    if reason:
        pytest.skip(reason)
    fd = os.open(tmp_path / "direct", os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    yield fd
    os.close(fd)


def _blocks(op: Op, fd: int, array: np.ndarray, offset: int) -> list[Request]:
    return [
        Request(op, fd, array.ctypes.data + start, min(BLOCK_BYTES, array.size - start), offset + start)
        for start in range(0, array.size, BLOCK_BYTES)
    ]


def _round_trip(engine, fd: int, data: np.ndarray, out: np.ndarray, offset: int) -> None:
    for op, array in ((Op.WRITE, data), (Op.READ, out)):
        requests = _blocks(op, fd, array, offset)
        futures = engine.submit_many(requests)
        assert [f.result(timeout=60) for f in futures] == [r.nbytes for r in requests]
    assert np.array_equal(data, out)


@pytest.mark.parametrize("nbytes", SIZES_BYTES)
def test_round_trip_unaligned(engine, rw_fd, nbytes):
    data = aligned_empty(nbytes, misalign=3)
    data[:] = random_bytes(nbytes)
    out = aligned_empty(nbytes, misalign=5)
    _round_trip(engine, rw_fd, data, out, offset=12345)


@pytest.mark.parametrize("nbytes", [4096, MIB, 64 * MIB])
def test_round_trip_direct(engine, direct_fd, nbytes):
    data = aligned_empty(nbytes)
    data[:] = random_bytes(nbytes, seed=1)
    out = aligned_empty(nbytes)
    _round_trip(engine, direct_fd, data, out, offset=3 * ALIGN_BYTES)


def test_single_large_request(engine, rw_fd):
    data = random_bytes(8 * MIB + 7)
    out = np.zeros_like(data)
    assert engine.submit_write(rw_fd, data.ctypes.data, data.size, 11).result() == data.size
    assert engine.submit_read(rw_fd, out.ctypes.data, out.size, 11).result() == out.size
    assert np.array_equal(data, out)


def test_hundreds_in_flight(engine, rw_fd):
    count, size = 600, 4096
    data = random_bytes(count * size, seed=2)
    out = np.zeros_like(data)
    writes = [Request(Op.WRITE, rw_fd, data.ctypes.data + i * size, size, i * size) for i in range(count)]
    assert all(f.result() == size for f in engine.submit_many(writes))
    reads = [r._replace(op=Op.READ, address=out.ctypes.data + r.offset) for r in reversed(writes)]
    assert all(f.result() == size for f in engine.submit_many(reads))
    assert np.array_equal(data, out)


def test_concurrent_submitters(engine, rw_fd):
    threads_n, per_thread, size = 4, 64, 16384
    data = random_bytes(threads_n * per_thread * size, seed=3)
    out = np.zeros_like(data)
    errors: list[BaseException] = []

    def worker(index: int) -> None:
        try:
            base = index * per_thread * size
            for op, array in ((Op.WRITE, data), (Op.READ, out)):
                futures = [
                    engine.submit_many([Request(op, rw_fd, array.ctypes.data + base + i * size, size, base + i * size)])[0]
                    for i in range(per_thread)
                ]
                assert all(f.result(timeout=60) == size for f in futures)
        except BaseException as err:  # noqa: BLE001 - reported by the main thread
            errors.append(err)

    workers = [threading.Thread(target=worker, args=(i,)) for i in range(threads_n)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert not errors
    assert np.array_equal(data, out)


def test_closed_fd_is_ebadf(engine, tmp_path):
    fd = os.open(tmp_path / "gone", os.O_RDWR | os.O_CREAT, 0o600)
    os.close(fd)
    buf = np.zeros(4096, dtype=np.uint8)
    with pytest.raises(OSError) as info:
        engine.submit_read(fd, buf.ctypes.data, buf.size, 0).result(timeout=10)
    assert info.value.errno == errno.EBADF


def test_write_to_read_only_fd_is_ebadf(engine, tmp_path):
    path = tmp_path / "ro"
    path.write_bytes(b"x" * 4096)
    fd = os.open(path, os.O_RDONLY)
    try:
        buf = np.ones(4096, dtype=np.uint8)
        with pytest.raises(OSError) as info:
            engine.submit_write(fd, buf.ctypes.data, buf.size, 0).result(timeout=10)
        assert info.value.errno == errno.EBADF
    finally:
        os.close(fd)


def test_short_read_at_eof(engine, rw_fd):
    os.pwrite(rw_fd, b"a" * 1000, 0)
    buf = np.zeros(4096, dtype=np.uint8)
    with pytest.raises(ShortTransferError) as info:
        engine.submit_read(rw_fd, buf.ctypes.data, buf.size, 500).result(timeout=10)
    assert info.value.errno == errno.EIO
    assert (info.value.done_bytes, info.value.want_bytes) == (500, 4096)
    assert bytes(buf[:500]) == b"a" * 500


def test_close_idempotent_and_submit_after_close(engine, rw_fd):
    data = random_bytes(64 * 4096, seed=4)
    futures = engine.submit_many(_blocks(Op.WRITE, rw_fd, data, 0))
    engine.close()
    assert all(f.done() for f in futures)
    engine.close()
    with pytest.raises(RuntimeError):
        engine.submit_write(rw_fd, data.ctypes.data, 4096, 0)


def test_zero_byte_request(engine, rw_fd):
    buf = np.zeros(1, dtype=np.uint8)
    assert engine.submit_read(rw_fd, buf.ctypes.data, 0, 0).result(timeout=10) == 0


@pytest.mark.parametrize("name", ["threads", pytest.param("io_uring", marks=pytest.mark.requires_io_uring)])
def test_no_fd_leak_after_errors(name, tmp_path):
    before = open_fd_count()
    eng = _make(name)
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    buf = np.zeros(8192, dtype=np.uint8)
    failing = [eng.submit_read(fd, buf.ctypes.data, buf.size, 0), eng.submit_read(-1, buf.ctypes.data, 16, 0)]
    for future in failing:
        assert isinstance(future.exception(timeout=10), OSError)
    os.close(fd)
    eng.close()
    assert open_fd_count() == before


def _pieces(arrays):
    return tuple((a.ctypes.data, a.size) for a in arrays)


def test_vectored_requests_fill_one_file_range_from_several_buffers(engine, rw_fd):
    """Note [Adjacent storages, one request] in tba/runtime/_host_requests.py: a request's pieces land one
    after another in the file, and a vectored read puts them back; a read that meets the end of the file
    inside a piece reports the early end with the bytes it moved."""
    assert engine.vectored
    sources = [random_bytes(n, seed=n) for n in (512, 4096, 1536)]
    total = sum(a.size for a in sources)
    write = Request(Op.WRITE, rw_fd, sources[0].ctypes.data, total, 1024, pieces=_pieces(sources))
    assert engine.submit_many([write])[0].result(timeout=30) == total
    assert os.pread(rw_fd, total, 1024) == b"".join(a.tobytes() for a in sources)
    outs = [np.zeros_like(a) for a in sources]
    read = Request(Op.READ, rw_fd, outs[0].ctypes.data, total, 1024, pieces=_pieces(outs))
    assert engine.submit_many([read])[0].result(timeout=30) == total
    assert all(np.array_equal(a, b) for a, b in zip(sources, outs))
    tail = [np.zeros(3000, dtype=np.uint8), np.zeros(3000, dtype=np.uint8)]
    past_end = Request(Op.READ, rw_fd, tail[0].ctypes.data, 6000, 1024 + total - 1000, pieces=_pieces(tail))
    with pytest.raises(ShortTransferError, match="short read: 1000 of 6000 bytes"):
        engine.submit_many([past_end])[0].result(timeout=30)
    assert np.array_equal(tail[0][:1000], sources[2][-1000:])
    later = Request(Op.READ, rw_fd, tail[0].ctypes.data, 6000, 1024 + total - 4000, pieces=_pieces(tail))
    with pytest.raises(ShortTransferError, match="short read: 4000 of 6000 bytes"):
        engine.submit_many([later])[0].result(timeout=30)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_thread_engine_inherited_by_a_forked_child_moves_its_requests(tmp_path):
    """The pool's threads are the parent's: a request submitted in the child waited for ever (an offloader
    given backend=ThreadEngine(...) hung the child's first step)."""
    engine = ThreadEngine(workers=2)
    fd = os.open(tmp_path / "data", os.O_RDWR | os.O_CREAT, 0o600)
    data = aligned_empty(ALIGN_BYTES)
    data.fill(7)
    try:
        assert engine.submit_write(fd, data.ctypes.data, ALIGN_BYTES, 0).result() == ALIGN_BYTES
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = 0 if engine.submit_write(fd, data.ctypes.data, ALIGN_BYTES, ALIGN_BYTES).result(timeout=10) else 2
                engine.close()
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "the child's request never completed"
        assert os.pread(fd, ALIGN_BYTES, ALIGN_BYTES) == bytes([7]) * ALIGN_BYTES
    finally:
        engine.close()
        os.close(fd)


@pytest.mark.parametrize("workers, match", [(0, r"workers must be a whole number >= 1, got int 0"),
                                            (-1, r"got int -1"), ("2", r"got str '2'"), (2.0, r"got float 2\.0"),
                                            (True, r"got bool True")], ids=["zero", "negative", "str", "float", "bool"])
def test_a_thread_engine_with_bad_workers_is_a_config_error(workers, match):
    """``tba.ThreadEngine`` is public (``backend=tba.ThreadEngine(...)``), and ``workers=0`` raised a bare ValueError,
    ``workers="2"`` a TypeError from a comparison, ``workers=True`` built one thread: bad input is a TbaConfigError
    naming the fix (helper-168)."""
    with pytest.raises(TbaConfigError, match=match):
        ThreadEngine(workers=workers)
