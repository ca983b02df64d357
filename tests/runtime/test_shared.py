"""One-shot contexts share one spill file, engine and read pool per directory; tba.shutdown() closes them."""

from __future__ import annotations

import dataclasses
import errno
import os
import threading
import time

import pytest
import torch
from conftest import USABLE_BACKENDS
from python_runs import run_python

import tba
from tba import TbaError
from tba._control import settle
from tba.bench.models import PRESETS, make_batch, make_gpt
from tba.runtime import _shared
from tests.utils import run_step


def step(x: torch.Tensor, directory: str, backend: str) -> tuple[torch.Tensor, tba.Offloader]:
    xs = x.detach().clone().requires_grad_(True)
    with tba.offload_activations(directory, backend=backend, min_offload_bytes=0) as off:
        loss = (xs * 2).sin().exp().sum()
    loss.backward()
    return xs.grad, off


def test_successive_contexts_reuse_one_file_and_engine_and_shutdown_closes_them(spill_dir, backend, open_fds):
    x = torch.randn(64, 1024)
    xr = x.clone().requires_grad_(True)
    (xr * 2).sin().exp().sum().backward()
    want = xr.grad
    before = open_fds()
    grad, first = step(x, spill_dir, backend)
    opened = open_fds()
    assert opened > before and torch.equal(grad, want)
    runtimes = set()
    for _ in range(3):
        grad, off = step(x, spill_dir, backend)
        assert torch.equal(grad, want)
        assert open_fds() == opened, "a later context opened another file or engine"
        assert off.stats.tensors_offloaded == first.stats.tensors_offloaded
        runtimes.add(id(_shared._idle[off._shared_key][0]))
    assert len(runtimes) == 1 and _shared.idle_runtimes() == 1
    tba.shutdown()
    assert open_fds() == before and _shared.idle_runtimes() == 0
    grad, _ = step(x, spill_dir, backend)
    assert torch.equal(grad, want) and open_fds() == opened
    tba.shutdown()
    assert open_fds() == before


def test_reusable_offloaders_and_injected_engines_do_not_share(spill_dir):
    off = tba.Offloader(spill_dir, backend="threads", min_offload_bytes=0)
    assert off._shared_key is None
    off.close()


def test_concurrent_contexts_in_two_threads_use_two_files_and_stay_exact(spill_dir, backend, open_fds):
    before = open_fds()
    xs = [torch.randn(64, 1024) for _ in range(2)]
    wants = []
    for x in xs:
        xr = x.clone().requires_grad_(True)
        (xr * 2).sin().exp().sum().backward()
        wants.append(xr.grad)
    barrier = threading.Barrier(2)
    results: list[object] = [None, None]
    spills: list[object] = [None, None]

    def work(index: int) -> None:
        x = xs[index].clone().requires_grad_(True)
        with tba.offload_activations(spill_dir, backend=backend, min_offload_bytes=0) as off:
            barrier.wait()
            loss = (x * 2).sin().exp().sum()
            spills[index] = off.spill
            barrier.wait()
        loss.backward()
        results[index] = torch.equal(x.grad, wants[index])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [True, True]
    assert spills[0] is not spills[1], "two contexts at once shared one file"
    assert _shared.idle_runtimes() == 2
    tba.shutdown()
    assert open_fds() == before


def test_nested_contexts_use_two_files(spill_dir):
    x = torch.randn(64, 1024, requires_grad=True)
    with tba.offload_activations(spill_dir, backend="threads", min_offload_bytes=0) as outer:
        a = (x * 2).sin()
        with tba.offload_activations(spill_dir, backend="threads", min_offload_bytes=0) as inner:
            b = a.exp()
            assert inner.spill is not outer.spill
        loss = b.cos().sum()
    loss.backward()
    want = x.detach().clone().requires_grad_(True)
    (want * 2).sin().exp().cos().sum().backward()
    assert torch.equal(x.grad, want.grad)
    tba.shutdown()


