"""A save that fails after its entry is registered leaves the store consistent and training exact or loud.

Note [A save that fails after its entry is registered] in tba/runtime/_store_lifetime.py: an error between the
entry's registration and its write being queued (the host batch's ``write``, the spill file's ``allocate``, the
window's ``add``) left the entry registered and, past the allocation, counted as being written: a reusable
offloader's ``flush`` waited for ever and the entry stayed live for good. Each point is failed through both the C
save (``tba._save``) and the Python one, with an ``Exception`` (the storage stays in memory, training is exact) and
a ``KeyboardInterrupt`` (everything registered is undone; backward says the save failed).
"""

from __future__ import annotations

import logging
import threading

import pytest
import torch
from save_failures import LogLines, backward_after_failed_save, gradients_without_tba, model_and_input

import tba
from tba import _control
from tba.io import SpillFile
from tba.runtime import _release, _writes
from tba.runtime._host_io import HostBatch
from tba.runtime._prefetch import PrefetchWindow
from tba.runtime._unpack_hooks import Phase

PATHS = ["python"] + (["c"] if _writes.NATIVE else [])

POINTS = {"window": (PrefetchWindow, "add"), "allocate": (SpillFile, "allocate"), "write": (HostBatch, "write"),
          "schedule": (_control, "after_batch")}
"""Where a save fails: after the entry is counted live and mapped (the window), after it is resident (the
extent), after it is counted as being written (the host batch), and after its write joined the host batch's queue,
in the call that schedules the queue's flush (Note [A flush that could not be scheduled] in
``tba/runtime/_host_io.py``)."""

FAILING_CALLS = (1, 3)
"""The call of the failing method that raises (earlier and later ones run as usual): the first saves the input, saved
by no other op; the third a Tanh's output, which the next Linear saves again and shares the entry of."""

CASES = [(point, call) for point in sorted(POINTS) for call in FAILING_CALLS if point != "schedule" or call == 1]
"""``(point, failing_call)``: a step schedules one flush (its saves' writes go out as one batch), so only the first
scheduling fails."""

JOIN_S = 30.0
"""Generous: a flush that waits for a write never queued never returns."""




def _fail_at(monkeypatch, point: str, error: type[BaseException], failing_call: int) -> list[int]:
    owner, name = POINTS[point]
    original = getattr(owner, name)
    calls = [0]

    def failing(*args, **kwargs):
        calls[0] += 1
        if calls[0] == failing_call:
            raise error(f"a test fails {point}")
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, failing)
    return calls


def _flush_returns(offloader: tba.Offloader) -> None:
    thread = threading.Thread(target=offloader.flush, daemon=True)
    thread.start()
    thread.join(JOIN_S)
    assert not thread.is_alive(), "flush() waits for a write that was never queued"



def _train_failing(spill_dir, monkeypatch, path: str, point: str, error: type[BaseException], failing_call: int):
    """One step of a reusable offloader with ``point`` failing once, then one more; the gradients of the first (None
    when backward raised the TbaError), the stats and the log of its saves."""
    if path == "python":
        monkeypatch.setattr(_writes, "_start_host_write", None)
    monkeypatch.setattr(_release, "_WARNED_WRITE_ERRORS", set())  # this test's warning, whatever warned before
    model, x = model_and_input()
    lines = LogLines()
    offloader = tba.Offloader(spill_dir, min_offload_bytes=0, policy="offload")
    try:
        calls = _fail_at(monkeypatch, point, error, failing_call)
        logger = logging.getLogger("tba")
        monkeypatch.setattr(logger, "propagate", False)
        logger.addHandler(lines)
        try:
            with offloader:
                loss = model(x).square().sum()
            _control.settle()  # the deferred saves, the failing one among them
        finally:
            logger.removeHandler(lines)
        monkeypatch.undo()
        _flush_returns(offloader)
        grads = backward_after_failed_save(loss, model, error)
        del loss
        _control.settle()  # the views' deaths
        assert offloader._store.live_entries == 0 and offloader._store._writing == 0
        assert offloader._store.unwritten_bytes == 0 and not offloader._store._by_storage
        with offloader:  # the next step's saves and flush are the usual ones
            model(x).sum().backward()
        _flush_returns(offloader)
        stats = offloader.stats
    finally:
        monkeypatch.undo()
        offloader.close()
    assert calls[0] > failing_call, calls
    return grads, stats, "\n".join(lines.lines)


