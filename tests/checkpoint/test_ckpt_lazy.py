"""Lazy checkpoints: training between save and wait gives the checkpoint of a synchronous save."""

from __future__ import annotations

import os
import threading

import pytest
import torch
import torch.distributed.checkpoint as dcp
from ckpt_helpers import (
    assert_state_equal,
    clone_state,
    first_staging_fails,
    full_state,
    load_during_a_save,
    load_state,
    make_model,
    train_step,
)
from torch import nn
from torch.distributed.checkpoint import FileSystemReader

from tba.checkpoint import LazyCheckpointer, TbaCheckpointError, TbaStorageReader, TbaStorageWriter, save_lazy
from tba.errors import TbaConfigError

pytestmark = pytest.mark.filterwarnings("ignore:.*torch.distributed is disabled")


def test_training_between_save_and_wait_gives_the_synchronous_checkpoint(tmp_path):
    model, optimizer = make_model(seed=1)
    sync_path, lazy_path = str(tmp_path / "sync"), str(tmp_path / "lazy")
    at_save = clone_state(full_state(model, optimizer))
    dcp.save(full_state(model, optimizer), storage_writer=TbaStorageWriter(sync_path), no_dist=True)
    with LazyCheckpointer() as checkpointer:
        checkpointer.guard(optimizer)
        handle = checkpointer.save(full_state(model, optimizer), lazy_path)
        for step in range(3):
            train_step(model, optimizer, seed=100 + step)
        handle.wait()
    lazy = load_state(lazy_path, at_save, TbaStorageReader(lazy_path))
    assert_state_equal(lazy, load_state(sync_path, at_save, FileSystemReader(sync_path)))
    assert_state_equal(lazy, at_save)
    moved = full_state(model, optimizer)["model"]
    assert any(not torch.equal(moved[k], at_save["model"][k]) for k in moved), "training did not move"


def test_step_hook_runs_only_after_the_snapshot(tmp_path):
    model, optimizer = make_model(seed=2, width=256)
    seen = []
    with LazyCheckpointer() as checkpointer:
        checkpointer.guard(optimizer)
        optimizer.register_step_pre_hook(lambda *_: seen.append(checkpointer.latest.snapshot_taken()))
        checkpointer.save(full_state(model, optimizer), str(tmp_path / "c"))
        train_step(model, optimizer, seed=7)
    assert seen == [True]


def test_on_done_callback_and_durable_result(tmp_path):
    model, optimizer = make_model(seed=4)
    state = clone_state(full_state(model, optimizer))
    called = threading.Event()
    handle = save_lazy(full_state(model, optimizer), tmp_path / "c", on_done=lambda h: called.set())
    handle.wait(timeout_s=60)
    assert called.is_set() and handle.done() and handle.error is None
    assert handle.total_s >= handle.snapshot_s > 0
    assert_state_equal(load_state(handle.path, state, FileSystemReader(handle.path)), state)


def test_a_handle_shows_its_path_and_state(tmp_path):
    from tba.checkpoint import LazyCheckpoint

    pending = LazyCheckpoint(str(tmp_path / "p"), None)
    assert repr(pending) == f"LazyCheckpoint({str(tmp_path / 'p')!r}, copying)"
    pending._mark_snapshot()
    assert repr(pending).endswith(", writing)")
    model, optimizer = make_model(seed=4)
    handle = save_lazy(full_state(model, optimizer), tmp_path / "c", on_done=None)
    handle.wait(timeout_s=60)
    assert repr(handle).startswith(f"LazyCheckpoint({handle.path!r}, published: {handle.bytes_written} bytes in ")


def test_back_to_back_saves_reuse_the_buffer(tmp_path):
    model, optimizer = make_model(seed=6)
    with LazyCheckpointer(reserve_bytes=1 << 20) as checkpointer:
        checkpointer.guard(optimizer)
        states = []
        for i in range(3):
            states.append(clone_state(full_state(model, optimizer)))
            checkpointer.save(full_state(model, optimizer), tmp_path / f"c{i}")
            train_step(model, optimizer, seed=i)
        checkpointer.latest.wait()
    for i, state in enumerate(states):
        path = str(tmp_path / f"c{i}")
        assert_state_equal(load_state(path, state, TbaStorageReader(path)), state)


@pytest.mark.parametrize("bad", [
    pytest.param(lambda: None, id="lambda"),
    pytest.param(threading.Lock(), id="lock"),
    pytest.param(torch.eye(3).to_sparse(), id="sparse"),
])
def test_values_dcp_cannot_store_are_refused_at_once(tmp_path, bad):
    with pytest.raises(TbaConfigError, match=r"state_dict\[extra.bad\]"):
        save_lazy({"w": torch.ones(3), "extra": {"bad": bad}}, tmp_path / "c")
    assert not (tmp_path / "c").exists()


