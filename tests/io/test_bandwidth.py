"""The disk-bandwidth probe (``tba/io/_bandwidth.py``) that doctor, bench-hooks and the DeepSpeed check share."""

from __future__ import annotations

import os

import pytest

from tba.io import _bandwidth, directory_bandwidth, make_engine


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_a_probe_measures_whole_blocks_and_leaves_nothing(tmp_path, monkeypatch):
    passes = []
    real = _bandwidth.timed_pass

    def counted(engine, op, fd, buffer, size, block):
        passes.append((op.value, size, block))
        return real(engine, op, fd, buffer, size, block)

    monkeypatch.setattr(_bandwidth, "timed_pass", counted)
    before = _open_fds()
    with make_engine("threads") as engine:
        write, read = directory_bandwidth(engine, str(tmp_path), (3 << 20) + 5, block_size_bytes=1 << 20,
                                          direct=False, reads=2)
    assert write > 0 and read > 0
    assert passes == [("write", 3 << 20, 1 << 20), ("read", 3 << 20, 1 << 20), ("read", 3 << 20, 1 << 20)]
    assert os.listdir(tmp_path) == [] and _open_fds() == before


def test_a_probe_smaller_than_a_block_moves_one_block(tmp_path, monkeypatch):
    sizes = []
    monkeypatch.setattr(_bandwidth, "timed_pass", lambda engine, op, fd, buffer, size, block: sizes.append(size) or 1.0)
    with make_engine("threads") as engine:
        assert directory_bandwidth(engine, str(tmp_path), 10, block_size_bytes=1 << 16, direct=False) == (1 << 16,) * 2
    assert sizes == [1 << 16, 1 << 16]


def test_a_failing_pass_closes_the_probe_file(tmp_path, monkeypatch):
    def failing(engine, op, fd, buffer, size, block):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(_bandwidth, "timed_pass", failing)
    before = _open_fds()
    with make_engine("threads") as engine, pytest.raises(OSError, match="Input/output"):
        directory_bandwidth(engine, str(tmp_path), 1 << 20, direct=False)
    assert _open_fds() == before and os.listdir(tmp_path) == []
