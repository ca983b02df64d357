"""Lazy saves and loads that name one checkpoint by different paths, and saves of two processes racing to publish."""

from __future__ import annotations

import pytest
import torch
from ckpt_helpers import load_during_a_save, slow_writes

import tba.checkpoint as tc

pytestmark = pytest.mark.filterwarnings("ignore:.*torch.distributed is disabled")


@pytest.mark.parametrize("spelling", ["linked_parent", "link_to_checkpoint"])
def test_a_load_by_another_spelling_of_the_path_waits_for_the_lazy_save(tmp_path, monkeypatch, spelling):
    """Note [One checkpoint, many spellings of its path]: a load through a symbolic link read the checkpoint before
    the save, silently (helper-153)."""
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    path = str(real / "step")
    load_path = str(tmp_path / "link" / "step") if spelling == "linked_parent" else str(tmp_path / "latest")
    if spelling == "link_to_checkpoint":
        (tmp_path / "latest").symlink_to(real / "step")
    load_during_a_save(monkeypatch, path, load_path, 512)


def test_a_file_written_into_the_path_while_a_lazy_save_runs_is_never_deleted(tmp_path, monkeypatch):
    """Note [Files added to the path while a save runs]: config.json written beside a lazy save's checkpoint after
    save() returned was deleted with the replaced directory when the save published (helper-153)."""
    path = tmp_path / "step100"
    model = torch.nn.Linear(256, 256)
    with tc.LazyCheckpointer() as checkpointer:
        def write_config() -> None:  # save() has returned: the save thread plans, then writes
            path.mkdir()
            (path / "config.json").write_text('{"width": 256}')

        slow_writes(monkeypatch, write_config)
        handle = checkpointer.save(tc.state_dict(model), path)
        with pytest.raises(tc.TbaCheckpointError, match="config.json"):
            handle.wait()
    assert (path / "config.json").read_text() == '{"width": 256}'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step100"]  # no staging directory left


def test_a_file_added_to_an_earlier_checkpoint_while_a_save_runs_is_never_deleted(tmp_path, monkeypatch):
    """The same, where a checkpoint was at the path already: the files beside it went with it (helper-153)."""
    path = tmp_path / "latest"
    model = torch.nn.Linear(256, 256)
    with tc.LazyCheckpointer() as checkpointer:
        checkpointer.save(tc.state_dict(model), path).wait()
        slow_writes(monkeypatch, lambda: (path / "notes.txt").write_text("keep me"))
        handle = checkpointer.save(tc.state_dict(model), path)
        with pytest.raises(tc.TbaCheckpointError, match="notes.txt"):
            handle.wait()
    assert (path / "notes.txt").read_text() == "keep me"
    fresh = torch.nn.Linear(256, 256)
    tc.load(path, fresh)  # the earlier checkpoint is still there, whole
    assert torch.equal(fresh.weight, model.weight)