def test_an_exception_in_the_block_gives_the_runtime_back(spill_dir, open_fds):
    before = open_fds()
    x = torch.randn(64, 1024, requires_grad=True)
    with pytest.raises(ValueError):
        with tba.offload_activations(spill_dir, backend="threads", min_offload_bytes=0) as off:
            loss = (x * 2).sin().sum()
            raise ValueError("boom")
    with pytest.raises(TbaError, match="discarded"):
        loss.backward()
    assert off._runtime is None and _shared.idle_runtimes() == 1
    grad, _ = step(x, spill_dir, "threads")
    assert _shared.idle_runtimes() == 1
    tba.shutdown()
    assert open_fds() == before


def test_a_dropped_loss_gives_the_runtime_back(spill_dir, open_fds):
    before = open_fds()
    x = torch.randn(64, 1024, requires_grad=True)
    with tba.offload_activations(spill_dir, backend="threads", min_offload_bytes=0) as off:
        loss = (x * 2).sin().sum()
    assert off._runtime is not None
    del loss
    settle()
    assert off._runtime is None and _shared.idle_runtimes() == 1
    tba.shutdown()
    assert open_fds() == before


def test_shutdown_while_a_context_runs_closes_its_runtime_when_it_ends(spill_dir, open_fds):
    before = open_fds()
    x = torch.randn(64, 1024, requires_grad=True)
    with tba.offload_activations(spill_dir, backend="threads", min_offload_bytes=0):
        loss = (x * 2).sin().sum()
    tba.shutdown()
    loss.backward()
    assert _shared.idle_runtimes() == 0 and open_fds() == before


def test_shutdown_leaves_no_reaper_thread(spill_dir, monkeypatch):
    """Note [Shutdown waits for the reaper it cancels]: a cancelled Timer's thread ends on its own, a moment later.
    Under load that moment outlasted shutdown(), and a test that counted threads after it found the reaper (CI, 1 of
    2,326). A Timer slow to end after its cancel makes the moment long."""

    class SlowToEnd(threading.Timer):
        def run(self):
            super().run()
            time.sleep(0.5)

    monkeypatch.setattr(_shared.threading, "Timer", SlowToEnd)
    tba.shutdown()
    threads = set(threading.enumerate())
    x = torch.randn(64, 1024, requires_grad=True)
    with tba.offload_activations(spill_dir, backend="threads", min_offload_bytes=0):
        loss = (x * 2).sin().sum()
    loss.backward()
    settle()
    assert any(isinstance(t, SlowToEnd) for t in threading.enumerate())  # the idle runtime's reaper waits
    tba.shutdown()
    assert not [t for t in threading.enumerate() if t not in threads and t.name != "tba-control"]


def test_idle_runtimes_close_after_the_idle_time(spill_dir, open_fds, monkeypatch):
    # Long enough that the runtime is still idle (given back on the control thread, not yet closed)
    # when the test looks, even on a loaded machine; short enough for the test to wait for its close.
    monkeypatch.setattr(tba.defaults, "RUNTIME_IDLE_CLOSE_S", 1.0)
    before = open_fds()
    step(torch.randn(64, 1024), spill_dir, "threads")
    settle()
    assert _shared.idle_runtimes() == 1
    for _ in range(500):
        if _shared.idle_runtimes() == 0 and open_fds() == before:
            break
        threading.Event().wait(0.01)
    assert _shared.idle_runtimes() == 0 and open_fds() == before


FORK_SCRIPT = """
import os, sys, torch, tba
from tba.runtime import _shared
torch.set_num_threads(1)  # torch's own OpenMP pool does not survive fork

def step(x):
    xs = x.clone().requires_grad_(True)
    with tba.offload_activations(sys.argv[1], backend="threads", min_offload_bytes=0):
        loss = (xs * 2).sin().exp().sum()
    loss.backward()
    return xs.grad

x = torch.randn(64, 1024)
want = step(x)
assert _shared.idle_runtimes() == 1  # settles the control thread, which gives the runtime back
parent_spill = _shared._idle[next(iter(_shared._idle))][0].spill
pid = os.fork()
if pid == 0:
    ok = parent_spill.closed and _shared.idle_runtimes() == 0 and torch.equal(step(x), want)
    os._exit(0 if ok and _shared.idle_runtimes() == 1 else 3)
_, status = os.waitpid(pid, 0)
assert os.waitstatus_to_exitcode(status) == 0, status
assert not parent_spill.closed and torch.equal(step(x), want)
tba.shutdown()
print("ok")
"""


