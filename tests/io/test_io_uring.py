"""io_uring-only behaviour: probing, fallback, fixed buffers, queueing beyond the ring's depth."""

from __future__ import annotations

import builtins
import errno
import itertools
import logging
import os
import threading
import time

import numpy as np
import pytest
import torch
from engine_helpers import random_bytes
from python_runs import run_python

import tba.io
from tba.errors import TbaConfigError
from tba.io import ThreadEngine, make_engine
from tba.io import _io_uring as io_uring_module
from tba.io._engine import Op, Request


def test_probe_reports_missing_extension(monkeypatch):
    real_import = builtins.__import__

    def no_uring(name, globals=None, locals=None, fromlist=(), level=0):
        if name == "tba" and fromlist and "_uring" in fromlist:
            raise ImportError("No module named 'tba._uring'")
        return real_import(name, globals, locals, fromlist, level)

    monkeypatch.setattr(builtins, "__import__", no_uring)
    monkeypatch.delitem(__import__("sys").modules, "tba._uring", raising=False)
    io_uring_module.probe.cache_clear()
    try:
        reason = io_uring_module.probe()
    finally:
        monkeypatch.undo()
        io_uring_module.probe.cache_clear()
    assert reason is not None and reason.startswith("extension not built")


def test_auto_falls_back_to_threads_with_one_log_line(monkeypatch, caplog):
    monkeypatch.setattr(tba.io, "io_uring_unavailable_reason", lambda: "test: no ring here")
    with caplog.at_level(logging.INFO, logger="tba"):
        engines = [make_engine("auto"), make_engine("auto")]
    assert all(isinstance(e, ThreadEngine) for e in engines)
    for e in engines:
        e.close()
    assert [r.getMessage() for r in caplog.records].count("tba: backend 'auto' uses threads: test: no ring here") == 1


@pytest.mark.requires_io_uring
def test_probe_ok_and_auto_picks_io_uring():
    assert io_uring_module.probe() is None
    engine = make_engine("auto", queue_depth=4)
    try:
        assert engine.name == "io_uring"
    finally:
        engine.close()


@pytest.mark.requires_io_uring
def test_queue_depth_validation():
    with pytest.raises(ValueError):
        io_uring_module.IoUringEngine(queue_depth=0)


@pytest.mark.requires_io_uring
def test_more_requests_than_slots(tmp_path):
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    engine = io_uring_module.IoUringEngine(queue_depth=1)
    try:
        data = random_bytes(200 * 512, seed=5)
        out = np.zeros_like(data)
        writes = [Request(Op.WRITE, fd, data.ctypes.data + i * 512, 512, i * 512) for i in range(200)]
        assert sum(f.result(timeout=30) for f in engine.submit_many(writes)) == data.size
        reads = [r._replace(op=Op.READ, address=out.ctypes.data + r.offset) for r in writes]
        assert sum(f.result(timeout=30) for f in engine.submit_many(reads)) == data.size
        assert np.array_equal(data, out)
    finally:
        engine.close()
        os.close(fd)


@pytest.mark.requires_io_uring
def test_close_from_completion_callback(tmp_path):
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    engine = io_uring_module.IoUringEngine(queue_depth=4)
    buf = np.ones(4096, dtype=np.uint8)
    try:
        future = engine.submit_write(fd, buf.ctypes.data, buf.size, 0)
        future.add_done_callback(lambda _: engine.close())
        assert future.result(timeout=10) == buf.size
        engine.close()
        with pytest.raises(RuntimeError):
            engine.submit_write(fd, buf.ctypes.data, buf.size, 0)
    finally:
        os.close(fd)


@pytest.mark.requires_io_uring
def test_requests_outlive_the_submitting_thread(tmp_path):
    """Threads that submit and exit at once must not take their requests with them."""
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    engine = io_uring_module.IoUringEngine(queue_depth=4)
    data = random_bytes(64 * 65536, seed=7)
    futures = []
    try:
        for part in range(8):
            requests = [
                Request(Op.WRITE, fd, data.ctypes.data + o, 65536, o)
                for o in range(part * 8 * 65536, (part + 1) * 8 * 65536, 65536)
            ]
            thread = threading.Thread(target=lambda reqs=requests: futures.extend(engine.submit_many(reqs)))
            thread.start()
            thread.join()
        assert sum(f.result(timeout=30) for f in futures) == data.size
        assert os.pread(fd, data.size, 0) == data.tobytes()
    finally:
        engine.close()
        os.close(fd)


