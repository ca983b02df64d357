"""Offloaded host storages give their pages back to the kernel once tba holds their last reference."""

from __future__ import annotations

import time

import pytest
import torch

import tba
from tba import defaults
from tba.runtime import _trim


def test_discard_pages_zeroes_whole_pages_inside_the_range_only():
    buf = torch.full((5 * 4096,), 7, dtype=torch.uint8)
    address = buf.data_ptr()
    start = 100
    given = _trim.discard_pages(address + start, 3 * 4096)
    first = -(-(address + start) // 4096) * 4096 - address
    last = (address + start + 3 * 4096) // 4096 * 4096 - address
    assert given == last - first
    assert bool((buf[first:last] == 0).all())
    assert bool((buf[:first] == 7).all()) and bool((buf[last:] == 7).all())


def test_sole_owner_counts_tensors_not_weak_references():
    from torch.multiprocessing.reductions import StorageWeakRef

    t = torch.ones(1024)
    ref = StorageWeakRef(t.untyped_storage())
    holder = torch.empty((0,), dtype=torch.uint8).set_(t.untyped_storage())
    assert not _trim.sole_owner(ref.cdata)
    del t
    assert _trim.sole_owner(ref.cdata)
    del holder


def test_a_tensor_the_program_still_uses_is_never_discarded(spill_dir, backend):
    x = torch.randn(256, 1024, requires_grad=True)
    with tba.offload_activations(spill_dir, backend=backend, min_offload_bytes=0) as off:
        y = x.exp()
        loss = y.sin().sum()
        off.flush()
    snapshot = y.detach().clone()
    assert torch.equal(y, snapshot) and torch.equal(y, x.detach().exp())
    loss.backward()
    assert torch.equal(x.grad, (x.detach().exp().cos() * x.detach().exp()))


def _trims_once(trimmer: _trim.HeapTrimmer) -> bool:
    """Whether the trimmer's background thread has trimmed exactly once within 2 s."""
    for _ in range(200):
        if trimmer.trims:
            break
        time.sleep(0.01)
    return trimmer.trims == 1


def test_the_trimmer_trims_after_enough_bytes():
    trimmer = _trim.HeapTrimmer(every_bytes=1024)
    if not trimmer.available:
        return
    trimmer.note_released(512)
    assert trimmer.trims == 0
    trimmer.note_released(512)
    assert _trims_once(trimmer)


def test_the_process_trimmer_reads_its_interval_from_the_environment(monkeypatch, caplog):
    """The process's trimmer follows $TBA_HEAP_TRIM_EVERY_BYTES as read by its last refresh (an offloader's entry);
    off (0) when unset (Note [The trim interval is read once per with block])."""
    monkeypatch.delenv(_trim.HEAP_TRIM_ENV, raising=False)
    assert _trim.heap_trim_every_bytes() == defaults.HEAP_TRIM_EVERY_BYTES == 0
    monkeypatch.setenv(_trim.HEAP_TRIM_ENV, "256M")
    assert _trim.heap_trim_every_bytes() == 256 << 20
    monkeypatch.setattr(_trim, "_hand_back", True)
    trimmer = _trim.HeapTrimmer()
    if not trimmer.available:
        pytest.skip("this C library has no malloc_trim")
    monkeypatch.setenv(_trim.HEAP_TRIM_ENV, "1K")
    trimmer.note_released(1024)
    assert trimmer.trims == 0  # read when it was made (256M), not at each release
    trimmer.refresh()
    trimmer.note_released(1024)
    assert _trims_once(trimmer)
    monkeypatch.setenv(_trim.HEAP_TRIM_ENV, "lots")
    monkeypatch.setattr(_trim, "_warned_env", False)
    with caplog.at_level("WARNING", logger="tba"):
        assert _trim.heap_trim_every_bytes() == 0
        assert _trim.heap_trim_every_bytes() == 0
    assert len([r for r in caplog.records if _trim.HEAP_TRIM_ENV in r.getMessage()]) == 1


def test_only_storages_of_discard_min_bytes_give_their_pages_back(spill_dir):
    """Note [Small storages keep their pages]: a 64 KiB storage is only freed, a 1 MiB one is discarded first."""
    if not _trim.hands_back_pages():
        pytest.skip("a caching allocator: tba discards no pages")
    assert 64 * 1024 < defaults.DISCARD_MIN_BYTES <= 1 << 20
    small = torch.randn(16 * 1024, requires_grad=True)
    large = torch.randn(256 * 1024, requires_grad=True)
    with tba.offload_activations(spill_dir, backend="threads", min_offload_bytes=0) as off:
        store = off._store
        a = small.exp().sum()  # exp saves its output, which only autograd (through tba) holds
        b = large.exp().sum()
        off.flush()
    discarded = store.pages_discarded_bytes  # the end of forward has swept any written storage left lingering
    (a + b).backward()
    # The 1 MiB storage gives 255 or 256 whole pages (its alignment), the 64 KiB one would add 15 or 16 more.
    assert discarded >= (1 << 20) - 4096, f"a 1 MiB storage tba alone held kept its pages ({discarded} bytes given)"
    assert discarded <= 1 << 20, f"a storage below DISCARD_MIN_BYTES had its pages handed back ({discarded} bytes given)"
    assert torch.equal(small.grad, small.detach().exp()) and torch.equal(large.grad, large.detach().exp())


def test_entering_an_offloader_reads_the_trim_interval_again(monkeypatch, spill_dir):
    """Note [The trim interval is read once per with block]: a variable set between two steps counts from the next."""
    monkeypatch.setattr(_trim.trimmer, "_setting", 0)
    monkeypatch.setenv(_trim.HEAP_TRIM_ENV, "64M")
    assert _trim.trimmer._setting == 0
    with tba.offload_activations(spill_dir, backend="threads"):
        pass
    assert _trim.trimmer._setting == 64 << 20
    monkeypatch.delenv(_trim.HEAP_TRIM_ENV)
    with tba.offload_activations(spill_dir, backend="threads"):
        pass
    assert _trim.trimmer._setting == 0


def test_importing_tba_starts_no_process():
    # Note [import tba imports torch on first use]: the runtime (and _trim) is imported by the first use.
    # ctypes.util.find_library("c") ran `ldconfig -p` twice per `import tba`: a fork of a process holding torch.
    import subprocess
    import sys

    probe = ("import sys; started = []\n"
             "sys.addaudithook(lambda event, args: started.append(event) if event in "
             "('subprocess.Popen', 'os.fork', 'os.posix_spawn', 'os.exec', 'os.system') else None)\n"
             "import tba\ntba.offload_activations\nprint(started)")  # a first use: `import tba` alone imports no _trim
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout
    assert _trim._madvise is not None and tba.runtime._trim.trimmer._trim is not None  # glibc's, found by its soname