def test_a_forked_child_drops_the_shared_runtime(spill_dir):
    proc = run_python(["-c", FORK_SCRIPT, spill_dir], timeout=120,
                      cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def test_first_step_peak_resident_is_within_ten_percent_of_steady_state(spill_dir, backend):
    config = dataclasses.replace(PRESETS["demo"], layers=3, batch_size=2)
    model = make_gpt(config)
    tokens, targets = make_batch(config)
    ref_loss, ref_grads = run_step(model, lambda m: m(tokens, targets))
    # What tba holds unwritten follows the disk's lag behind forward, which a loaded machine stretches
    # at any step (CI's two workers once held the first step's writes back to 2.25x the later steps').
    # A first step that holds more for a reason of tba's own does so in both of two fresh runtimes.
    attempts = []
    for _ in range(2):  # tba.shutdown() between: the second attempt starts a fresh runtime
        peaks = []
        for _ in range(4):
            off = tba.offload_activations(spill_dir, backend=backend)
            loss, grads = run_step(model, lambda m: m(tokens, targets), off)
            assert torch.equal(loss, ref_loss) and all(torch.equal(grads[k], ref_grads[k]) for k in ref_grads)
            peaks.append(off.stats.peak_resident_bytes)
        tba.shutdown()
        attempts.append(peaks)
        if peaks[0] <= 1.10 * max(peaks[1:]):
            return
    pytest.fail(f"the first step held more than the later ones, in two fresh runtimes: {attempts}")


def test_closing_a_finished_context_again_leaves_the_shared_file_open(spill_dir):
    x = torch.randn(64, 1024)
    _, first = step(x, spill_dir, "threads")
    first.close()
    first.close()
    grad, second = step(x, spill_dir, "threads")
    assert second.spill is first.spill and not second.spill.closed


def _idle_spill() -> tba.io.SpillFile:
    settle()
    return next(r for idle in _shared._idle.values() for r in idle).spill


def _wait_for(condition, timeout_s: float = 10.0) -> bool:
    for _ in range(int(timeout_s / 0.01)):
        if condition():
            return True
        threading.Event().wait(0.01)
    return condition()


def test_an_idle_runtime_keeps_its_space_for_the_next_step_then_gives_it_back(spill_dir, monkeypatch):
    """Issue 21, item 9 (ENOSPC for a checkpoint beside an idle file) and Note [Idle space is kept for the next step]."""
    monkeypatch.setattr(tba.defaults, "RUNTIME_IDLE_RELEASE_S", 3600.0)
    x = torch.randn(1024, 1024, requires_grad=True)
    want = x.detach().clone().requires_grad_(True)
    (want * 2).sin().exp().sum().backward()
    step(x, spill_dir, "threads")
    spill = _idle_spill()
    assert os.fstat(spill.fd).st_blocks > 0, "the idle file gave its space back although the next step comes at once"
    truncations = []
    real_truncate = type(spill)._truncate_locked
    monkeypatch.setattr(type(spill), "_truncate_locked", lambda self: (truncations.append(self), real_truncate(self)))
    grad, _ = step(x, spill_dir, "threads")
    assert torch.equal(grad, want.grad) and _idle_spill() is spill
    assert truncations == [], "the space was given back between two steps"
    monkeypatch.setattr(tba.defaults, "RUNTIME_IDLE_RELEASE_S", 0.05)
    grad, _ = step(x, spill_dir, "threads")
    assert _wait_for(lambda: os.fstat(spill.fd).st_blocks == 0), "the idle file still holds disk blocks"
    assert _shared.idle_runtimes() == 1, "giving the space back closed the runtime"
    grad, _ = step(x, spill_dir, "threads")
    assert torch.equal(grad, want.grad), "the next context after the space was given back is exact"
    tba.shutdown()


def test_an_idle_runtime_on_a_nearly_full_disk_gives_its_space_back_at_once(spill_dir, monkeypatch):
    monkeypatch.setattr(tba.defaults, "RUNTIME_IDLE_RELEASE_S", 3600.0)
    monkeypatch.setattr(tba.io.SpillFile, "short_of_space", lambda self: True)
    step(torch.randn(1024, 1024, requires_grad=True), spill_dir, "threads")
    spill = _idle_spill()
    # At once, or as soon as the last write's extent is freed (a few ms after the context ends).
    assert _wait_for(lambda: os.fstat(spill.fd).st_blocks == 0), "the idle file kept its blocks on a nearly full disk"
    tba.shutdown()


def test_a_new_file_on_a_full_disk_takes_the_idle_space_back(spill_dir, monkeypatch):
    """A checkpoint's preallocation that meets ENOSPC makes idle spill files give their space back, then retries."""
    from tba.io import _spill

    monkeypatch.setattr(tba.defaults, "RUNTIME_IDLE_RELEASE_S", 3600.0)
    step(torch.randn(1024, 1024, requires_grad=True), spill_dir, "threads")
    spill = _idle_spill()
    assert os.fstat(spill.fd).st_blocks > 0
    assert _wait_for(lambda: not spill._allocator.in_use), "the step's last extent was never freed"
    real = _spill.reserve
    calls = []

    def full_until_space_is_given_back(fd, offset, length):
        calls.append(fd)
        if fd != spill.fd and os.fstat(spill.fd).st_blocks:
            raise OSError(28, "No space left on device")
        real(fd, offset, length)

    monkeypatch.setattr(_spill, "reserve", full_until_space_is_given_back)
    path = os.path.join(spill_dir, "checkpoint.bin")
    fd, _ = tba.io.create_preallocated(path, 1 << 20)
    os.close(fd)
    os.unlink(path)
    assert len(calls) == 2 and os.fstat(spill.fd).st_blocks == 0
    tba.shutdown()


def test_short_of_space_reads_the_file_system(spill_dir, monkeypatch):
    spill = tba.io.SpillFile(spill_dir, direct=False)
    try:
        if spill.short_of_space():
            pytest.skip("the test directory's file system is nearly full")
        monkeypatch.setattr(tba.io._spill, "IDLE_SPACE_MIN_FREE_FRACTION", 1.0)
        assert spill.short_of_space(), "no file system has all of its blocks free"
    finally:
        spill.close()
    assert not spill.short_of_space()


FRESH_DIRECTORIES = """
import os, resource, sys, tempfile, threading, torch, tba
resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
root = sys.argv[1]
x = torch.randn(64, 1024, requires_grad=True)
for step in range(70):
    with tba.offload_activations(os.path.join(root, str(step)), backend=sys.argv[2], min_offload_bytes=0):
        loss = (x * 2).sin().sum()
    loss.backward()
from tba.runtime import _shared
print("idle", _shared.idle_runtimes(), "fds", len(os.listdir("/proc/self/fd")), "threads", threading.active_count())
"""


@pytest.mark.parametrize("backend", USABLE_BACKENDS)
def test_a_fresh_directory_per_step_neither_piles_up_runtimes_nor_runs_out_of_descriptors(tmp_path, backend):
    """Issue 21, item 9: 64 directories kept 128 fds and 64 threads for 30 s; with 64 descriptors step 30 failed."""
    proc = run_python(["-c", FRESH_DIRECTORIES, str(tmp_path), backend], timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    idle = int(proc.stdout.split()[1])
    assert idle <= tba.defaults.RUNTIME_IDLE_MAX


def test_a_spill_file_made_in_memory_is_not_kept_for_the_next_step(spill_dir, monkeypatch):
    """Note [A spill file in memory is not kept idle]: a disk with no room for the spill file (no inode left) at one
    step put the shared runtime's file in memory, and every later step used that file after the disk had room again:
    offloading saved no memory for the rest of the training."""
    from tba.io import _directory, _spill

    def full(directory, *, direct):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    x = torch.randn(64, 1024)
    want, _ = step(x, spill_dir, "threads")
    tba.shutdown()
    monkeypatch.setattr(_directory, "open_anonymous", full)
    monkeypatch.setattr(_spill, "open_anonymous", full)
    grad, off = step(x, spill_dir, "threads")
    settle()
    assert torch.equal(grad, want) and off.stats.tensors_offloaded > 0
    monkeypatch.undo()  # the disk has room again
    for _ in range(2):
        grad, off = step(x, spill_dir, "threads")
        settle()
        assert torch.equal(grad, want)
        idle = _shared._idle.get(off._shared_key, [])
        assert idle and not any(runtime.spill.in_memory for runtime in idle), "the next steps kept the file in memory"
    tba.shutdown()
