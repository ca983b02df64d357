"""An exception at every Python call of a step, one at a time: what a signal handler can do.

CPython runs a signal handler's code when a Python frame starts (Note [An exit that always runs]
in tba/_whole_exit.py), among other points. ``sys.settrace`` reaches exactly those points: a trace
function that raises on a frame's ``call`` event raises before that frame's first line. Each case
runs one step (enter, forward, exit, backward) with the exception at the k-th Python frame started
on the training thread, for every k until a step starts fewer frames than k. Whatever k, the
exception reaches the caller, no saved-tensor hook is left on the thread, the offloader ends closed
with its shared runtime given back, and the step without an exception is exact. The randomised
version with real signals is ``test_async_exceptions.py``; this one is deterministic. It found
what the randomised test hit about once in a hundred runs: an exit skipped by an exception at its
first line (Note [An exit that always runs] in tba/_whole_exit.py), and a wait for a read that
kept a ``Future``'s lock and hung the next step (Note [Waiting without a Python lock] in
tba/_outcome.py). The step flushes its writes before backward, with no prefetch window, so that
backward waits for reads.
"""

from __future__ import annotations

import gc
import linecache
import os
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
from injection import Injected, raise_at_line
from torch.nn.modules import module as module_hooks

import tba
from tba import _control, _whole_exit
from tba.runtime import _overlap, _shared
from tba.runtime._unpack_hooks import Phase


def _raise_at_call(k: int) -> tuple:
    """A trace function that raises :class:`Injected` when the k-th frame starts, and its counter."""
    started = [0]

    def trace(frame: Any, event: str, arg: object) -> None:
        if event == "call":
            started[0] += 1
            if started[0] == k:
                trace.landed = frame.f_code
                raise Injected
        return None

    trace.landed = None
    return trace, started


def _traced_step(ctx: tba.Offloader, trace: object, forward: Callable[[], torch.Tensor]) -> tuple:
    """``forward()`` in ``ctx``, its writes flushed, then backward, under ``trace``; returns the
    offloader, the :class:`Injected` caught (or None) and the loss (None when forward did not end)."""
    caught = loss = None
    try:
        sys.settrace(trace)
        with ctx:
            loss = forward()
        ctx.flush()  # the writes end and the bytes leave memory: backward waits for reads
        loss.backward()
    except Injected as err:
        caught = err
        err.__traceback__ = None  # no cycle through the frames: dropping the loss frees the graph at once
    finally:
        sys.settrace(None)
    return ctx, caught, loss


def _assert_released(ctx: tba.Offloader, k: int) -> None:
    """Once what the step left is freed: ``ctx`` ended, and its shared runtime was given back."""
    _control.settle()
    if ctx._phase is Phase.EXITED:  # a graph held by a reference cycle
        gc.collect()
        _control.settle()
    assert ctx._phase in (Phase.IDLE, Phase.CLOSED, Phase.DISCARDED), f"call {k}: left {ctx._phase.value}"
    assert not _shared._busy, f"call {k}: the shared runtime was not given back"


def _step(directory: str, backend: str, x: torch.Tensor, w: torch.Tensor, trace: object) -> tuple:
    ctx = tba.offload_activations(directory, backend=backend, policy="offload", min_offload_bytes=0, prefetch_budget_bytes=0)
    return _traced_step(ctx, trace, lambda: (x.tanh() * w).sigmoid().sum())


def _every_call(directory: str, backend: str, until_skipped: bool = False) -> int:
    """Run the step with the exception at each call in turn; returns how many exits it skipped
    (stops at the first one with ``until_skipped``)."""
    # Garbage earlier tests left in cycles (torch.compile's) holds weak references whose Python callbacks
    # would run inside a traced step when the collector frees it, and drop the exception there.
    gc.collect()
    x = torch.randn(64, 256, requires_grad=True)
    w = torch.randn(64, 256, requires_grad=True)
    (x.tanh() * w).sigmoid().sum().backward()
    want = x.grad.clone(), w.grad.clone()
    _step(directory, backend, x, w, None)  # imports done lazily by a first step happen here
    skipped_exits = 0
    for k in range(1, 2000):
        x.grad = w.grad = None
        trace, started = _raise_at_call(k)
        ctx, caught, loss = _step(directory, backend, x, w, trace)
        if ctx._phase is Phase.ACTIVE:  # its exit never ran: undone here, counted
            skipped_exits += 1
            if torch._C._autograd._top_saved_tensors_default_hooks(True) == (ctx.pack, ctx.unpack):
                torch._C._autograd._pop_saved_tensors_default_hooks()
            _control.call_whole(ctx._exit_job, True)
            if until_skipped:
                return skipped_exits
        assert torch._C._autograd._top_saved_tensors_default_hooks(True) is None, f"hooks left by an exception at call {k}"
        # Note [A recomputation puts back the modules outside its layer that it calls] in tba/runtime/_outside_state.py
        assert not module_hooks._global_forward_pre_hooks, f"a module hook left by an exception at call {k}"
        # Note [A recomputation and a first call of its state in two threads] in tba/runtime/_overlap.py
        assert not _overlap._uses, f"a use left by an exception at call {k}"
        injected = started[0] >= k
        assert (caught is not None) == injected, f"call {k}: the exception was swallowed"
        del loss, caught
        _assert_released(ctx, k)
        if not injected:
            assert torch.equal(x.grad, want[0]) and torch.equal(w.grad, want[1])
            break
    else:
        pytest.fail("a step kept starting new frames")
    assert k > 50, f"the trace saw {k} calls, too few to have covered a step"
    return skipped_exits