def test_a_save_racing_another_process_to_publish_a_new_name_publishes_after_it(tmp_path, monkeypatch):
    """Two processes saving one new name: the second to rename found the name taken between its look and its rename,
    and its save failed ("Directory not empty"), though an exchange publishes over a checkpoint (helper-153)."""
    import shutil
    import types

    import torch.distributed.checkpoint as dcp

    from tba.checkpoint import TbaStorageWriter, _publish

    other, path = tmp_path / "other", tmp_path / "step"
    dcp.save({"w": torch.zeros(3)}, storage_writer=TbaStorageWriter(other), no_dist=True)
    real_os = _publish.os

    def rename(source, target):  # the other process publishes first, just before this one's rename
        if target == str(path) and not path.exists():
            shutil.copytree(other, path)
        return real_os.rename(source, target)

    monkeypatch.setattr(_publish, "os", types.SimpleNamespace(**{**vars(real_os), "rename": rename}))
    dcp.save({"w": torch.ones(3)}, storage_writer=TbaStorageWriter(path), no_dist=True)
    monkeypatch.undo()
    loaded = {"w": torch.empty(3)}
    dcp.load(loaded, checkpoint_id=str(path), no_dist=True)
    assert torch.equal(loaded["w"], torch.ones(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other", "step"]


def test_a_file_written_between_the_last_look_and_the_exchange_is_put_back_with_its_directory(tmp_path, monkeypatch):
    """Note [Files added to the path while a save runs]: what the exchange moved aside is looked at too."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from tba.checkpoint import TbaStorageWriter, _publish

    path = tmp_path / "step"
    dcp.save({"w": torch.zeros(3)}, storage_writer=TbaStorageWriter(path), no_dist=True)
    exchange = _publish._exchange

    def late_file_then_exchange(a, b):
        if not (path / "late.txt").exists():
            (path / "late.txt").write_text("late")
        exchange(a, b)

    monkeypatch.setattr(_publish, "_exchange", late_file_then_exchange)
    with pytest.raises(CheckpointException, match="late.txt"):  # dcp.save wraps tba's TbaCheckpointError
        dcp.save({"w": torch.ones(3)}, storage_writer=TbaStorageWriter(path), no_dist=True)
    monkeypatch.undo()
    assert (path / "late.txt").read_text() == "late"
    loaded = {"w": torch.empty(3)}
    dcp.load(loaded, checkpoint_id=str(path), no_dist=True)
    assert torch.equal(loaded["w"], torch.zeros(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step"]


def test_a_config_error_in_the_save_thread_reaches_wait_as_its_own_message(tmp_path, monkeypatch):
    """A TbaConfigError raised in the lazy save's thread (the path taken by other files after save() returned) came
    out of wait() as DCP's report: 'failed: CheckpointException ranks:...' and a traceback, the fix on its last line
    (helper-153)."""
    from tba.checkpoint import TbaStorageWriter

    path = tmp_path / "step"
    set_up = TbaStorageWriter.set_up_storage_writer

    def taken_meanwhile(self, *args, **kwargs):
        path.mkdir(exist_ok=True)
        (path / "notes.txt").write_text("keep me")
        return set_up(self, *args, **kwargs)

    monkeypatch.setattr(TbaStorageWriter, "set_up_storage_writer", taken_meanwhile)
    with tc.LazyCheckpointer() as checkpointer:
        handle = checkpointer.save({"w": torch.ones(3)}, path)
        with pytest.raises(tc.TbaCheckpointError) as raised:
            handle.wait()
    message = str(raised.value)
    assert "not a checkpoint directory" in message and "Traceback" not in message, message
    assert (path / "notes.txt").read_text() == "keep me"


def test_overwrite_false_never_replaces_a_checkpoint_another_process_published_meanwhile(tmp_path, monkeypatch):
    """TbaStorageWriter(overwrite=False) looked only when the save began: a checkpoint published at the path by another
    process meanwhile was replaced, and deleted (helper-153)."""
    import shutil
    import types

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from tba.checkpoint import TbaStorageWriter, _publish

    other, path = tmp_path / "other", tmp_path / "step"
    dcp.save({"w": torch.zeros(3)}, storage_writer=TbaStorageWriter(other), no_dist=True)
    real_os = _publish.os

    def rename(source, target):
        if target == str(path) and not path.exists():
            shutil.copytree(other, path)
        return real_os.rename(source, target)

    monkeypatch.setattr(_publish, "os", types.SimpleNamespace(**{**vars(real_os), "rename": rename}))
    with pytest.raises(CheckpointException, match="overwrite"):
        dcp.save({"w": torch.ones(3)}, storage_writer=TbaStorageWriter(path, overwrite=False), no_dist=True)
    monkeypatch.undo()
    loaded = {"w": torch.empty(3)}
    dcp.load(loaded, checkpoint_id=str(path), no_dist=True)
    assert torch.equal(loaded["w"], torch.zeros(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other", "step"]
