"""A load racing another process's save reads one whole checkpoint or raises TbaCheckpointError."""

from __future__ import annotations

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
