"""The spill file's bookkeeping stays true to the file when an asynchronous exception (Ctrl-C)
lands while it gives its space back (Note [The file is truncated last] in ``tba/io/_spill.py``)."""

from __future__ import annotations

import errno
import os
import subprocess
import sys

import pytest

from tba.defaults import SPILL_RESERVE_MIN_BYTES
from tba.io import SpillFile, _spill, release_idle_space


def _interrupt_right_after_the_truncation() -> list[int]:
    """Trace this thread; raise ``KeyboardInterrupt`` (as a SIGINT handler would) at the first event of
    ``_truncate_locked`` after its ``os.ftruncate`` line has run. Returns a list that is non-empty once it struck."""
    struck: list[int] = []
    state = {"after": False}

    def local(frame, event, arg):
        if struck:
            return None
        if state["after"]:
            struck.append(frame.f_lineno)
            sys.settrace(None)
            raise KeyboardInterrupt
        if event == "line":
            import linecache

            state["after"] = "os.ftruncate" in linecache.getline(frame.f_code.co_filename, frame.f_lineno)
        return local

    def trace(frame, event, arg):
        return local if frame.f_code.co_name == "_truncate_locked" else None

    sys.settrace(trace)
    return struck


def test_an_interrupted_release_leaves_the_reservation_true_to_the_file(tmp_path):
    spill = SpillFile(str(tmp_path), direct=False)
    if not spill._reserve:
        spill.close()
        pytest.skip("this file system takes no reservation (memory-backed)")
    try:
        spill.free(spill.allocate(1 << 20))
        assert spill.reserved_bytes > 0 and os.fstat(spill.fd).st_size >= spill.reserved_bytes
        struck = _interrupt_right_after_the_truncation()
        try:
            release_idle_space()
        except KeyboardInterrupt:
            pass
        finally:
            sys.settrace(None)
        assert struck, "the interrupt never landed"
        assert os.fstat(spill.fd).st_size >= spill.reserved_bytes, (
            "the file was truncated but its reservation is still counted: later steps skip fallocate")
        spill.allocate(1 << 20)
        assert os.fstat(spill.fd).st_size >= spill.reserved_bytes > 0
    finally:
        spill.close()


def _loop_file_system(tmp_path, kind: str, size_bytes: int):
    """A ``kind`` file system of ``size_bytes`` on a loop device (needs root); yields its mount point."""
    image, mount_point = tmp_path / "disk.img", tmp_path / "disk"
    mount_point.mkdir()
    with open(image, "wb") as stream:
        stream.truncate(size_bytes)
    for command in ([f"mkfs.{kind}", "-q", "-F", str(image)], ["mount", "-o", "loop", str(image), str(mount_point)]):
        try:
            done = subprocess.run(command, capture_output=True)
        except OSError as err:
            pytest.skip(f"cannot make an {kind} file system: {err}")
        if done.returncode != 0:
            pytest.skip(f"cannot make an {kind} file system: {done.stderr.decode().strip()}")
    try:
        yield str(mount_point)
    finally:
        subprocess.run(["umount", str(mount_point)], check=False)


@pytest.fixture
def small_ext4(tmp_path):
    """A 16 MiB ext4 file system, far smaller than one reservation step."""
    yield from _loop_file_system(tmp_path, "ext4", 16 << 20)


@pytest.fixture
def ext2(tmp_path):
    """ext2 has no fallocate (no extents), as NFSv3 and many FUSE file systems; room for one reservation step."""
    yield from _loop_file_system(tmp_path, "ext2", SPILL_RESERVE_MIN_BYTES + (64 << 20))


def _free_bytes(directory: str) -> int:
    stat = os.statvfs(directory)
    return stat.f_bavail * stat.f_frsize


def _free_space_while_reserving(monkeypatch, module, directory: str) -> list[int]:
    """``module.reserve`` (the spill file's, or the bandwidth probe's) records the free space of ``directory`` at each
    call's end, before its caller can give blocks back: what another writer of the disk finds then."""
    real = _spill.reserve
    seen: list[int] = []

    def watched(fd, offset, length):
        try:
            real(fd, offset, length)
        finally:
            seen.append(_free_bytes(directory))

    monkeypatch.setattr(module, "reserve", watched)
    return seen


def test_a_reservation_the_disk_cannot_hold_takes_none_of_its_space(small_ext4):
    """ext4's fallocate, failing with ENOSPC, keeps the blocks it got: a 1 MiB extent held the whole disk."""
    spill = SpillFile(small_ext4)
    try:
        before = _free_bytes(small_ext4)
        spill.allocate(1 << 20)
        assert not spill._reserve and spill.reserved_bytes == 0
        assert os.fstat(spill.fd).st_blocks * 512 <= spill.reserved_bytes
        assert _free_bytes(small_ext4) >= before - (1 << 20), "the failed reservation kept the disk's free space"
    finally:
        spill.close()


def test_a_reservation_refused_for_want_of_space_is_made_again_once_the_file_is_idle(tmp_path, monkeypatch):
    """A disk full for one step (a checkpoint there) left every later step growing the file by extending writes."""
    spill = SpillFile(str(tmp_path), direct=False)
    try:
        if not spill._reserve:
            pytest.skip("this file system takes no reservation (memory-backed)")

        def full(fd, offset, length):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(_spill, "reserve", full)
        spill.free(spill.allocate(1 << 20))
        assert spill.reserved_bytes == 0
        monkeypatch.undo()
        assert spill.release_space()
        spill.allocate(1 << 20)
        assert spill.reserved_bytes >= 1 << 20
    finally:
        spill.close()