@pytest.mark.timeout(180)
@pytest.mark.skipif(_whole_exit.exit_block is None, reason="the native extension tba._shield is not built")
def test_an_exception_at_any_python_call_of_a_step_leaves_nothing_open(spill_dir, backend):
    assert _every_call(spill_dir, backend) == 0


@pytest.mark.timeout(180)
def test_the_python_exit_is_what_an_exception_at_its_first_line_skips(spill_dir, monkeypatch):
    """Without the extension the exit is Python, and this test's method finds the gap it leaves."""
    monkeypatch.setattr(_whole_exit, "exit_block", None)
    assert _every_call(spill_dir, "threads", until_skipped=True) > 0


@pytest.mark.parametrize("decision", ["recompute", "offloaded_recompute"])
def test_an_entry_undone_by_an_exception_unwraps_the_recomputed_layers(spill_dir, decision):
    """An exception as the hooks go on (the entry's last step) undoes the entry, and with it the
    plan's wrapped forwards: the next step used to raise that the layer's forward was patched."""
    from torch import nn

    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
    x = torch.randn(4, 16)
    plan = tba.Plan(("offload", decision), window_bytes=0)

    def trace(frame, event, arg):
        if frame.f_code.co_qualname != "StepCycle.__enter__":
            return None
        if event == "line" and "_push_saved_tensors_default_hooks(" in linecache.getline(frame.f_code.co_filename,
                                                                                          frame.f_lineno):
            raise Injected
        return trace

    with pytest.raises(Injected):
        try:
            sys.settrace(trace)
            with tba.offload_activations(spill_dir, backend="threads", layers=list(model), policy=plan):
                pass
        finally:
            sys.settrace(None)
    assert all("forward" not in vars(layer) for layer in model)
    with tba.offload_activations(spill_dir, backend="threads", layers=list(model), policy=plan):
        model(x).sum().backward()


def _torch_exit(code: Any) -> bool:
    """Whether ``code`` is a context manager's ``__exit__`` of torch's."""
    return code is not None and code.co_name == "__exit__" and f"{os.sep}torch{os.sep}" in code.co_filename


def _calls_of_a_step(step: Callable[[object], Any]) -> list[int]:
    """The frame starts of ``step`` that first call each (function, caller) pair: where the code
    that runs differs, from about 1,800 frame starts to about 280."""
    seen: dict[tuple, int] = {}
    started = [0]

    def trace(frame: Any, event: str, arg: object) -> None:
        if event == "call":
            started[0] += 1
            caller = frame.f_back.f_code if frame.f_back is not None else None
            seen.setdefault((frame.f_code, caller), started[0])

    step(trace)
    return sorted(seen.values())


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(_whole_exit.exit_block is None, reason="the native extension tba._shield is not built: the Python exit "
                    "has the gap test_the_python_exit_is_what_an_exception_at_its_first_line_skips finds")
