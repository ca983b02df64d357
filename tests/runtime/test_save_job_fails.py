"""A save job that fails after its store save returned leaves no live view behind (Note [A save job that fails after
the store saved] in tba/runtime/_hooks.py): the discovery's ``note_saved``, the view's finalizer or what follows it
raising left the entry counted live for good (a one-shot offloader never closed its spill file) and the view without
an entry ('save never ran' at unpack). Now the tensor stays in memory, counted as kept, and training is exact; an
interrupt is undone and goes up, and backward says the save failed."""

from __future__ import annotations

import logging
import threading

import pytest
import torch
from save_failures import LogLines, backward_after_failed_save, gradients_without_tba, model_and_input

import tba
from tba import _control
from tba.runtime import _hooks
from tba.runtime._discover import LayerDiscovery
from tba.runtime._unpack_hooks import Phase
from tba.runtime._views import SavedView

FAILING_CALLS = (1, 3)
"""The failing call: the first saves the input, saved by no other op; the third, for the finalizer and what follows
it, a second view of an entry (a Tanh's output, which the next Linear saves again: deduplicated)."""





def _fail_at(monkeypatch, point: str, error: type[BaseException], failing_call: int) -> list[int]:
    """Make ``point`` raise ``error`` at its ``failing_call``-th call from a save job."""
    calls = [0]

    def failing_on(original, counted=lambda *args: True):
        def failing(*args, **kwargs):
            if counted(*args):
                calls[0] += 1
                if calls[0] == failing_call:
                    raise error(f"a test fails {point}")
            return original(*args, **kwargs)
        return failing

    if point == "note_saved":
        monkeypatch.setattr(LayerDiscovery, "note_saved", failing_on(LayerDiscovery.note_saved))
    elif point == "finalizer":
        monkeypatch.setattr(_control, "finalizer", failing_on(_control.finalizer, lambda kind, obj: kind is _hooks._ViewDied))
    else:  # after the finalizer is made and filled in
        monkeypatch.setattr(_hooks, "untrack", failing_on(_hooks.untrack))
    return calls


def _step(spill_dir, monkeypatch, offloader: tba.Offloader | None, point: str, error: type[BaseException],
          failing_call: int):
    """One step with ``point`` failing once: the offloader that ran it, the gradients (None when backward raised
    the TbaError), the stats and tba's log."""
    model, x = model_and_input()
    lines = LogLines()
    logger = logging.getLogger("tba")
    monkeypatch.setattr(logger, "propagate", False)
    logger.addHandler(lines)
    try:
        calls = _fail_at(monkeypatch, point, error, failing_call)
        context = offloader or tba.offload_activations(spill_dir, min_offload_bytes=0, policy="offload")
        with context as entered:
            loss = model(x).square().sum()
        _control.settle()  # the deferred saves, the failing one among them
    finally:
        logger.removeHandler(lines)
        monkeypatch.undo()
    assert calls[0] >= failing_call, calls
    grads = backward_after_failed_save(loss, model, error)
    del loss
    _control.settle()  # the views' deaths
    return entered, grads, entered.stats, "\n".join(lines.lines)


def _saved_tensors() -> int:
    """How many tensors the step saves (what ``tensors_offloaded + tensors_kept`` must come to)."""
    saved = []
    model, x = model_and_input()
    with torch.autograd.graph.saved_tensors_hooks(lambda tensor: saved.append(1) or tensor, lambda tensor: tensor):
        model(x).square().sum()
    return len(saved)


POINTS = ("note_saved", "finalizer", "untrack")


