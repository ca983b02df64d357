"""A load racing another process's save reads one whole checkpoint or raises TbaCheckpointError."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import tba.checkpoint as tc
from tba.checkpoint import TbaCheckpointError, TbaStorageReader, TbaStorageWriter

pytestmark = pytest.mark.filterwarnings("ignore:.*torch.distributed is disabled")


def replace_between_metadata_and_data(monkeypatch, path: str, states: list[dict]) -> None:
    """Each of the first ``len(states)`` loads sees its metadata read, then a save (as by another process) of the next
    state to ``path``, then its data read."""
    read_data = TbaStorageReader.read_data

    def racing_read_data(self, *args):
        if states:
            dcp.save(states.pop(0), storage_writer=TbaStorageWriter(path), no_dist=True)
        return read_data(self, *args)

    monkeypatch.setattr(TbaStorageReader, "read_data", racing_read_data)


def test_a_load_whose_checkpoint_is_replaced_midway_raises_and_loads_nothing(tmp_path, monkeypatch):
    """Note [A load racing another process's save]: a miniz error, or the new data at the old offsets (helper-41)."""
    path = str(tmp_path / "c")
    dcp.save({"note": "a", "w": torch.full((5000,), 1.0)}, storage_writer=TbaStorageWriter(path), no_dist=True)
    replace_between_metadata_and_data(monkeypatch, path, [{"note": "b" * 9000, "w": torch.full((5000,), 2.0)}])
    target = {"note": "", "w": torch.zeros(5000)}
    with pytest.raises(CheckpointException) as caught:
        dcp.load(target, storage_reader=TbaStorageReader(path), no_dist=True)
    (failure, _), = caught.value.failures.values()
    assert isinstance(failure, TbaCheckpointError) and "replaced by another save" in str(failure)
    assert torch.equal(target["w"], torch.zeros(5000)), "nothing is loaded"
    dcp.load(target, storage_reader=TbaStorageReader(path), no_dist=True)
    assert target["note"] == "b" * 9000 and torch.equal(target["w"], torch.full((5000,), 2.0))


def test_tba_load_retries_and_reads_the_newest_whole_checkpoint(tmp_path, monkeypatch):
    path = str(tmp_path / "c")
    models = [torch.nn.Linear(64, 32) for _ in range(4)]
    dcp.save(tc.state_dict(models[0]), storage_writer=TbaStorageWriter(path), no_dist=True)
    replace_between_metadata_and_data(monkeypatch, path, [tc.state_dict(m) for m in models[1:3]])
    fresh = torch.nn.Linear(64, 32)
    tc.load(path, fresh)
    assert torch.equal(fresh.weight, models[2].weight) and torch.equal(fresh.bias, models[2].bias)
    replace_between_metadata_and_data(monkeypatch, path, [tc.state_dict(models[3 - i % 2]) for i in range(3)])
    with pytest.raises(TbaCheckpointError, match="replaced by another save"):
        tc.load(path, fresh)


def test_a_checkpoint_of_more_files_than_descriptors_loads(tmp_path):
    """Note [A checkpoint of many files is opened file by file]: FileSystemWriter(single_file_per_rank=False) writes a
    file per tensor, and the reader opened all of them (two descriptors each) before reading: 'Too many open files'
    under the usual limit of 1024 for 600 tensors, which DCP's FileSystemReader loads (helper-153)."""
    import resource

    from torch.distributed.checkpoint import FileSystemWriter

    path = str(tmp_path / "c")
    state = {f"t{i}": torch.full((8,), float(i)) for i in range(300)}
    dcp.save(state, storage_writer=FileSystemWriter(path, single_file_per_rank=False), no_dist=True)
    target = {key: torch.zeros(8) for key in state}
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    try:
        dcp.load(target, storage_reader=TbaStorageReader(path), no_dist=True)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert all(torch.equal(target[key], state[key]) for key in state)


def test_a_checkpoint_of_many_files_replaced_midway_raises_saying_part_was_loaded(tmp_path, monkeypatch):
    """Note [A checkpoint of many files is opened file by file]: files opened late, as each is read."""
    import shutil

    from torch.distributed.checkpoint import FileSystemWriter

    from tba.checkpoint import _reader

    path = str(tmp_path / "c")
    state = {f"t{i}": torch.full((8,), float(i)) for i in range(3)}
    dcp.save(state, storage_writer=FileSystemWriter(path, single_file_per_rank=False), no_dist=True)
    monkeypatch.setattr(_reader, "EAGER_FILES", 0)
    read_file = TbaStorageReader._read_file

    def replaced_after_the_first(self, *args):
        read_file(self, *args)
        if os.path.exists(os.path.join(path, ".metadata")):
            shutil.rmtree(path)
            dcp.save({"t0": torch.ones(8)}, storage_writer=TbaStorageWriter(path), no_dist=True)

    monkeypatch.setattr(TbaStorageReader, "_read_file", replaced_after_the_first)
    target = {key: torch.zeros(8) for key in state}
    with pytest.raises(CheckpointException, match="may be loaded already"):
        dcp.load(target, storage_reader=TbaStorageReader(path), no_dist=True)