def test_an_exception_at_each_distinct_call_of_a_mixed_plan_step_leaves_training_exact(spill_dir, monkeypatch):
    """Every placement in one step (keep, offload, recompute, offloaded recompute), the exception
    at the first call of each (function, caller) pair of the step: nothing left on the thread, no
    runtime held, and the steps after it exact. An exception that Python drops in a weak-reference
    callback of torch's or the standard library's (Note [Signals that land in a weakref callback] in
    async_exc_worker.py) is accepted; one dropped in tba's is not."""
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Dropout(0.1)) for _ in range(4)))
    x = torch.randn(32, 64)
    plan = tba.Plan(("offload", "recompute", "offloaded_recompute", "keep"), window_bytes=0)
    dropped: list[str] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: dropped.append(getattr(u.object, "__module__", None) or "?"))

    def step(trace: object) -> tuple:
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        ctx = tba.offload_activations(spill_dir, backend="threads", layers=list(model), policy=plan,
                                      min_offload_bytes=0)
        return _traced_step(ctx, trace, lambda: model(x).square().mean())

    step(None)
    want = [p.grad.clone() for p in model.parameters()]
    points = _calls_of_a_step(step)
    assert len(points) > 150, f"{len(points)} distinct calls, too few for a step with every placement"
    for n, k in enumerate(points):
        trace, started = _raise_at_call(k)
        dropped.clear()
        ctx, caught, loss = step(trace)
        if _torch_exit(trace.landed):
            # torch's own Python exit skipped (checkpoint's hooks): a pair stays, documented in docs/api.md
            while torch._C._autograd._top_saved_tensors_default_hooks(True) is not None:
                torch._C._autograd._pop_saved_tensors_default_hooks()
        assert torch._C._autograd._top_saved_tensors_default_hooks(True) is None, f"hooks left by an exception at call {k}"
        # Note [A recomputation puts back the modules outside its layer that it calls] in tba/runtime/_outside_state.py
        assert not module_hooks._global_forward_pre_hooks, f"a module hook left by an exception at call {k}"
        # Note [A recomputation and a first call of its state in two threads] in tba/runtime/_overlap.py
        assert not _overlap._uses, f"a use left by an exception at call {k}"
        injected = started[0] >= k  # a step may start a few frames fewer than the counted one
        assert not injected or caught is not None or [m for m in dropped if not m.startswith("tba")], f"call {k}: swallowed"
        assert not [m for m in dropped if m.startswith("tba")], f"call {k}: dropped in {dropped}"
        del loss, caught
        _assert_released(ctx, k)
        if n % 8 == 0 or n == len(points) - 1:
            _, caught, loss = step(None)
            assert caught is None and all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), want)), f"after {k}"
            del loss


@pytest.mark.parametrize("reusable", [True, False], ids=["reusable", "one-shot"])
def test_an_exception_at_any_line_of_the_entry_leaves_no_hooks_and_no_entry(spill_dir, reusable):
    """A trace function's exception at each line of ``StepCycle.__enter__`` in turn, under a user's own
    hooks: the user's pair is on top again and the offloader is not left entering or active. At the
    line between the entry job and the push, or at the return, it was: the offloader stayed entering
    for good (a one-shot one never gave its runtime back), or active with its hooks pushed and no exit."""

    def user_pack(tensor):
        return tensor

    line = 0
    for k in range(1, 100):
        trace, seen = raise_at_line(k, lambda code: code.co_qualname == "StepCycle.__enter__")
        ctx = (tba.Offloader if reusable else tba.offload_activations)(spill_dir, backend="threads")
        with torch.autograd.graph.saved_tensors_hooks(user_pack, user_pack):
            user = torch._C._autograd._top_saved_tensors_default_hooks(True)
            try:
                sys.settrace(trace)
                with ctx:
                    pass
            except Injected:
                pass
            finally:
                sys.settrace(None)
            top = torch._C._autograd._top_saved_tensors_default_hooks(True)
            if top != user:
                torch._C._autograd._pop_saved_tensors_default_hooks()
            assert top == user, f"line {k} of the entry left the offloader's hooks on the thread"
        _control.settle()
        assert ctx._phase not in (Phase.ENTERING, Phase.ACTIVE), f"line {k} of the entry left it {ctx._phase.value}"
        assert ctx._entered == [0], f"line {k} of the entry left this thread recorded as the one that entered"
        ctx.close()
        if seen[0] < k:
            line = k
            break
    assert line > 4, "the trace saw too few lines of the entry"
    assert not _shared._busy


def test_a_second_entry_refused_keeps_the_first_blocks_hooks(spill_dir):
    offloader = tba.Offloader(spill_dir, backend="threads")
    with offloader:
        pair = torch._C._autograd._top_saved_tensors_default_hooks(True)
        with pytest.raises(tba.TbaError, match="already entered"), offloader:
            pass
        assert torch._C._autograd._top_saved_tensors_default_hooks(True) == pair
    assert torch._C._autograd._top_saved_tensors_default_hooks(True) is None
    offloader.close()
