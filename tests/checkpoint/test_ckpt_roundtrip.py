"""Round trips through TbaStorageWriter / TbaStorageReader and DCP's stock file-system classes."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from ckpt_helpers import assert_state_equal, first_staging_fails, full_state, load_state, make_model
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from tba.checkpoint import TbaStorageReader, TbaStorageWriter
from tba.checkpoint._layout import place, tensor_entry

pytestmark = pytest.mark.filterwarnings("ignore:.*torch.distributed is disabled")

AWKWARD = [
    pytest.param(torch.arange(1, dtype=torch.uint8), id="1B"),
    pytest.param(torch.arange(4095, dtype=torch.int32).to(torch.uint8), id="4095B"),
    pytest.param(torch.arange(4097, dtype=torch.int32).to(torch.uint8), id="4097B"),
    pytest.param(torch.tensor([True, False, True]), id="bool"),
    pytest.param(torch.randn(7, 5).to(torch.bfloat16), id="bf16"),
    pytest.param(torch.randn(3, 3, dtype=torch.complex64), id="complex64"),
    pytest.param(torch.randn(5, 9, dtype=torch.float64).t(), id="transposed-f64"),
    pytest.param(torch.randn(40)[3:20:2], id="strided-view"),
    pytest.param(torch.tensor(2.5, dtype=torch.float16), id="0-dim-f16"),
    pytest.param(torch.zeros(0, 4), id="empty"),
    pytest.param(torch.randint(-9, 9, (1025,), dtype=torch.int8), id="1025xi8"),
]


@pytest.mark.parametrize("tensor", AWKWARD)
@pytest.mark.parametrize("reader", [TbaStorageReader, FileSystemReader])
def test_awkward_tensors_round_trip(tmp_path, tensor, reader):
    path = str(tmp_path / "ckpt")
    state = {"t": tensor, "neighbour": torch.arange(4099, dtype=torch.int16), "note": {"k": [1, "x"]}}
    dcp.save(state, storage_writer=TbaStorageWriter(path), no_dist=True)
    assert_state_equal(load_state(path, state, reader(path)), state)


def test_a_default_device_set_by_the_program_changes_nothing_written(tmp_path):
    """Under ``torch.set_default_device`` (here meta) a checkpoint of host tensors is written and read back bit for bit:
    the serialized skeleton of each tensor describes its host copy (it was made on the default device, and a meta one
    reserved no bytes: 'torch.save skeleton reserved None bytes')."""
    state = {"w": torch.randn(64, 64, device="cpu"), "i": torch.arange(9, device="cpu")}
    path = str(tmp_path / "ckpt")
    torch.set_default_device("meta")
    try:
        dcp.save(state, storage_writer=TbaStorageWriter(path), no_dist=True)
    finally:
        torch.set_default_device(None)  # "cpu" left a device mode installed: every later Tensor.backward ran twice through it
    assert_state_equal(load_state(path, state, TbaStorageReader(path)), state)


def test_tensor_data_starts_on_block_boundaries():
    entries = [tensor_entry(i, torch.ones(n, dtype=torch.uint8)) for i, n in enumerate([1, 4095, 4097, 0, 9000])]
    size = place(entries)
    for entry in entries:
        if entry.nbytes:
            assert entry.data_offset % 4096 == 0
    ends = [e.offset + e.length for e in entries]
    assert all(a <= b.offset for a, b in zip(ends, entries[1:]))
    assert size == ends[-1]


@pytest.mark.parametrize("reader", [TbaStorageReader, FileSystemReader])
def test_model_and_optimizer_round_trip_exact(tmp_path, reader):
    model, optimizer = make_model()
    state = full_state(model, optimizer)
    path = str(tmp_path / "ckpt")
    dcp.save(state, storage_writer=TbaStorageWriter(path), no_dist=True)
    assert sorted(os.listdir(path)) == [".metadata", "__0_0.distcp"]
    assert_state_equal(load_state(path, state, reader(path)), state)


def test_async_save_with_tba_writer(tmp_path):
    model, optimizer = make_model(seed=3)
    state = full_state(model, optimizer)
    path = str(tmp_path / "ckpt")
    writer = TbaStorageWriter(path)
    future = dcp.async_save(state, storage_writer=writer, no_dist=True)
    future.result()
    writer.close()
    assert_state_equal(load_state(path, state, TbaStorageReader(path)), state)


@pytest.mark.parametrize("checkpoint_ids", [True, False])
def test_a_second_async_save_on_a_writer_still_saving_is_refused_and_the_first_is_published(tmp_path, monkeypatch,
                                                                                           checkpoint_ids):
    """Two dcp.async_save calls sharing one writer, the first still running: the second's reset retargeted the first,
    whose future then succeeded with nothing published under its path and its partial directory left, silently
    (helper-99)."""
    import threading

    from tba.checkpoint import _layout
    from tba.errors import TbaConfigError

    gate, entered, write_image = threading.Event(), threading.Event(), _layout.write_image

    def gated(*args, **kwargs):
        entered.set()
        assert gate.wait(60)
        return write_image(*args, **kwargs)

    monkeypatch.setattr(_layout, "write_image", gated)
    first, second = {"x": torch.arange(1000.0)}, {"x": -torch.arange(1000.0)}
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    writer = TbaStorageWriter(None if checkpoint_ids else a)
    one = dcp.async_save(first, storage_writer=writer, checkpoint_id=a if checkpoint_ids else None, no_dist=True)
    assert entered.wait(60)
    two = dcp.async_save(second, storage_writer=writer, checkpoint_id=b if checkpoint_ids else None, no_dist=True)
    with pytest.raises((TbaConfigError, CheckpointException), match="still saving .*one writer runs one save at a time"):
        two.result(timeout=60)
    gate.set()
    one.result(timeout=60)
    writer.close()
    assert sorted(os.listdir(tmp_path)) == ["a"]
    assert_state_equal(load_state(a, first, TbaStorageReader(a)), first)



def test_a_writer_whose_save_could_not_make_its_staging_directory_saves_again_from_another_thread(tmp_path, monkeypatch):
    """Note [A failed lazy save lets go of its writer] in tba/checkpoint/_claim.py: a dcp.save whose staging directory
    could not be made (a failing disk) left the writer claimed by the main thread for good, and every later
    dcp.async_save with it was refused, "still saving ... in thread MainThread" (helper-160)."""
    first_staging_fails(monkeypatch)
    writer = TbaStorageWriter()
    with pytest.raises(CheckpointException, match="staging directory"):
        dcp.save({"x": torch.ones(3)}, storage_writer=writer, checkpoint_id=str(tmp_path / "first"), no_dist=True)
    state = {"x": torch.arange(3.0)}
    dcp.async_save(state, storage_writer=writer, checkpoint_id=str(tmp_path / "second"), no_dist=True).result(timeout=60)
    writer.close()
    assert sorted(os.listdir(tmp_path)) == ["second"]
    assert_state_equal(load_state(str(tmp_path / "second"), state, TbaStorageReader(str(tmp_path / "second"))), state)

def test_reads_checkpoints_written_by_filesystemwriter(tmp_path):
    model, optimizer = make_model(seed=5)
    state = full_state(model, optimizer)
    path = str(tmp_path / "ckpt")
    dcp.save(state, storage_writer=FileSystemWriter(path), no_dist=True)
    assert_state_equal(load_state(path, state, TbaStorageReader(path, batch_bytes=4096)), state)


def test_overwrite_replaces_whole_checkpoint_and_leaves_no_staging(tmp_path):
    path = str(tmp_path / "ckpt")
    dcp.save({"a": torch.ones(100)}, storage_writer=TbaStorageWriter(path), no_dist=True)
    second = {"a": torch.full((100,), 7.0)}
    dcp.save(second, storage_writer=TbaStorageWriter(path), no_dist=True)
    assert os.listdir(tmp_path) == ["ckpt"]
    assert_state_equal(load_state(path, second, TbaStorageReader(path)), second)


@pytest.mark.parametrize("lazy", [False, True], ids=["dcp.save", "save_lazy"])
def test_saving_over_a_latest_symlink_replaces_the_link_and_leaves_nothing_behind(tmp_path, lazy):
    """A stray `.latest.tba-partial-*` symlink stayed beside the new checkpoint (helper-41)."""
    from tba.checkpoint import save_lazy

    first, second = {"a": torch.ones(100)}, {"a": torch.full((100,), 7.0)}
    dcp.save(first, storage_writer=TbaStorageWriter(str(tmp_path / "step1")), no_dist=True)
    os.symlink("step1", tmp_path / "latest")
    latest = str(tmp_path / "latest")
    if lazy:
        save_lazy(second, latest).wait()
    else:
        dcp.save(second, storage_writer=TbaStorageWriter(latest), no_dist=True)
    assert sorted(os.listdir(tmp_path)) == ["latest", "step1"]
    assert not os.path.islink(latest)
    assert_state_equal(load_state(latest, second, TbaStorageReader(latest)), second)
    step1 = str(tmp_path / "step1")
    assert_state_equal(load_state(step1, first, TbaStorageReader(step1)), first)


def test_refuses_to_replace_a_directory_with_other_files(tmp_path):
    path = tmp_path / "precious"
    path.mkdir()
    (path / "notes.txt").write_text("keep me")
    with pytest.raises(CheckpointException, match="not a checkpoint directory"):
        dcp.save({"a": torch.ones(3)}, storage_writer=TbaStorageWriter(str(path)), no_dist=True)
    assert (path / "notes.txt").read_text() == "keep me"


def test_overwrite_false_refuses_existing_checkpoint(tmp_path):
    path = str(tmp_path / "ckpt")
    dcp.save({"a": torch.ones(3)}, storage_writer=TbaStorageWriter(path), no_dist=True)
    with pytest.raises(CheckpointException, match="overwrite=True"):
        dcp.save({"a": torch.ones(3)}, storage_writer=TbaStorageWriter(path, overwrite=False), no_dist=True)


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointException, match="no checkpoint"):
        dcp.load({"a": torch.ones(3)}, storage_reader=TbaStorageReader(str(tmp_path / "nope")), no_dist=True)


def test_truncated_data_file_is_detected(tmp_path):
    path = str(tmp_path / "ckpt")
    state = {"a": torch.arange(10000, dtype=torch.float32)}
    dcp.save(state, storage_writer=TbaStorageWriter(path), no_dist=True)
    data = os.path.join(path, "__0_0.distcp")
    os.truncate(data, os.path.getsize(data) - 100)
    with pytest.raises(CheckpointException, match="shorter"):
        load_state(path, state, TbaStorageReader(path))