def test_a_meta_tensor_is_refused_naming_materialisation(tmp_path):
    """It said to convert the meta tensor with .to_dense(), which leaves it on meta with no data (helper-76)."""
    with pytest.raises(TbaConfigError, match=r"state_dict\[w\] is a tensor on the meta device.*to_empty") as caught:
        save_lazy({"w": torch.empty(3, device="meta")}, tmp_path / "c")
    assert "to_dense" not in str(caught.value)
    assert not (tmp_path / "c").exists()


def test_a_tensor_over_numpy_memory_is_saved_as_it_was_at_the_save(tmp_path):
    """Note [Memory torch does not own is copied at the save]: a write through the numpy array bumps no version, and
    the lazy save published the new values (helper-68)."""
    import numpy as np

    array = np.full(1 << 20, 2.0, np.float32)
    state = {"x": torch.from_numpy(array), "y": torch.ones(3)}
    handle = save_lazy(state, tmp_path / "c")
    array[:] = 1
    handle.wait(timeout_s=60)
    loaded = load_state(handle.path, {"x": torch.empty(1 << 20), "y": torch.empty(3)}, FileSystemReader(handle.path))
    assert torch.equal(loaded["x"], torch.full((1 << 20,), 2.0)) and torch.equal(loaded["y"], torch.ones(3))


def test_non_dict_state_is_refused(tmp_path):
    with pytest.raises(TbaConfigError, match="must be a dict"):
        save_lazy([torch.ones(3)], tmp_path / "c")


def test_negative_reserve_is_refused():
    with pytest.raises(TbaConfigError, match="reserve_bytes"):
        LazyCheckpointer(reserve_bytes=-1)


def test_modules_and_optimizers_are_taken_as_state_dicts(tmp_path):
    model, optimizer = make_model(seed=8)
    expected = clone_state(full_state(model, optimizer))
    handle = save_lazy({"model": model, "optim": optimizer}, tmp_path / "c")
    handle.wait()
    assert_state_equal(load_state(handle.path, expected, TbaStorageReader(handle.path)), expected)


def test_a_load_waits_for_a_lazy_save_to_its_path(tmp_path, monkeypatch):
    """Note [A load waits for the saves to its path]: it read the checkpoint before the save, silently (helper-36).
    The save's writes are slowed down, so that the load starts while it runs."""
    load_during_a_save(monkeypatch, str(tmp_path / "latest"), str(tmp_path / "latest"), 2048)


def test_a_save_refused_at_once_does_not_make_loads_of_its_path_wait(tmp_path):
    """A save refused by save() stayed registered (Note [A load waits for the saves to its path]): every later load
    of that path waited for it for ever (helper-41)."""
    import tba.checkpoint as tc

    path = tmp_path / "precious"
    path.mkdir()
    (path / "notes.txt").write_text("keep me")
    model = torch.nn.Linear(4, 4)
    with pytest.raises(TbaConfigError, match="not a checkpoint directory"):
        save_lazy(tc.state_dict(model), path)
    outcome = []
    loader = threading.Thread(target=lambda: outcome.append(pytest.raises(TbaCheckpointError, tc.load, path, model)),
                              daemon=True)
    loader.start()
    loader.join(timeout=30)
    assert outcome, "the load waited for a save that was never started"
    assert (path / "notes.txt").read_text() == "keep me"


def test_two_checkpointers_saving_to_one_path_publish_in_call_order(tmp_path, monkeypatch):
    """Note [Lazy saves to one path publish in call order]: the earlier, slower save replaced the later one (helper-41)."""
    import time

    from tba.checkpoint import _layout

    write_image, calls = _layout.write_image, []

    def first_one_slow(*args, **kwargs):
        calls.append(None)
        if len(calls) == 1:
            time.sleep(1.0)
        return write_image(*args, **kwargs)

    path = str(tmp_path / "c")
    with LazyCheckpointer() as first, LazyCheckpointer() as second:
        first.save({"w": torch.zeros(4)}, str(tmp_path / "warm")).wait()
        monkeypatch.setattr(_layout, "write_image", first_one_slow)
        earlier = first.save({"w": torch.full((1000,), 1.0)}, path)
        later = second.save({"w": torch.full((1000,), 2.0)}, path)
        later.wait()
        assert earlier.done(), "the later save was published before the earlier one ended"
        earlier.wait()
    assert torch.equal(load_state(path, {"w": torch.zeros(1000)}, TbaStorageReader(path))["w"], torch.full((1000,), 2.0))
    assert sorted(os.listdir(tmp_path)) == ["c", "warm"]