@pytest.mark.parametrize(("point", "failing_call"), CASES)
@pytest.mark.parametrize("path", PATHS)
def test_an_error_after_registration_keeps_the_storage_in_memory_and_training_exact(
        spill_dir, monkeypatch, open_fds, path, point, failing_call):
    fds = open_fds()
    threads = set(threading.enumerate())
    grads, stats, log = _train_failing(spill_dir, monkeypatch, path, point, MemoryError, failing_call)
    assert all(torch.equal(a, b) for a, b in zip(grads, gradients_without_tba(), strict=True))
    assert f"a test fails {point}" in log and "memory" in log
    if point != "window":  # registered whole: kept as a failed write is, and counted so
        assert stats.tensors_kept_on_error == 1, stats
    else:  # undone, then kept by the save job: counted as kept, as every tensor tba keeps in memory is
        assert stats.kept_by_reason.get(str(tba.KeepReason.SAVE_FAILED)) == 1, stats
    assert open_fds() == fds
    assert not {t for t in threading.enumerate() if t not in threads and t.name != "tba-control"}


@pytest.mark.parametrize(("point", "failing_call"), CASES)
@pytest.mark.parametrize("path", PATHS)
def test_an_interrupt_after_registration_is_undone_and_backward_says_the_save_failed(
        spill_dir, monkeypatch, open_fds, path, point, failing_call):
    fds = open_fds()
    _, stats, log = _train_failing(spill_dir, monkeypatch, path, point, KeyboardInterrupt, failing_call)
    assert "KeyboardInterrupt: a test fails" in log  # the control thread's log: it went up
    assert stats.tensors_kept_on_error == 0
    assert open_fds() == fds


class _Unprintable(Exception):
    """An error whose text cannot be made: the warning that keeps its storage in memory must still be said."""

    def __str__(self) -> str:
        raise ValueError("this error has no text")


@pytest.mark.parametrize("point", ["allocate", "write"])
@pytest.mark.parametrize("path", PATHS)
def test_an_error_without_text_still_keeps_the_storage_and_lets_a_one_shot_offloader_close(
        spill_dir, monkeypatch, path, point):
    """The undo's warning read ``str(error)`` (write_error_cause), which raised: the entry was left kept but
    registered, the save job kept the tensor a second time, and the entry stayed live for good, with a one-shot
    offloader's spill file open."""
    if path == "python":
        monkeypatch.setattr(_writes, "_start_host_write", None)
    model, x = model_and_input()
    calls = _fail_at(monkeypatch, point, _Unprintable, 1)
    logger = logging.getLogger("tba")
    monkeypatch.setattr(logger, "propagate", False)
    with tba.offload_activations(spill_dir, min_offload_bytes=0, policy="offload") as offloader:
        loss = model(x).square().sum()
    _control.settle()
    monkeypatch.undo()
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    del loss
    _control.settle()
    assert calls[0] > 1
    assert all(torch.equal(a, b) for a, b in zip(grads, gradients_without_tba(), strict=True))
    assert offloader._store.live_entries == 0
    assert offloader.stats.tensors_kept_on_error == 1 and "save failed" not in offloader.stats.kept_by_reason
    assert offloader._phase is Phase.CLOSED  # its last view died: the one-shot offloader closed its file


@pytest.mark.parametrize("point", ["window", "write"])
def test_a_kept_log_record_holds_no_failed_save(spill_dir, monkeypatch, point):
    """Note [A log record holds no failed save's frames] in tba/errors.py: the warning's record was given the error
    itself, so a handler that keeps records (here a MemoryHandler) kept its traceback's frames, and with them the
    saved tensor and the step's graph. The record holds text: the error's, or its type's name."""
    import logging.handlers

    monkeypatch.setattr(_release, "_WARNED_WRITE_ERRORS", set())
    model, x = model_and_input()
    kept = logging.handlers.MemoryHandler(capacity=1 << 20, flushLevel=logging.CRITICAL + 1)
    logger = logging.getLogger("tba")
    logger.addHandler(kept)
    try:
        offloader = tba.Offloader(spill_dir, min_offload_bytes=0, policy="offload")
        try:
            _fail_at(monkeypatch, point, MemoryError, 1)
            with offloader:
                loss = model(x).square().sum()
            _control.settle()
            monkeypatch.undo()
            loss.backward()
        finally:
            offloader.close()
    finally:
        logger.removeHandler(kept)
    records = [r for r in kept.buffer if "a test fails" in r.getMessage()]
    assert records, [r.getMessage() for r in kept.buffer]
    assert not [arg for r in records for arg in (r.args or ()) if isinstance(arg, BaseException)]
