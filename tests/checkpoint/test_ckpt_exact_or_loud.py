"""A lazy checkpoint holds exactly the state of the save call, or its save fails loudly."""

from __future__ import annotations

import os
import time

import pytest
import torch
from ckpt_helpers import assert_state_equal, clone_state, full_state, load_state, make_model, train_step

from tba.checkpoint import LazyCheckpointer, TbaCheckpointError, TbaStorageReader, _layout

pytestmark = pytest.mark.filterwarnings("ignore:.*torch.distributed is disabled")


@pytest.fixture
def slow_copy(monkeypatch):
    """The lazy copy starts 0.3 s late, so whatever the caller does right after save() comes first."""
    write_image = _layout.write_image

    def slow_write_image(*args, **kwargs):
        time.sleep(0.3)
        return write_image(*args, **kwargs)

    monkeypatch.setattr(_layout, "write_image", slow_write_image)


def test_an_unguarded_step_right_after_save_fails_the_save_and_keeps_the_earlier_checkpoint(tmp_path, slow_copy):
    """Note [A tensor changed before the lazy copy read it]: the post-step weights were saved, silently (helper-41)."""
    model, optimizer = make_model(seed=3)
    path = str(tmp_path / "c")
    with LazyCheckpointer() as checkpointer:
        earlier = clone_state(full_state(model, optimizer))
        checkpointer.save(full_state(model, optimizer), path).wait()
        train_step(model, optimizer, seed=5)
        handle = checkpointer.save(full_state(model, optimizer), path)
        train_step(model, optimizer, seed=6)  # no guard(optimizer), no wait_snapshot()
        with pytest.raises(TbaCheckpointError, match=r"changed after save\(\).*guard\(optimizer\)"):
            handle.wait()
    assert_state_equal(load_state(path, earlier, TbaStorageReader(path)), earlier)
    assert os.listdir(tmp_path) == ["c"]


def test_a_guarded_step_waits_and_the_checkpoint_is_exact(tmp_path, slow_copy):
    model, optimizer = make_model(seed=4)
    path = str(tmp_path / "c")
    with LazyCheckpointer() as checkpointer:
        checkpointer.guard(optimizer)
        at_save = clone_state(full_state(model, optimizer))
        handle = checkpointer.save(full_state(model, optimizer), path)
        train_step(model, optimizer, seed=6)
        handle.wait()
    assert_state_equal(load_state(path, at_save, TbaStorageReader(path)), at_save)


def test_batchnorm_statistics_changed_by_forward_fail_the_save(tmp_path, slow_copy):
    """batch_norm updates running_mean without bumping its version; num_batches_tracked, saved beside it, tells."""
    model = torch.nn.BatchNorm1d(16)
    with LazyCheckpointer() as checkpointer:
        handle = checkpointer.save({"model": model.state_dict()}, str(tmp_path / "c"))
        model(torch.randn(8, 16))  # training-mode forward updates the running statistics in place
        with pytest.raises(TbaCheckpointError, match="num_batches_tracked"):
            handle.wait()
    assert not os.path.exists(tmp_path / "c")
