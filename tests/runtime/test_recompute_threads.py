"""A recomputation in one thread overlapping a first call of the same layer (or of a module it puts back) in another is
refused with TbaError on both threads (Note [A recomputation and a first call of its state in two threads] in
tba/runtime/_overlap.py). Before, the recomputation put back the state that was live before it and silently undid the
other thread's BatchNorm update: the running statistics differed from training without tba, gradients did not."""

from __future__ import annotations

import copy
import os
import threading

import pytest
import torch
from torch import nn

import tba
from tba import TbaError

WIDTH = 8
STOP_IN: dict = {}


class Hold(nn.Module):
    """Waits, where the thread named ``STOP_IN["thread"]`` runs it, until the test lets it go: the overlap, forced.
    Which thread, and the events, are not the module's state, which a recomputation puts back as its first call saw it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if threading.current_thread().name == STOP_IN["thread"]:
            STOP_IN["inside"].set()
            assert STOP_IN["go"].wait(30), "never let go"
        return x


class Block(nn.Module):
    def __init__(self, shared: list[nn.Module] | None, hold: Hold) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.BatchNorm1d(WIDTH) if shared is None else None
        self.refs = shared  # a list hides the module from modules(): outside the layer
        object.__setattr__(self, "hold", hold)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        norm = self.norm if self.refs is None else self.refs[0]
        return torch.sin(norm(self.linear(self.hold(x))))


def _model(outside: bool) -> tuple[nn.Sequential, list[nn.Module], Hold]:
    torch.manual_seed(0)
    STOP_IN.update(thread="", inside=threading.Event(), go=threading.Event())
    hold = Hold()
    shared = [nn.BatchNorm1d(WIDTH)] if outside else None
    return nn.Sequential(*[Block(shared, hold) for _ in range(2)]), shared or [], hold


def _x(step: int) -> torch.Tensor:
    return torch.randn(16, WIDTH, generator=torch.Generator().manual_seed(step), requires_grad=True)


def _backward_thread(loss: torch.Tensor, errors: dict[str, BaseException], held_by: str = "backward") -> threading.Thread:
    """A thread named ``backward`` that runs ``loss.backward()`` once started, keeping its error in ``errors``, and lets
    the held module go when it ends; the module holds in the thread named ``held_by``."""

    def backward() -> None:
        try:
            loss.backward()
        except BaseException as err:  # noqa: BLE001  # the test reads it
            errors["backward"] = err
        finally:
            STOP_IN["go"].set()

    STOP_IN["thread"] = held_by
    return threading.Thread(target=backward, name="backward")


@pytest.mark.parametrize("outside", [False, True], ids=["own", "outside"])
@pytest.mark.parametrize("placement", ["recompute", "offloaded_recompute"])
@pytest.mark.parametrize("held", ["recomputation", "first call"])
def test_overlap_in_two_threads_is_refused(spill_dir, placement, outside, held):
    model, shared, hold = _model(outside)
    off = tba.Offloader(spill_dir, layers=list(model), policy=tba.Plan((placement,) * 2, 1 << 20), min_offload_bytes=0)
    with off:
        first = model(_x(0)).pow(2).sum()
    errors: dict[str, BaseException] = {}
    thread = _backward_thread(first, errors, "backward" if held == "recomputation" else "MainThread")
    try:
        if held == "recomputation":
            thread.start()
            assert STOP_IN["inside"].wait(30)  # the backward thread is inside the last layer's recomputation
        else:
            STOP_IN["go"].clear()
            threading.Timer(0, lambda: (STOP_IN["inside"].wait(30), thread.start())).start()
        with off:
            model(_x(1)).pow(2).sum()
    except TbaError as err:
        errors["forward"] = err
    finally:
        STOP_IN["go"].set()
        thread.join()
        off.close()
    assert set(errors) == {"forward", "backward"}, errors
    for err in errors.values():
        assert isinstance(err, TbaError), err
        assert "Run the backward before the next forward" in str(err) and "or in the same thread" in str(err)


@pytest.mark.parametrize("outside", [False, True], ids=["own", "outside"])
def test_backward_in_a_thread_that_does_not_overlap_is_exact(spill_dir, outside):
    """Backward in another thread, joined before the next forward: exact, nothing refused."""
    reference, ref_shared, _ = _model(outside)
    model, shared, _ = _model(outside)
    for step in range(3):
        reference(_x(step)).pow(2).sum().backward()
    off = tba.Offloader(spill_dir, layers=list(model), policy=tba.Plan(("recompute",) * 2, 1 << 20), min_offload_bytes=0)
    for step in range(3):
        with off:
            loss = model(_x(step)).pow(2).sum()
        thread = threading.Thread(target=loss.backward)
        thread.start()
        thread.join()
    off.close()
    for a, b in zip([*reference.state_dict().values(), *(m.running_mean for m in ref_shared)],
                    [*model.state_dict().values(), *(m.running_mean for m in shared)]):
        assert torch.equal(a, b)
    for a, b in zip(reference.parameters(), model.parameters()):
        assert torch.equal(a.grad, b.grad)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_child_forked_during_another_threads_recomputation_is_not_refused(spill_dir, tmp_path):
    """The use of the parent's backward thread, held at the fork, is not the child's: its own step runs."""
    model, _, _ = _model(False)
    off = tba.Offloader(spill_dir, layers=list(model), policy=tba.Plan(("recompute",) * 2, 1 << 20), min_offload_bytes=0)
    with off:
        first = model(_x(0)).pow(2).sum()
    STOP_IN["thread"] = "backward"
    thread = threading.Thread(target=first.backward, name="backward")
    thread.start()
    try:
        assert STOP_IN["inside"].wait(30)
        pid = os.fork()
        if pid == 0:  # the child: a step of its own, on a fresh offloader
            code = 1
            try:
                child = tba.Offloader(str(tmp_path), layers=list(model),
                                      policy=tba.Plan(("recompute",) * 2, 1 << 20), min_offload_bytes=0)
                with child:
                    loss = model(_x(1)).pow(2).sum()
                loss.backward()
                child.close()
                code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
    finally:
        STOP_IN["go"].set()
        thread.join()
        off.close()
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.mark.parametrize("caller", ["evaluation", "kept layer"])
def test_a_call_outside_tba_during_a_recomputation_in_another_thread_is_refused(spill_dir, caller):
    """An evaluation after the with block, or a kept layer sharing the recomputed one's BatchNorm, run on the main
    thread while the backward thread recomputes: refused on both threads (before, the evaluation read the statistics
    the recomputation had put back, and the kept layer's update was undone)."""
    model, shared, _ = _model(caller == "kept layer")
    placement = ("recompute", "keep") if caller == "kept layer" else ("recompute",) * 2
    off = tba.Offloader(spill_dir, layers=list(model), policy=tba.Plan(placement, 1 << 20), min_offload_bytes=0)
    with off:
        first = model(_x(0)).pow(2).sum()
    errors: dict[str, BaseException] = {}
    thread = _backward_thread(first, errors)
    thread.start()
    try:
        assert STOP_IN["inside"].wait(30)  # inside the recomputation of a block
        if caller == "evaluation":
            model.eval()
            with torch.no_grad():
                model(_x(1))
        else:
            with off:
                model[1](_x(1))  # the kept block alone, which calls what the recomputed one does
    except TbaError as err:
        errors["forward"] = err
    finally:
        STOP_IN["go"].set()
        thread.join()
        off.close()
    assert set(errors) == {"forward", "backward"}, errors
    assert all(isinstance(error, TbaError) for error in errors.values()), errors
    assert "Run the backward before the next forward or evaluation, or in the same thread" in str(errors["forward"])


def test_a_training_forward_of_another_module_during_a_recomputation_in_another_thread_runs(spill_dir):
    """A module no recomputation uses, called in training mode on the main thread while the backward thread recomputes
    (an EMA or evaluation model with BatchNorm), runs, and so does the backward: refusing every call in training mode
    there (for the global generators' sake, Note [A recomputation and a first call of its state in two threads] in
    tba/runtime/_overlap.py) refused such models at random, whenever a call met a recomputation."""
    model, _, _ = _model(False)
    other = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH))
    want = copy.deepcopy(other)
    off = tba.Offloader(spill_dir, layers=list(model), policy=tba.Plan(("recompute",) * 2, 1 << 20), min_offload_bytes=0)
    with off:
        first = model(_x(0)).pow(2).sum()
    errors: dict[str, BaseException] = {}
    thread = _backward_thread(first, errors)
    thread.start()
    try:
        assert STOP_IN["inside"].wait(30)  # inside the recomputation of a block
        got = other(_x(1))
    finally:
        STOP_IN["go"].set()
        thread.join()
        off.close()
    assert errors == {}, errors
    assert torch.equal(got, want(_x(1))) and torch.equal(other[1].running_mean, want[1].running_mean)
