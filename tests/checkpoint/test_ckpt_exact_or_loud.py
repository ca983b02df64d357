"""A lazy checkpoint holds exactly the state of the save call, or its save fails loudly."""

from __future__ import annotations

import os
import threading

import pytest
import torch
from ckpt_helpers import assert_state_equal, clone_state, full_state, load_state, make_model, train_step

from tba.checkpoint import DEFAULT_QUEUE_DEPTH, LazyCheckpointer, TbaCheckpointError, TbaStorageReader, _layout, _lazy

pytestmark = pytest.mark.filterwarnings("ignore:.*torch.distributed is disabled")


@pytest.fixture
def gate(monkeypatch):
    """The lazy copy waits until the test sets this event, so what the caller does after save() comes first."""
    opened = threading.Event()
    _lazy._warm_up_in_caller("auto", DEFAULT_QUEUE_DEPTH)  # its own save, run alone, must not wait for the gate
    write_image = _layout.write_image

    def gated_write_image(*args, **kwargs):
        assert opened.wait(60)
        return write_image(*args, **kwargs)

    monkeypatch.setattr(_layout, "write_image", gated_write_image)
    return opened


def test_an_unguarded_step_right_after_save_fails_the_save_and_keeps_the_earlier_checkpoint(tmp_path, gate):
    """Note [A tensor changed before the lazy copy read it]: the post-step weights were saved, silently (helper-41)."""
    model, optimizer = make_model(seed=3)
    path = str(tmp_path / "c")
    with LazyCheckpointer() as checkpointer:
        earlier = clone_state(full_state(model, optimizer))
        gate.set()
        checkpointer.save(full_state(model, optimizer), path).wait()
        gate.clear()
        train_step(model, optimizer, seed=5)
        handle = checkpointer.save(full_state(model, optimizer), path)
        train_step(model, optimizer, seed=6)  # no guard(optimizer), no wait_snapshot()
        gate.set()
        with pytest.raises(TbaCheckpointError, match=r"changed after save\(\).*guard\(optimizer\)"):
            handle.wait()
    assert_state_equal(load_state(path, earlier, TbaStorageReader(path)), earlier)
    assert os.listdir(tmp_path) == ["c"]


def test_a_guarded_step_waits_and_the_checkpoint_is_exact(tmp_path, gate):
    model, optimizer = make_model(seed=4)
    path = str(tmp_path / "c")
    with LazyCheckpointer() as checkpointer:
        checkpointer.guard(optimizer)
        at_save = clone_state(full_state(model, optimizer))
        handle = checkpointer.save(full_state(model, optimizer), path)
        threading.Timer(0.3, gate.set).start()
        train_step(model, optimizer, seed=6)  # its step waits for the copy
        handle.wait()
    assert_state_equal(load_state(path, at_save, TbaStorageReader(path)), at_save)


def test_batchnorm_statistics_changed_by_forward_fail_the_save(tmp_path, gate):
    """batch_norm updates running_mean without bumping its version; num_batches_tracked, saved beside it, tells."""
    model = torch.nn.BatchNorm1d(16)
    with LazyCheckpointer() as checkpointer:
        handle = checkpointer.save({"model": model.state_dict()}, str(tmp_path / "c"))
        model(torch.randn(8, 16))  # training-mode forward updates the running statistics in place
        gate.set()
        with pytest.raises(TbaCheckpointError, match="num_batches_tracked"):
            handle.wait()
    assert not os.path.exists(tmp_path / "c")


@pytest.mark.parametrize("make_optimizer", [
    lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, fused=True),
    lambda params: torch.optim.Adam(params, lr=0.1, fused=True),
], ids=["sgd-fused", "adam-fused"])
def test_an_unguarded_fused_step_fails_the_save(tmp_path, gate, make_optimizer):
    """A fused step bumps no version of the parameters it updates (Note [A fused optimizer step bumps no version])."""
    model = torch.nn.Linear(16, 16)
    optimizer = make_optimizer(model.parameters())
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    with LazyCheckpointer() as checkpointer:
        handle = checkpointer.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, str(tmp_path / "c"))
        optimizer.step()  # no guard(optimizer)
        gate.set()
        with pytest.raises(TbaCheckpointError, match=r"changed after save\(\).*guard\(optimizer\)"):
            handle.wait()
    assert not os.path.exists(tmp_path / "c")


