"""File systems without O_DIRECT and O_TMPFILE (ramfs): no name is left behind, one warning only."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch

import tba


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


def test_bench_io_on_ramfs_leaves_no_name(ramfs_dir):
    done = subprocess.run([sys.executable, "-m", "tba", "bench-io", "--directory", ramfs_dir, "--size", "4M",
                           "--no-fio"], capture_output=True, text=True, timeout=120)
    assert os.listdir(ramfs_dir) == [], done.stdout + done.stderr


def test_memory_backed_spill_files_reserve_nothing(tmp_path):
    """Note [No reservation in memory]: on tmpfs fallocate would allocate and zero pages every step."""
    import os

    from tba.io import SpillFile
    from tba.io._spill import memory_backed

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