@pytest.mark.requires_io_uring
def test_exit_waits_for_transfers_in_flight_but_not_forever():
    # Note [No transfer ends during finalization]: a read of an empty pipe stays in flight until
    # bytes arrive, as a slow disk's request would.
    r, w = os.pipe()
    engine = io_uring_module.IoUringEngine(queue_depth=4)
    buf = np.zeros(16, dtype=np.uint8)
    try:
        future = engine.submit_many([Request(Op.READ, r, buf.ctypes.data, buf.size, 0)])[0]
        assert not engine._wait_idle(0.05)  # in flight: waits the whole timeout, then gives up
        os.write(w, b"x" * buf.size)
        assert future.result(timeout=10) == buf.size
        assert engine._wait_idle(10.0)
    finally:
        engine.close()
        os.close(r)
        os.close(w)


@pytest.mark.requires_io_uring
def test_a_script_exits_after_its_transfers_or_after_the_bounded_wait(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "exit.py"
    script.write_text(
        "import os, sys, threading, time\n"
        "import numpy as np\n"
        "from tba.io import _io_uring as m\n"
        "from tba.io._engine import Op, Request\n"
        "m.EXIT_IO_WAIT_S = 0.3\n"
        "r, w = os.pipe()\n"
        "engine = m.IoUringEngine(queue_depth=4)\n"
        "buf = np.zeros(16, dtype=np.uint8)\n"
        "future = engine.submit_many([Request(Op.READ, r, buf.ctypes.data, 16, 0)])[0]\n"
        "future.add_done_callback(lambda f: print('read done', flush=True))\n"
        "if sys.argv[1] == 'answered':\n"
        "    timer = threading.Timer(0.2, os.write, (w, b'x' * 16))\n"
        "    timer.daemon = True  # not joined at exit: the bytes arrive while exit waits\n"
        "    timer.start()\n"
    )
    for case, warned in (("answered", False), ("never", True)):
        done = subprocess.run([sys.executable, str(script), case], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert ("still in flight" in done.stderr) is warned, done.stderr
        assert ("read done" in done.stdout) is not warned, (done.stdout, done.stderr)


def _io_uring_fds() -> set[int]:
    fds = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            if "io_uring" in os.readlink(f"/proc/self/fd/{name}"):
                fds.add(int(name))
        except OSError:
            pass
    return fds


def _io_uring_descriptors() -> int:
    return len(_io_uring_fds())


@pytest.mark.requires_io_uring
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_closes_a_ring_with_queued_vectored_requests():
    """Note [A forked child leaks what the parent's threads were changing] in native/uring_ring.h: the fork
    lands with every slot busy (reads from a pipe nobody writes) and vectored requests waiting in the
    queue; the child closes the inherited ring without walking that queue or freeing its pieces, and the
    parent's requests still complete once the pipe has data."""
    engine = io_uring_module.IoUringEngine(queue_depth=2)
    read_end, write_end = os.pipe()
    outs = [np.zeros(8, dtype=np.uint8) for _ in range(12)]
    done = []
    try:
        requests = [Request(Op.READ, read_end, outs[i].ctypes.data, 16, 0, owner=outs, pieces=_pieces(outs[i:i + 2]))
                    for i in range(0, 12, 2)]
        futures = engine.submit_many(requests)
        assert engine._ring.in_flight == 6
        status_read, status_write = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                engine.close()
                os.write(status_write, b"closed")
            finally:
                os._exit(0)
        os.close(status_write)
        _, status = os.waitpid(pid, 0)
        said = os.read(status_read, 100)
        os.close(status_read)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0 and said == b"closed", (status, said)
        os.write(write_end, b"x" * 96)
        done = [future.result(timeout=10) for future in futures]
    finally:
        os.close(write_end)
        engine.close()
        os.close(read_end)
    assert done == [16] * 6


@pytest.mark.requires_io_uring
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_closes_the_rings_it_inherited():
    """Note [A forked child closes the parent's rings]: the completion thread is blocked in reap() at the fork.

    Other libraries may hold rings of their own (libuv's, behind torch.distributed's TCPStore): the child
    keeps those, and only those."""
    before = _io_uring_descriptors()
    engine = make_engine("io_uring")
    assert _io_uring_descriptors() == before + 1
    tba_rings = sum(1 for e in io_uring_module._engines.alive() if not e._ring_closed)
    others = _io_uring_descriptors() - tba_rings
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            left = _io_uring_descriptors()
            try:
                engine.submit_many([Request(Op.READ, 0, 0, 4096, 0)])
                loud = False
            except RuntimeError:
                loud = True
            engine.close()
            os.write(write, f"{left} {loud}".encode())
        finally:
            os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    left, loud = os.read(read, 100).decode().split()
    os.close(read)
    assert int(left) == others, f"the child kept {int(left) - others} of the parent's io_uring descriptors"
    assert loud == "True", "the inherited engine accepted a request in the child"
    engine.close()
    assert _io_uring_descriptors() == before


def _pieces(arrays):
    return tuple((a.ctypes.data, a.size) for a in arrays)


@pytest.mark.requires_io_uring
@pytest.mark.parametrize("pieces, message", [
    ((), "1 to 1024 pieces"),
    (((4096, 0),), "piece of 0 bytes"),
    (((4096, 100),), "add up to 100 bytes, the request says 4096"),
    (("x",), "a piece must be"),
    (((4096, 2**64 - 4000), (4096, 8096)), "more than the request's 4096 bytes"),  # sums to 4096 mod 2**64
])
def test_bad_pieces_are_refused_and_nothing_is_queued(tmp_path, pieces, message):
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    engine = io_uring_module.IoUringEngine(queue_depth=2)
    buf = np.ones(4096, dtype=np.uint8)
    try:
        good = Request(Op.WRITE, fd, buf.ctypes.data, buf.size, 0)
        with pytest.raises((ValueError, TypeError), match=message):
            engine.submit_many([good, Request(Op.WRITE, fd, buf.ctypes.data, 4096, 0, pieces=pieces)])
        assert not engine._requests and engine._ring.in_flight == 0
        assert engine.submit_many([good])[0].result(timeout=10) == buf.size
    finally:
        engine.close()
        os.close(fd)


@pytest.mark.requires_io_uring
def test_a_vectored_read_cut_short_many_times_mid_piece_puts_every_byte_in_its_place():
    """A pipe hands a read whatever has arrived: the request's transfers end mid-piece again and again
    (and on a piece's edge), so each one must go on from the right byte of the right piece. A regular
    file only cuts a read at its end, where nothing is left to go on with."""
    sizes = (700, 1, 1500, 2300, 3)
    total = sum(sizes)
    data = random_bytes(total, seed=5).tobytes()
    outs = [np.zeros(n, dtype=np.uint8) for n in sizes]
    r, w = os.pipe()
    engine = io_uring_module.IoUringEngine(queue_depth=2)

    def trickle():
        for start in range(0, total, 333):
            os.write(w, data[start:start + 333])
            threading.Event().wait(0.002)

    writer = threading.Thread(target=trickle)
    try:
        future = engine.submit_many([Request(Op.READ, r, outs[0].ctypes.data, total, 0, pieces=_pieces(outs))])[0]
        writer.start()
        assert future.result(timeout=30) == total
        assert b"".join(a.tobytes() for a in outs) == data
    finally:
        if writer.ident is not None:
            writer.join()
        engine.close()
        os.close(r)
        os.close(w)


def _sq_state(ring_fd: int) -> tuple[int, int]:
    info = dict(line.split(":\t", 1) for line in open(f"/proc/self/fdinfo/{ring_fd}").read().splitlines() if ":\t" in line)
    return int(info["SqHead"]), int(info["SqTail"])


@pytest.mark.requires_io_uring
def test_a_failed_ring_hands_the_kernel_nothing_more_and_fails_nothing_the_kernel_holds(tmp_path):
    """Note [A failed ring lets go of nothing the kernel holds]. Two pipe reads hold both slots; a file read waits.
    The ring's descriptor is replaced, so the completion thread's flush of the waiting read, once the first pipe
    read completes, fails; then it is put back: a flush would now hand the kernel whatever was left queued."""
    (path := tmp_path / "f").write_bytes(b"y" * 8)
    fd = os.open(path, os.O_RDONLY)
    pipes = [os.pipe() for _ in range(2)]
    held, spare = [np.zeros(8, dtype=np.uint8) for _ in range(2)], np.zeros(16, dtype=np.uint8)
    before = _io_uring_fds()
    engine = io_uring_module.IoUringEngine(queue_depth=2)
    (ring_fd,) = _io_uring_fds() - before
    saved, null = os.dup(ring_fd), os.open(os.devnull, os.O_RDONLY)
    try:
        in_kernel = engine.submit_many([Request(Op.READ, r, buf.ctypes.data, 8, 0) for (r, _), buf in zip(pipes, held)])
        deadline = time.monotonic() + 10
        while (state := _sq_state(ring_fd))[0] < 2 or state[0] != state[1]:  # both reads handed to the kernel
            assert time.monotonic() < deadline
            time.sleep(0.001)
        waiting = engine.submit_many([Request(Op.READ, fd, spare.ctypes.data, 8, 0)])[0]
        os.dup2(null, ring_fd)
        os.write(pipes[0][1], b"x" * 8)
        assert in_kernel[0].result(timeout=10) == 8  # reaped with the failed flush of the waiting read
        os.dup2(saved, ring_fd)
        with pytest.raises(OSError):
            engine.submit_many([Request(Op.READ, fd, spare.ctypes.data + 8, 8, 0)])
        time.sleep(0.05)
        assert not in_kernel[1].done(), "a read the kernel still holds was reported failed"
        os.write(pipes[1][1], b"z" * 8)
        assert in_kernel[1].result(timeout=10) == 8 and held[1].tobytes() == b"z" * 8
        with pytest.raises(RuntimeError, match="io_uring engine failed"):
            waiting.result(timeout=10)
        assert not spare.any(), "the kernel read into the memory of a request reported failed"
    finally:
        os.dup2(saved, ring_fd)
        engine.close()
        for descriptor in (fd, saved, null, *itertools.chain(*pipes)):
            os.close(descriptor)


OUT_OF_DESCRIPTORS = """
import os, resource, sys, torch, tba
d, case = sys.argv[1], sys.argv[2]
x = torch.randn(64, 1024, requires_grad=True)
def step(**options):
    with tba.offload_activations(d, min_offload_bytes=0, **options) as offloader:
        loss = (x * 2).sin().sum()
    loss.backward()
    return offloader.resolved_backend
step(backend="threads" if case == "probe" else "auto", queue_depth=4)  # an idle runtime, modules imported
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
if case == "probe":
    tba.shutdown()
lowest = os.open(os.devnull, os.O_RDONLY)
os.close(lowest)
resource.setrlimit(resource.RLIMIT_NOFILE, (lowest + (case == "ring"), hard))
try:
    print("tight", step())
except tba.TbaError as err:
    print("tight", type(err).__name__)
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
print("then", step())
"""


@pytest.mark.requires_io_uring
@pytest.mark.parametrize("case", ["ring", "probe"])
def test_a_process_out_of_descriptors_gets_io_uring_once_it_has_them(tmp_path, case):
    """A ring that cannot get a descriptor is an OutOfDescriptorsError, and the io_uring probe keeps no such answer.

    ``ring``: one descriptor free, an idle runtime holding two; the spill file took the free one and
    ``_uring.Ring`` failed with a bare ``OSError`` (EMFILE), where the shared runtimes close their idle ones
    and open again. ``probe``: the first probe ran with no descriptor free, kept "extension not built: ...
    Too many open files", and backend 'auto' used threads for the rest of the process.
    """
    proc = run_python(["-c", OUT_OF_DESCRIPTORS, str(tmp_path), case], timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = dict(line.split() for line in proc.stdout.splitlines())
    assert lines["tight"] == ("io_uring" if case == "ring" else "OutOfDescriptorsError"), proc.stdout
    assert lines["then"] == "io_uring", proc.stdout
    assert "O_DIRECT" not in proc.stderr, proc.stderr[-3000:]


@pytest.mark.requires_io_uring
@pytest.mark.parametrize("field, value", [
    ("tag", 2**64 + 5), ("tag", -1), ("nbytes", 2**64 + 16), ("nbytes", -1),
    ("offset", -1), ("offset", 2**63), ("piece", 2**64 + 16),
])
def test_submit_refuses_integers_that_do_not_fit_instead_of_wrapping_them(tmp_path, field, value):
    """``tba._uring`` took the tag, sizes and offset modulo 2**64 (format ``K``): tag ``2**64 + 5`` came back as 5,
    the completion of another request; ``nbytes`` -1 asked the kernel for 2**64 - 1 bytes at the address; offset -1
    is io_uring's "the file's current position" (helper-102). Each is refused, and nothing is queued."""
    from tba import _uring

    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)  # empty: a read that gets through moves nothing
    buf = np.zeros(16, dtype=np.uint8)
    entry = {"tag": 1, "nbytes": 16, "offset": 0, "piece": None}
    entry[field] = value
    address = buf.ctypes.data if entry["piece"] is None else ((buf.ctypes.data, entry["piece"]),)
    ring = _uring.Ring(2)
    try:
        with pytest.raises((OverflowError, ValueError)):
            ring.submit([(0, fd, address, entry["nbytes"], entry["offset"], entry["tag"])])
        assert ring.in_flight == 0
    finally:
        while ring.in_flight:
            ring.reap()
        ring.close()
        os.close(fd)


@pytest.mark.requires_io_uring
@pytest.mark.parametrize("depth", [2**32 + 4, -2**32 + 4])
def test_a_ring_refuses_a_depth_that_does_not_fit(depth):
    """``Ring(2**32 + 4)`` was a ring of depth 4 (format ``I`` takes the value modulo 2**32)."""
    from tba import _uring

    with pytest.raises((OverflowError, ValueError, OSError)):
        _uring.Ring(depth).close()


@pytest.mark.requires_io_uring
def test_a_ring_closed_while_submit_reads_its_entries_takes_none_of_them(tmp_path):
    """``submit`` reads its entries with the GIL held, but an entry's ``__index__`` (or a pieces sequence's
    ``__iter__``) is Python: it, or a thread it lets run, may close the ring. ``submit`` then queued the request
    on the closed ring (its mutex destroyed, its queue allocated anew and never freed) and returned: a request
    accepted that nothing would ever finish (helper-102)."""
    from tba import _uring

    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    buf = np.zeros(16, dtype=np.uint8)
    ring = _uring.Ring(2)

    class ClosingFd:
        def __index__(self):
            ring.close()
            return fd

    try:
        with pytest.raises(ValueError, match="ring is closed"):
            ring.submit([(0, ClosingFd(), buf.ctypes.data, 16, 0, 1)])
    finally:
        ring.close()
        os.close(fd)


@pytest.mark.requires_io_uring
def test_a_second_thread_cannot_reap_a_ring_another_thread_reaps():
    """The ring has one reaper (``native/uring_ring.h``): two threads in ``reap`` at once took the same completions,
    finished the same slots twice (past the end of the free-slot stack) and lost others; a script reaping from
    two threads died with a segmentation fault (helper-102). The second one is refused."""
    from tba import _uring

    ring = _uring.Ring(2)
    outcomes: list = []

    def reap():
        try:
            outcomes.append(ring.reap())
        except RuntimeError as err:
            outcomes.append(err)

    threads = [threading.Thread(target=reap) for _ in range(2)]
    for thread in threads:
        thread.start()
    try:
        deadline = time.monotonic() + 5
        while not outcomes and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(outcomes) == 1 and isinstance(outcomes[0], RuntimeError), outcomes
    finally:
        deadline = time.monotonic() + 10
        while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
            ring.wake()
            time.sleep(0.01)
        for thread in threads:
            thread.join(1)
        ring.close()


@pytest.mark.requires_io_uring
def test_a_completion_callback_that_raises_fails_nothing_else(tmp_path, caplog):
    """Note [A completion callback's error fails nothing else] in tba/io/_io_uring.py: a callback that raised ended
    the completion thread's loop. The callbacks after it in the same batch (their requests already taken from the
    engine's table) never ran, a pipe read the kernel still held was reported failed, and the engine refused
    every later request (helper-102)."""
    (path := tmp_path / "f").write_bytes(b"y" * 16)
    fd = os.open(path, os.O_RDONLY)
    r, w = os.pipe()
    held, buf = np.zeros(8, dtype=np.uint8), np.zeros(16, dtype=np.uint8)
    engine = io_uring_module.IoUringEngine(queue_depth=4)
    heard: list = []
    done = threading.Event()

    def raises(error):
        raise ValueError("a callback's own bug")

    def records(error):
        heard.append(error)
        done.set()

    try:
        in_kernel = engine.submit_many([Request(Op.READ, r, held.ctypes.data, 8, 0)])[0]
        with caplog.at_level(logging.ERROR, logger="tba"):
            engine.submit_calls([Request(Op.READ, fd, buf.ctypes.data, 8, 0), Request(Op.READ, fd, buf.ctypes.data + 8, 8, 8)],
                                [raises, records])
            assert done.wait(10), "the callback after the one that raised never ran"
        assert heard == [None]
        assert "a callback's own bug" in caplog.text
        time.sleep(0.05)
        assert not in_kernel.done(), "a read the kernel still holds was reported failed"
        assert engine.submit_many([Request(Op.READ, fd, buf.ctypes.data, 16, 0)])[0].result(timeout=10) == 16
        os.write(w, b"z" * 8)
        assert in_kernel.result(timeout=10) == 8 and held.tobytes() == b"z" * 8
    finally:
        if not in_kernel.done():
            os.write(w, b"z" * 8)
        engine.close()
        for descriptor in (fd, r, w):
            os.close(descriptor)


@pytest.mark.requires_io_uring
def test_an_interrupt_while_the_completion_thread_starts_leaves_no_ring_or_thread(monkeypatch):
    # Thread.start() waits for the new thread to run, and a Ctrl-C landing in that wait (tba.checkpoint.load builds
    # its engine in the caller's thread) raised out of the constructor with the thread running: it sat in reap() for
    # ever, its ring open, with no engine left to close it (found by a review: SIGINT at random during saves and loads).
    class InterruptedStart(threading.Thread):
        def start(self):
            super().start()
            raise KeyboardInterrupt

    def fds() -> list[str]:
        return sorted(os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
                      if os.path.exists(f"/proc/self/fd/{fd}"))

    before = fds()
    monkeypatch.setattr(io_uring_module.threading, "Thread", InterruptedStart)
    with pytest.raises(KeyboardInterrupt):
        io_uring_module.IoUringEngine(queue_depth=4)
    monkeypatch.undo()
    left = [t for t in threading.enumerate() if isinstance(t, InterruptedStart)]
    for thread in left:
        thread.join(timeout=5)
    assert not any(thread.is_alive() for thread in left)
    assert fds() == before


@pytest.mark.requires_io_uring
def test_a_ring_the_kernel_refuses_is_a_config_error_and_auto_uses_threads(spill_dir, monkeypatch, caplog):
    """The probe's two-entry ring worked, the engine's own ring did not: on kernels before 5.12 a ring's memory counts
    against the locked-memory limit (ulimit -l), so a deep queue fails with ENOMEM. The bare OSError reached the
    user's with line, and backend='auto' did not fall back to threads (Note [A ring the kernel refuses])."""
    from tba import _uring

    real = _uring.Ring

    def refusing(depth: int) -> object:
        if depth > 2:
            raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))
        return real(depth)

    monkeypatch.setattr(_uring, "Ring", refusing)
    with pytest.raises(TbaConfigError, match=r"io_uring ring of 64 entries.*ulimit -l.*backend='threads'"):
        make_engine("io_uring", queue_depth=64)
    with caplog.at_level(logging.INFO, logger="tba"):
        engine = make_engine("auto", queue_depth=64)
    engine.close()
    assert isinstance(engine, ThreadEngine) and "backend 'auto' uses threads" in caplog.text
    x = torch.randn(64, 1024, requires_grad=True)
    with tba.offload_activations(spill_dir, backend="auto", queue_depth=64, min_offload_bytes=0) as offloader:
        loss = (x * 2).sin().sum()
    loss.backward()
    assert offloader.resolved_backend == "threads"