def test_a_guarded_fused_step_and_a_step_on_other_tensors_leave_the_save_exact(tmp_path, gate):
    model, other = torch.nn.Linear(16, 16), torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=True)
    unrelated = torch.optim.SGD(other.parameters(), lr=0.1, fused=True)
    for p in [*model.parameters(), *other.parameters()]:
        p.grad = torch.ones_like(p)
    optimizer.step()
    path = str(tmp_path / "c")
    with LazyCheckpointer() as checkpointer:
        checkpointer.guard(optimizer)
        at_save = clone_state({"model": model.state_dict()})
        handle = checkpointer.save({"model": model.state_dict()}, path)
        unrelated.step()
        threading.Timer(0.3, gate.set).start()
        optimizer.step()  # waits for the copy
        handle.wait()
    assert_state_equal(load_state(path, at_save, TbaStorageReader(path)), at_save)


def test_a_tensor_in_shared_memory_changed_by_another_process_is_saved_as_it_was_at_the_save(tmp_path, gate):
    """Note [Memory torch does not own is copied at the save]: a Hogwild worker's write to a share_memory_() tensor
    bumps no version in the saving process, and the lazy save published the worker's values (helper-91)."""
    shared = torch.full((1024,), 2.0).share_memory_()
    path = str(tmp_path / "c")
    with LazyCheckpointer() as checkpointer:
        handle = checkpointer.save({"w": shared}, path)
        pid = os.fork()
        if pid == 0:
            shared.fill_(7.0)  # another process: its version counter is its own
            os._exit(0)
        assert os.waitpid(pid, 0)[1] == 0
        assert shared._version == 0 and torch.equal(shared, torch.full((1024,), 7.0))
        gate.set()
        handle.wait(timeout_s=60)
    loaded = load_state(path, {"w": torch.empty(1024)}, TbaStorageReader(path))
    assert torch.equal(loaded["w"], torch.full((1024,), 2.0))


def test_an_inference_tensor_changed_after_save_is_saved_as_it_was_at_the_save(tmp_path, gate):
    """An inference tensor has no version counter: a change under inference_mode after save() was published unseen
    (helper-91). It is copied at the save (Note [Memory torch does not own is copied at the save])."""
    with torch.inference_mode():
        ema = torch.full((1024,), 2.0)
    path = str(tmp_path / "c")
    with LazyCheckpointer() as checkpointer:
        handle = checkpointer.save({"ema": ema}, path)
        with torch.inference_mode():
            ema.fill_(7.0)
        gate.set()
        handle.wait(timeout_s=60)
    assert torch.equal(load_state(path, {"ema": torch.empty(1024)}, TbaStorageReader(path))["ema"], torch.full((1024,), 2.0))


@pytest.mark.parametrize("swap", [
    lambda model: setattr(model.weight, "data", torch.full_like(model.weight, 7.0)),
    lambda model: model.to(torch.bfloat16),  # nn.Module._apply assigns param.data
], ids=["data-assigned", "module-to-dtype"])
def test_a_parameter_given_itself_whose_data_is_swapped_after_save_is_saved_as_it_was(tmp_path, gate, swap):
    """Note [A saved tensor's storage is pinned at the save]: a Parameter in the state (keep_vars=True, or
    {"w": model.weight}) whose .data was assigned after save() was saved with the new data, silently (helper-142)."""
    model = torch.nn.Linear(8, 8)
    at_save = clone_state({"model": model.state_dict()})
    path = str(tmp_path / "c")
    with LazyCheckpointer() as checkpointer:
        handle = checkpointer.save({"model": model.state_dict(keep_vars=True)}, path)
        with torch.no_grad():
            swap(model)
        gate.set()
        handle.wait(timeout_s=60)
    assert_state_equal(load_state(path, at_save, TbaStorageReader(path)), at_save)
