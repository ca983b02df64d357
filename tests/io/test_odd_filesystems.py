"""File systems without O_DIRECT and O_TMPFILE (ramfs): no name is left behind, one warning only."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import subprocess
import tempfile

import pytest
import torch
from python_runs import run_python

import tba
import tba.io
from tba.cli import main as cli_main
from tba.io import filesystem_type


@pytest.fixture
def ramfs_dir(tmp_path):
    path = tmp_path / "ramfs"
    path.mkdir()
    done = subprocess.run(["mount", "-t", "ramfs", "ramfs", str(path)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount ramfs: {done.stderr.decode().strip()}")
    try:
        yield str(path)
    finally:
        tba.shutdown()  # idle shared runtimes keep their file open, and the mount busy
        subprocess.run(["umount", str(path)], check=False)


def test_ramfs_leaves_no_name_and_warns_once(ramfs_dir, backend, caplog):
    x = torch.randn(64, 1024, requires_grad=True)
    with caplog.at_level(logging.WARNING, logger="tba"):
        for _ in range(3):
            with tba.offload_activations(ramfs_dir, backend=backend, min_offload_bytes=0):
                loss = (x * 2).sin().sum()
            loss.backward()
    assert os.listdir(ramfs_dir) == []
    assert caplog.text.count("using buffered I/O") <= 1
    assert caplog.text.count("is on ramfs, which keeps its files in RAM") == 1
    assert "directory on a disk" in caplog.text


def test_tmpfs_warns_once_and_doctor_says_so(caplog, capsys):
    shm = "/dev/shm"
    if tba.io.memory_backed(shm) is None:
        pytest.skip("/dev/shm is not a memory file system here")
    directory = tempfile.mkdtemp(dir=shm)
    try:
        x = torch.randn(64, 1024, requires_grad=True)
        with caplog.at_level(logging.WARNING, logger="tba"):
            for _ in range(2):
                with tba.offload_activations(directory, backend="threads", min_offload_bytes=0):
                    loss = (x * 2).sin().sum()
                loss.backward()
        assert caplog.text.count("which keeps its files in RAM, so offloading saves no memory") == 1
        capsys.readouterr()
        assert cli_main(["doctor", "--no-bandwidth", "--directory", directory]) == 0
        assert "IN MEMORY, offloading here saves nothing" in capsys.readouterr().out
    finally:
        tba.shutdown()
        shutil.rmtree(directory)


def test_filesystem_type_reads_the_longest_mount(tmp_path):
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(
        "22 1 252:0 / / rw,relatime shared:1 - ext4 /dev/vda rw\n"
        "30 22 0:26 / /dev/shm rw shared:2 - tmpfs tmpfs rw\n"
        "31 22 0:27 / /mnt/my\\040disk rw - xfs /dev/vdb rw\n"
    )
    assert filesystem_type("/dev/shm/x", str(mountinfo)) == "tmpfs"
    assert filesystem_type("/dev/shmother", str(mountinfo)) == "ext4"
    assert filesystem_type("/mnt/my disk/data", str(mountinfo)) == "xfs"
    assert filesystem_type("/", str(mountinfo)) == "ext4"
    assert filesystem_type("/x", str(tmp_path / "missing")) is None


def test_filesystem_type_reads_mount_points_that_are_not_utf8(tmp_path):
    """Note [A mount point need not be UTF-8] in tba/io/_fs.py."""
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_bytes(
        b"22 1 252:0 / / rw,relatime shared:1 - ext4 /dev/vda rw\n"
        b"40 22 0:44 / /tmp/r\xff rw - tmpfs none rw\n"
        b"41 22 0:45 / /mnt/data rw - xfs /dev/vdb rw\n"
    )
    assert filesystem_type("/mnt/data/x", str(mountinfo)) == "xfs"
    assert filesystem_type(b"/tmp/r\xff/x", str(mountinfo)) == "tmpfs"
    assert filesystem_type(os.fsdecode(b"/tmp/r\xff/x"), str(mountinfo)) == "tmpfs"
    assert filesystem_type("/tmp/r", str(mountinfo)) == "ext4"


def test_bench_io_on_ramfs_leaves_no_name(ramfs_dir):
    done = run_python(["-m", "tba", "bench-io", "--directory", ramfs_dir, "--size", "4M", "--no-fio"], timeout=120)
    assert os.listdir(ramfs_dir) == [], done.stdout + done.stderr


def test_memory_backed_spill_files_reserve_nothing(tmp_path):
    """Note [No reservation in memory]: on tmpfs fallocate would allocate and zero pages every step."""
    import os

    from tba.io import SpillFile, memory_backed

    if not os.path.isdir("/dev/shm") or not memory_backed("/dev/shm"):
        pytest.skip("no tmpfs at /dev/shm")
    in_memory = SpillFile("/dev/shm")
    on_disk = SpillFile(str(tmp_path)) if not memory_backed(str(tmp_path)) else None
    try:
        in_memory.allocate(1 << 20)
        assert in_memory.reserved_bytes == 0
        if on_disk is not None:
            on_disk.allocate(1 << 20)
            assert on_disk.reserved_bytes > 0 or not on_disk._reserve
    finally:
        in_memory.close()
        if on_disk is not None:
            on_disk.close()


def test_create_preallocated_where_o_direct_is_refused_after_the_file_was_made(ramfs_dir):
    """ramfs (and tmpfs before Linux 6.6) create the file, then refuse O_DIRECT: the buffered retry must not find it."""
    path = os.path.join(ramfs_dir, "checkpoint.bin")
    fd, direct = tba.io.create_preallocated(path, 8192)
    try:
        assert not direct
        assert os.pwrite(fd, b"x" * 8192, 0) == 8192
    finally:
        os.close(fd)
    assert os.listdir(ramfs_dir) == ["checkpoint.bin"]


def test_checkpoints_where_o_direct_is_refused_warn_once_naming_the_directory(ramfs_dir, caplog):
    # create_preallocated warned once per directory of its file, and each save's file lies in a staging directory of
    # its own: every checkpoint to a file system without O_DIRECT warned again, naming no directory.
    import torch.distributed.checkpoint as dcp

    from tba.checkpoint import TbaStorageWriter

    with caplog.at_level(logging.WARNING, logger="tba"):
        for step in range(3):
            dcp.save({"w": torch.ones(8)}, storage_writer=TbaStorageWriter(os.path.join(ramfs_dir, f"step{step}")),
                     no_dist=True)
    warned = [r.getMessage() for r in caplog.records if "buffered I/O" in r.getMessage()]
    assert len(warned) == 1 and ramfs_dir in warned[0], warned


def test_a_name_that_cannot_be_removed_leaves_no_descriptor_and_no_file(tmp_path, monkeypatch, open_fds):
    """Where O_TMPFILE is refused (FUSE, CIFS, NFS) the spill file is named, then unlinked at once. An unlink that
    failed (EBUSY: CIFS may refuse to remove an open file) left the open descriptor and the named file behind, at
    each try (the O_DIRECT probe's and the spill file's)."""
    from tba.io import _directory

    real_open, real_unlink = os.open, os.unlink
    refused: list[str] = []

    def no_tmpfile(path, flags, *args, **kwargs):
        if flags & os.O_TMPFILE == os.O_TMPFILE:
            raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP), path)
        return real_open(path, flags, *args, **kwargs)

    def busy_once(path, *args, **kwargs):
        if not refused and os.path.basename(path).startswith(".tba-"):
            refused.append(path)
            raise OSError(errno.EBUSY, os.strerror(errno.EBUSY), path)
        return real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", no_tmpfile)
    monkeypatch.setattr(os, "unlink", busy_once)
    before = open_fds()
    with pytest.raises(OSError) as info:
        _directory.open_anonymous(str(tmp_path), direct=False)
    assert refused and info.value.errno == errno.EBUSY
    assert open_fds() == before, "the descriptor of the file that kept its name was left open"
    assert os.listdir(tmp_path) == [], "the named file was left in the directory"