@pytest.mark.parametrize("make", [
    lambda: LazyCheckpointer(backend="nope"),
    lambda: LazyCheckpointer(queue_depth=0),
    lambda: TbaStorageWriter("c", backend="nope"),
    lambda: TbaStorageWriter("c", queue_depth=-1),
    lambda: TbaStorageReader("c", backend="nope"),
    lambda: TbaStorageReader("c", queue_depth=0),
    lambda: TbaStorageReader("c", batch_bytes=0),
    lambda: LazyCheckpointer(reserve_bytes="lots"),
], ids=["lazy-backend", "lazy-depth", "writer-backend", "writer-depth", "reader-backend", "reader-depth", "reader-batch",
        "reserve-text"])
def test_bad_engine_settings_are_refused_where_they_are_given(make):
    """Note [Engine settings are checked at construction]: they failed every save later, as a CheckpointException."""
    with pytest.raises(TbaConfigError, match="backend|queue_depth|batch_bytes|reserve_bytes"):
        make()


def test_reserve_takes_a_size_string():
    with LazyCheckpointer(reserve_bytes="1M"):
        pass


@pytest.mark.parametrize("not_an_optimizer", [None, nn.Linear(2, 2)])
def test_guard_given_no_optimizer_names_what_it_takes(not_an_optimizer):
    """guard(model) or guard(None) raised AttributeError: ... has no attribute 'register_step_pre_hook' from inside guard."""
    with LazyCheckpointer() as checkpointer, pytest.raises(TbaConfigError, match="guard takes a torch.optim.Optimizer"):
        checkpointer.guard(not_an_optimizer)


def test_a_reserve_larger_than_memory_is_a_config_error():
    """LazyCheckpointer(reserve_bytes=2**60) raised a bare OSError [Errno 12] Cannot allocate memory from tba/io/_memory.py."""
    with pytest.raises(TbaConfigError, match="reserve_bytes"):
        LazyCheckpointer(reserve_bytes=2**60)


@pytest.mark.parametrize("state, match", [
    pytest.param({"a.b": torch.ones(2), "a": {"b": torch.zeros(2)}}, r"two keys.*a\.b", id="dotted-key-collides"),
    pytest.param({"l": [torch.ones(2)], "l.0": torch.zeros(2)}, r"two keys.*l\.0", id="list-index-collides"),
    pytest.param({"q": torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8)}, r"state_dict\[q\].*quantized",
                 id="quantized"),
])
def test_state_dcp_cannot_save_is_refused_by_the_save_call(tmp_path, state, match):
    """Both were accepted by save() and failed only at wait(), with DCP's traceback (helper-91)."""
    with pytest.raises(TbaConfigError, match=match):
        save_lazy(state, tmp_path / "c")
    assert not (tmp_path / "c").exists()


def test_an_interrupt_inside_save_leaves_no_save_that_loads_and_later_saves_wait_for(tmp_path, monkeypatch):
    """Ctrl-C after the save was registered and before its thread started left it registered for ever: a later load or
    save of the path (in a notebook, after the interrupt) waited for ever (helper-91)."""
    from tba.checkpoint import _lazy, _pending

    path = str(tmp_path / "c")
    with LazyCheckpointer() as checkpointer:
        checkpointer.save({"w": torch.zeros(3)}, path).wait()

        def interrupted(*_: object) -> None:
            raise KeyboardInterrupt

        monkeypatch.setattr(_lazy, "StepWatch", interrupted)
        with pytest.raises(KeyboardInterrupt):
            checkpointer.save({"w": torch.ones(3)}, path)
        monkeypatch.undo()
        assert path not in _pending._saves
        handle = checkpointer.save({"w": torch.full((3,), 2.0)}, path)
        handle.wait(timeout_s=30)
    assert torch.equal(load_state(path, {"w": torch.empty(3)}, TbaStorageReader(path))["w"], torch.full((3,), 2.0))


def test_close_gives_the_host_buffer_back(tmp_path):
    """close() said it released the host buffer, but the checkpointer kept it (a checkpoint's size of host memory) for
    as long as the object lived (helper-91); a save after close() allocates a new one."""
    with LazyCheckpointer() as checkpointer:
        checkpointer.save({"w": torch.ones(1 << 20)}, tmp_path / "c").wait()
        start = checkpointer._pool.get(1).data_ptr()

    def mapped() -> bool:
        with open("/proc/self/maps") as maps:
            return any(int(line.split("-")[0], 16) <= start < int(line.split("-")[1].split()[0], 16) for line in maps)

    assert not mapped()
    checkpointer.save({"w": torch.full((3,), 2.0)}, tmp_path / "c").wait()
    checkpointer.close()


