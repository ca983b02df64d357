"""State a checkpoint cannot hold, or a model it cannot load into, is refused with a tba error naming the fix."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tba
import tba.checkpoint as tc
from tba.errors import TbaConfigError

pytestmark = pytest.mark.filterwarnings("ignore:.*torch.distributed is disabled")


@pytest.mark.parametrize("given", ["module", "state_dict"])
def test_a_lazy_modules_uninitialised_parameters_are_refused_naming_a_forward(tmp_path, given):
    """nn.LazyLinear before its first forward: save raised torch's ValueError from inside tba (helper-153)."""
    model = nn.Sequential(nn.LazyLinear(4))
    with pytest.raises(TbaConfigError, match="forward"):
        tc.save_lazy({"model": model} if given == "module" else tc.state_dict(model), tmp_path / "c")
    model(torch.ones(2, 3))  # initialised: saved as any other
    tc.save_lazy(tc.state_dict(model), tmp_path / "c").wait()


def test_load_into_a_model_on_the_meta_device_names_to_empty(tmp_path):
    """A model built under torch.device("meta") (as for a large model): load said 'Default process group has not
    been initialized', which no single-process user can act on (helper-153)."""
    model = nn.Linear(4, 4)
    tc.save_lazy(tc.state_dict(model), tmp_path / "c").wait()
    with torch.device("meta"):
        empty = nn.Linear(4, 4)
    with pytest.raises(TbaConfigError, match="to_empty"):
        tc.load(tmp_path / "c", empty)
    empty.to_empty(device="cpu")
    tc.load(tmp_path / "c", empty)
    assert torch.equal(empty.weight, model.weight)


def test_a_name_too_long_for_the_staging_directory_says_so(tmp_path):
    """A 240-character name is valid, but the staging directory beside it adds some 40: the save failed with 'File
    name too long; check the directory and the disk' (helper-153)."""
    with pytest.raises(tc.TbaCheckpointError, match="shorter name"):
        tc.save_lazy({"w": torch.ones(2)}, tmp_path / ("n" * 240)).wait()
    assert list(tmp_path.iterdir()) == []


def test_an_extra_entry_named_like_the_optimizers_state_is_refused(tmp_path):
    """state_dict(model, optimizer, optim={...}): the optimizer's state replaced the extra entry, which was saved
    nowhere, and load(..., optim=meta) left meta as it was, silently (helper-153)."""
    model = nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TbaConfigError, match="optim"):
        tc.state_dict(model, optimizer, optim={"step": torch.tensor(5)})
    tc.save_lazy(tc.state_dict(model, optimizer), tmp_path / "c").wait()
    with pytest.raises(TbaConfigError, match="optim"):
        tc.load(tmp_path / "c", model, optimizer, optim={"step": torch.tensor(0)})


def test_an_on_done_that_cannot_be_called_is_refused_by_save(tmp_path):
    """save(..., on_done=print()) (None is fine) or a path by mistake: the save ran, and the TypeError of calling it
    went to the log only, at the end (helper-153)."""
    with pytest.raises(TbaConfigError, match="on_done"):
        tc.save_lazy({"w": torch.ones(2)}, tmp_path / "c", on_done=str(tmp_path / "done"))
    assert list(tmp_path.iterdir()) == []


def test_the_checkpoint_objects_say_what_they_are(tmp_path):
    """``repr(LazyCheckpointer())``, ``TbaStorageWriter`` and ``TbaStorageReader`` were ``<... object at 0x...>``,
    where every other public object of tba (``Offloader``, ``Plan``, ``LazyCheckpoint``, the engines) says its
    settings (helper-168)."""
    writer = tc.TbaStorageWriter(tmp_path / "w", backend="threads", queue_depth=4)
    assert repr(writer) == f"TbaStorageWriter({str(tmp_path / 'w')!r}, backend='threads', queue_depth=4)"
    assert repr(tc.TbaStorageReader(None)) == "TbaStorageReader(None, backend='auto', queue_depth=8)"
    with tc.LazyCheckpointer(backend="threads", queue_depth=2) as checkpointer:
        assert repr(checkpointer) == "LazyCheckpointer(backend='threads', queue_depth=2, latest=None)"
        handle = checkpointer.save({"w": torch.ones(4)}, tmp_path / "c")
        handle.wait()
        assert repr(checkpointer) == f"LazyCheckpointer(backend='threads', queue_depth=2, latest={handle!r})"
    assert "published" in repr(handle)


@pytest.mark.parametrize("chunk, match", [("4K", None), ("1M", None), (4096.0, r"chunk_bytes must be bytes >= 0 .*got 4096\.0"),
                                          ("lots", r"chunk_bytes: not a size: 'lots'"),
                                          ("5000", r"chunk_bytes must be a positive multiple of 4096, got 5000")],
                         ids=["4K", "1M", "float", "word", "unaligned"])
def test_the_writer_takes_its_chunk_as_a_size_and_refuses_others(chunk, match, tmp_path):
    """``TbaStorageWriter(chunk_bytes="4M")`` raised a TypeError from a comparison, and ``chunk_bytes=4096.0`` was
    taken (helper-168); LazyCheckpointer's ``reserve_bytes`` and every offloader size take a size string."""
    if match is None:
        writer = tc.TbaStorageWriter(tmp_path / "c", chunk_bytes=chunk)
        assert writer.chunk_bytes == tba.parse_size(chunk)
        torch_state = {"w": torch.arange(3000.0)}
        import torch.distributed.checkpoint as dcp
        dcp.save(torch_state, storage_writer=writer, no_dist=True)
        back = {"w": torch.zeros(3000)}
        dcp.load(back, storage_reader=tc.TbaStorageReader(tmp_path / "c"), no_dist=True)
        assert torch.equal(back["w"], torch_state["w"])
        return
    with pytest.raises(TbaConfigError, match=match):
        tc.TbaStorageWriter(tmp_path / "c", chunk_bytes=chunk)


@pytest.mark.parametrize("make", [tc.TbaStorageWriter, tc.TbaStorageReader], ids=["writer", "reader"])
def test_a_storage_class_given_a_path_that_is_not_one_names_the_fix(make):
    """``TbaStorageWriter(5)`` raised os.fspath's TypeError, where ``save_lazy`` and ``load`` given the same path
    refuse it with a TbaConfigError (helper-168)."""
    with pytest.raises(TbaConfigError, match=r"path must be the checkpoint's directory \(a str or os.PathLike\), got 5"):
        make(5)
    assert make(None).path is None