@pytest.mark.requires_io_uring
def test_a_completion_thread_that_runs_after_an_interrupted_constructor_ends_quietly(monkeypatch, caplog):
    # The interrupt can land after the thread was created and before it ran (Thread.ident still None): the constructor
    # closed the ring, and the thread, once it ran, reaped the closed ring and logged 'io_uring completion thread failed'
    # with ValueError('ring is closed'); closed while the thread was in reap(), close() raised RuntimeError instead of
    # the interrupt. Here the thread runs only after the constructor has raised.
    late: list[threading.Thread] = []

    class LateStart(threading.Thread):
        def start(self):
            late.append(self)
            raise KeyboardInterrupt

    monkeypatch.setattr(io_uring_module.threading, "Thread", LateStart)
    with pytest.raises(KeyboardInterrupt):
        io_uring_module.IoUringEngine(queue_depth=4)
    monkeypatch.undo()
    with caplog.at_level(logging.ERROR, logger="tba"):
        threading.Thread.start(late[0])
        late[0].join(timeout=10)
    assert not late[0].is_alive()
    assert not [record for record in caplog.records if record.levelno >= logging.ERROR], caplog.text


_CLOSED_IN_REAP = """
import gc, os, sys, time
import numpy as np
from tba import _uring
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
buf = np.zeros(4096, dtype=np.uint8)
for k in range(8):  # the collection lands at the k-th object reap makes (its list, a tuple per request, its result)
    ring = _uring.Ring(8)
    ring.submit([(1, fd, buf.ctypes.data, 4096, 0, tag) for tag in range(4)])

    class Closes:
        def __del__(self, ring=ring):
            try:
                ring.close()
            except RuntimeError:
                print("refused", flush=True)

    time.sleep(0.2)  # the writes done: one reap takes them all
    finished = []
    gc.collect()
    gc.disable()
    cycle = Closes()
    cycle.cycle = cycle
    del cycle
    gc.enable()
    gc.set_threshold(gc.get_count()[0] + k)
    while len(finished) < 4 and not ring.closed:
        finished += ring.reap()[0]
    gc.set_threshold(700)
    gc.collect()
    ring.close()
print("done", flush=True)
"""