@pytest.mark.parametrize("failing_call", FAILING_CALLS)
@pytest.mark.parametrize("point", POINTS)
@pytest.mark.parametrize("reusable", [False, True])
def test_an_error_keeps_the_tensor_in_memory_and_training_exact(spill_dir, monkeypatch, open_fds, reusable, point,
                                                               failing_call):
    fds, threads = open_fds(), set(threading.enumerate())
    offloader = tba.Offloader(spill_dir, min_offload_bytes=0, policy="offload") if reusable else None
    try:
        entered, grads, stats, log = _step(spill_dir, monkeypatch, offloader, point, MemoryError, failing_call)
        assert all(torch.equal(a, b) for a, b in zip(grads, gradients_without_tba(), strict=True))
        assert entered._store.live_entries == 0 and not entered._store._by_storage
        assert reusable or entered._phase is Phase.CLOSED  # its last view died: the one-shot offloader closed its file
        assert f"a test fails {point}" in log, log
        assert stats.kept_by_reason.get(str(tba.KeepReason.SAVE_FAILED)) == 1, stats
        assert stats.tensors_offloaded + stats.tensors_kept == _saved_tensors(), stats
        if reusable:
            with offloader:  # the next step is the usual one
                model, x = model_and_input()
                model(x).sum().backward()
            _control.settle()
            assert offloader._store.live_entries == 0
    finally:
        if offloader is not None:
            offloader.close()
        tba.shutdown()  # the one-shot context's shared runtime, idle
    assert open_fds() == fds
    assert not {t for t in threading.enumerate() if t not in threads and t.name != "tba-control"}


@pytest.mark.parametrize("point", POINTS)
@pytest.mark.parametrize("reusable", [False, True])
def test_an_interrupt_is_undone_and_backward_says_the_save_failed(spill_dir, monkeypatch, open_fds, reusable, point):
    fds = open_fds()
    offloader = tba.Offloader(spill_dir, min_offload_bytes=0, policy="offload") if reusable else None
    try:
        entered, _, stats, log = _step(spill_dir, monkeypatch, offloader, point, KeyboardInterrupt, 1)
        assert "KeyboardInterrupt: a test fails" in log  # the control thread's log: it went up
        assert entered._store.live_entries == 0 and not entered._store._by_storage
        assert reusable or entered._phase is Phase.CLOSED
        assert stats.tensors_offloaded + stats.tensors_kept == _saved_tensors() - 1, stats  # the interrupted one: none
    finally:
        if offloader is not None:
            offloader.close()
        tba.shutdown()
    assert open_fds() == fds


class _Records(logging.Handler):
    """Keeps tba's records, as pytest's caplog or a ``MemoryHandler`` does: the warning's error, its traceback and
    the failed job's frame, which holds the view and its unregistered finalizer, live as long as the record."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.mark.parametrize("failing_call", FAILING_CALLS)
def test_a_record_that_outlives_the_view_drops_it_once(spill_dir, monkeypatch, failing_call):
    """The failed job's frame, kept by a log record, frees the view before the unregistered finalizer that it also
    holds: that finalizer fired then, and dropped the view a second time (live_entries -1)."""
    records, logger = _Records(), logging.getLogger("tba")
    monkeypatch.setattr(logger, "propagate", False)
    logger.addHandler(records)
    offloader = tba.Offloader(spill_dir, min_offload_bytes=0, policy="offload")
    try:
        with monkeypatch.context() as patched:
            _fail_at(patched, "untrack", MemoryError, failing_call)
            model, x = model_and_input()
            with offloader:
                loss = model(x).square().sum()
            _control.settle()
        loss.backward()
        assert all(torch.equal(p.grad, want) for p, want in zip(model.parameters(), gradients_without_tba(),
                                                                strict=True))
        del loss
        records.records.clear()  # the frame goes: the view, then its finalizer
        _control.settle()
        assert offloader._store.live_entries == 0 and not offloader._store._by_storage
    finally:
        logger.removeHandler(records)
        offloader.close()


class _UnprintableInterrupt(KeyboardInterrupt):
    def __str__(self) -> str:
        raise ValueError("this interrupt has no text")


def test_a_save_failed_without_text_is_named_by_its_type_and_the_interrupt_is_not_replaced():
    """The view keeps the failed save's type and text for its unpack; an error whose text cannot be made (Note [A
    failed write's warning never raises]) raised a ValueError there instead, which replaced the interrupt going up."""
    view = SavedView(None, torch.ones(4))
    view.save_failed(_UnprintableInterrupt())
    assert view.error.endswith("the save of this tensor failed (_UnprintableInterrupt); run forward again")