def test_a_file_system_without_fallocate_gets_no_reservation_written_as_zeros(ext2):
    """glibc's posix_fallocate, where the file system has no fallocate, writes a byte into every block: a 1 MiB
    extent of a buffered spill file wrote 256 MiB of zeros first (1.2 s here; over NFSv3, 65,536 round trips)."""
    spill = SpillFile(ext2, direct=False)
    try:
        spill.allocate(1 << 20)
        assert not spill._reserve and spill.reserved_bytes == 0
        assert os.fstat(spill.fd).st_blocks * 512 < 1 << 20
    finally:
        spill.close()


def _no_room_for_a_file(monkeypatch):
    """Opening any file in the directory fails as on a file system out of inodes."""
    from tba.io import _directory

    def full(directory, *, direct):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(_directory, "open_anonymous", full)
    monkeypatch.setattr(_spill, "open_anonymous", full)


def test_a_disk_with_no_room_for_the_spill_file_spills_into_memory(tmp_path, monkeypatch, caplog):
    """Note [A disk too full for the spill file spills into memory]: the spill file could not be created (no inode
    left), and entering the offloader raised a TbaConfigError, where a disk full at a write keeps the tensor in memory
    and training goes on. Now the file lives in memory, with one warning, reserves nothing, and moves bytes."""
    _no_room_for_a_file(monkeypatch)
    with caplog.at_level("WARNING", logger="tba"):
        spills = [SpillFile(str(tmp_path), direct=None) for _ in range(2)]
    try:
        spill = spills[0]
        assert spill.in_memory and not spill.direct
        offset = spill.allocate(8192)
        assert spill.reserved_bytes == 0, "a file in memory reserves nothing ahead"
        assert os.pwrite(spill.fd, b"x" * 8192, offset) == 8192 and os.pread(spill.fd, 8192, offset) == b"x" * 8192
    finally:
        for spill in spills:
            spill.close()
    warnings = [r.getMessage() for r in caplog.records if "file in memory" in r.getMessage()]
    assert len(warnings) == 1 and "No space left on device" in warnings[0], warnings


def test_training_goes_on_exact_when_the_spill_file_cannot_be_created(tmp_path, monkeypatch):
    import torch

    import tba

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Tanh(), torch.nn.Linear(256, 256))
    x = torch.randn(64, 256)
    model(x).square().sum().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    _no_room_for_a_file(monkeypatch)
    with tba.offload_activations(str(tmp_path), min_offload_bytes=0) as off:
        loss = model(x).square().sum()
    loss.backward()
    assert off.stats.tensors_offloaded > 0  # through the file in memory (its writes may still run: not counted here)
    assert all(torch.equal(p.grad, e) for p, e in zip(model.parameters(), expected))


def test_checkpoint_and_scratch_files_write_no_zeros_where_the_file_system_has_no_fallocate(tmp_path, monkeypatch):
    """Note [No reservation written as zeros]: checkpoint files (``create_preallocated``) and the bandwidth probe's
    scratch file (``open_scratch``) still reserved with glibc's posix_fallocate, which on ext2, NFSv3 or FUSE writes
    a byte into every block of the file first (a whole checkpoint's size in zeros). Where fallocate(2) says
    EOPNOTSUPP they now go on without a reservation, and posix_fallocate is never called."""
    import ctypes

    from tba.io import _bandwidth

    def unsupported(fd, mode, offset, length):
        ctypes.set_errno(errno.EOPNOTSUPP)
        return -1

    def zeros(*args):
        raise AssertionError("posix_fallocate called: it writes zeros where the file system has no fallocate")

    monkeypatch.setattr(_spill, "_fallocate", unsupported)
    monkeypatch.setattr(os, "posix_fallocate", zeros)
    fd, _ = _spill.create_preallocated(str(tmp_path / "checkpoint.bin"), 1 << 20)
    os.close(fd)
    os.close(_bandwidth.open_scratch(str(tmp_path), 1 << 20, direct=False))


def test_a_reservation_past_the_free_space_never_takes_the_disk_for_a_moment(small_ext4, monkeypatch):
    """ext4's fallocate allocates block after block until the disk is full and only then fails: between that and the
    truncation that gives them back, every other writer of the disk (another rank's spill file, a checkpoint, a
    logger) found it full and failed with ENOSPC, once per step (a 256 MiB step tried on a disk with less free)."""
    seen = _free_space_while_reserving(monkeypatch, _spill, small_ext4)
    before = _free_bytes(small_ext4)
    spill = SpillFile(small_ext4)
    try:
        for _ in range(2):  # the idle file reserves again in the next step
            spill.free(spill.allocate(1 << 20))
            assert spill.release_space() or spill.reserved_bytes == 0
        assert all(free >= before - (4 << 20) for free in seen), (before, seen)
        assert spill.allocate(1 << 20) >= 0 and not spill._reserve  # the file grows with its writes
    finally:
        spill.close()


def test_a_bandwidth_probe_larger_than_the_free_space_never_takes_the_disk_for_a_moment(small_ext4, monkeypatch):
    """Note [No reservation past the free space], for the probe file of the DeepSpeed integration's shared-disk check
    (64 MiB on DeepSpeed's swap disk, between two steps): on a nearly full disk its fallocate held every free block
    until it failed, and a swap write of DeepSpeed's in that moment failed with ENOSPC."""
    from tba.io import _bandwidth

    seen = _free_space_while_reserving(monkeypatch, _bandwidth, small_ext4)
    before = _free_bytes(small_ext4)
    with pytest.raises(OSError) as info:
        _bandwidth.open_scratch(small_ext4, 64 << 20)
    assert info.value.errno == errno.ENOSPC
    assert all(free >= before for free in seen), (before, seen)
    assert _free_bytes(small_ext4) >= before and os.listdir(small_ext4) == ["lost+found"]