@pytest.mark.requires_io_uring
def test_a_ring_closed_by_a_finalizer_while_reap_builds_its_result_is_refused_not_freed_under_it(tmp_path):
    """``reap`` built its result (objects that may start a collection, whose finalizers are Python) after it had
    marked the ring free: a finalizer that closed the ring then freed the scratch results ``reap`` was reading, a
    segmentation fault; and a thread the finalizer let run could reap into them. The ring stays in use until
    ``reap`` returns: that ``close`` is refused (Note [A reaper reads its results in use] in native/tba_uring.c)."""
    done = run_python(["-c", _CLOSED_IN_REAP, str(tmp_path / "f")], timeout=120)
    assert done.returncode == 0 and done.stdout.endswith("done\n") and "refused" in done.stdout, (
        done.returncode, done.stdout, done.stderr)


_CLEARED_IN_SUBMIT = """
import gc, os, sys
import numpy as np
from tba import _uring
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
buf = np.zeros(4096, dtype=np.uint8)
address = buf.ctypes.data
ring = _uring.Ring(4)
cleared = []

class Clears:
    def __index__(self):
        cleared[0].clear()
        gc.collect()
        return cleared[1]

if sys.argv[2] == "requests":
    entries = [(1, fd, address, 16, Clears(), 1)] + [(1, fd, address, 16, 0, tag) for tag in range(2, 2000)]
    cleared[:] = entries, 0
    ring.submit(entries)
    expected = 1999
else:
    pieces = [(Clears(), 8)] + [(address + 8 * i, 8) for i in range(1, 500)]
    cleared[:] = pieces, address
    ring.submit([(1, fd, pieces, 8 * 500, 0, 1)])
    expected = 1
reaped = []
while len(reaped) < expected:
    reaped += ring.reap()[0]
ring.close()
print("done", sorted(set(result for _, result, _ in reaped)), flush=True)
"""


@pytest.mark.requires_io_uring
@pytest.mark.parametrize("cleared", ["requests", "pieces"])
def test_a_list_cleared_while_submit_reads_it_is_read_as_it_was(tmp_path, cleared):
    """Note [Entries read from a snapshot] in native/tba_uring.c: an entry's ``__index__`` that cleared the list of
    requests (or of a request's pieces) made ``submit`` read past the list's end and its freed items, a segmentation
    fault. The entries are read as they were when ``submit`` was called."""
    done = run_python(["-c", _CLEARED_IN_SUBMIT, str(tmp_path / "f"), cleared], timeout=120)
    result = "[16]" if cleared == "requests" else "[4000]"
    assert done.returncode == 0 and done.stdout == f"done {result}\n", (done.returncode, done.stdout, done.stderr)