def test_a_ctrl_c_during_the_first_saves_warm_up_reaches_the_caller(tmp_path, monkeypatch):
    """Note [A Ctrl-C inside DCP stays a Ctrl-C] in tba/checkpoint/_io.py: DCP wraps every rank's error, a
    KeyboardInterrupt too, in its CheckpointException; the warm-up, which runs in the caller's thread, logged it as a
    failed warm-up and went on with the save."""
    from tba.checkpoint import _lazy

    def interrupted(*_: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(_lazy, "_warmed_up", False)
    monkeypatch.setattr(TbaStorageWriter, "write_data", interrupted)
    with LazyCheckpointer() as checkpointer, pytest.raises(KeyboardInterrupt):
        checkpointer.save({"w": torch.zeros(3)}, str(tmp_path / "c"))


def test_a_warm_up_left_by_a_killed_process_is_removed_by_the_next(tmp_path, monkeypatch):
    """Note [A warm-up killed mid-way is removed by the next] in tba/checkpoint/_stale.py."""
    import fcntl
    import subprocess
    import sys
    import tempfile

    from tba.checkpoint import _lazy
    from tba.checkpoint._publish import MACHINE

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    left = {
        "killed": f".tba-warm-up-m{MACHINE}-{dead_pid}-a1",  # removed
        "locked": f".tba-warm-up-m{MACHINE}-{dead_pid}-b2",  # another PID namespace's, alive: its lock is held
        "elsewhere": f".tba-warm-up-m{'0' * 8 if MACHINE != '0' * 8 else '1' * 8}-{dead_pid}-c3",  # another machine's
        "mine": f".tba-warm-up-m{MACHINE}-{os.getpid()}-d4",
    }
    for name in left.values():
        (tmp_path / name / "warm_up").mkdir(parents=True)
        (tmp_path / name / "warm_up" / "__0_0.distcp").write_bytes(b"x" * 64)
    lock = os.open(tmp_path / left["locked"], os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
        monkeypatch.setattr(_lazy, "_warmed_up", False)
        _lazy._warm_up_in_caller("auto", 8)
        assert _lazy._warmed_up
    finally:
        os.close(lock)
    assert sorted(os.listdir(tmp_path)) == sorted(name for key, name in left.items() if key != "killed")


class _Interrupted(Exception):
    """What a user's signal handler raises (a time limit's alarm), derived from Exception."""


class _InterruptedWhileCopied:
    """A picklable value during whose copy the user's signal handler raises (or the copy runs out of memory)."""

    def __init__(self, error: type[BaseException]) -> None:
        self.error = error

    def __deepcopy__(self, memo: dict) -> _InterruptedWhileCopied:
        raise self.error()


@pytest.mark.parametrize("error", [_Interrupted, TimeoutError, MemoryError], ids=["user", "timeout", "memory"])
def test_an_error_that_is_no_refusal_to_pickle_surfaces_as_itself(tmp_path, error):
    """Note [Only a refusal to pickle is the state dict's fault]: a signal handler's exception landing in the check of
    a non-tensor value was raised as TbaConfigError, "cannot be saved by DCP: ; keep only tensors and picklable values",
    which blamed a state dict that was fine and escaped the caller's own except clause for it."""
    with pytest.raises(error):
        save_lazy({"w": torch.ones(3), "extra": {"meta": _InterruptedWhileCopied(error)}}, tmp_path / "c")
    assert not (tmp_path / "c").exists()
    save_lazy({"w": torch.ones(3), "extra": {"meta": 1}}, tmp_path / "c").wait(timeout_s=60)
    assert (tmp_path / "c" / ".metadata").exists()


def test_a_save_right_after_one_that_failed_before_writing_is_not_refused(tmp_path, monkeypatch):
    """Note [A failed lazy save lets go of its writer]: a save that failed before its data was written (its staging
    directory could not be made) left the writer claimed by its thread, and the next save of the checkpointer, started
    once the first was done but while its thread still ran (its on_done callback), failed: "this TbaStorageWriter is
    still saving ... in thread tba-ckpt"."""
    first_staging_fails(monkeypatch)
    callback_may_end = threading.Event()
    with LazyCheckpointer() as checkpointer:
        first = checkpointer.save({"w": torch.ones(3)}, tmp_path / "first", on_done=lambda h: callback_may_end.wait(60))
        try:
            with pytest.raises(TbaCheckpointError, match="staging directory"):
                first.wait(timeout_s=60)
            second = checkpointer.save({"w": torch.full((3,), 2.0)}, tmp_path / "second")
            second.wait(timeout_s=60)
        finally:
            callback_may_end.set()
    loaded = load_state(second.path, {"w": torch.empty(3)}, FileSystemReader(second.path))
    assert torch.equal(loaded["w"], torch.full((3,), 2.0))
    assert sorted(os.listdir(tmp_path)) == ["second"]
