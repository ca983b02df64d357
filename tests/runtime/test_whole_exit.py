"""The offloader's exit in C (Note [An exit that always runs] in tba/_whole_exit.py) behaves as the
Python one: where the control thread cannot take its job, with keywords, with the job's own error,
and for a read that ends after an interrupted unpack let its storage die."""

from __future__ import annotations

import gc
import logging
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from python_runs import run_python

import tba
from tba import _control, _whole_exit
from tba.io import Engine, Op, ThreadEngine

needs_extension = pytest.mark.skipif(_whole_exit.exit_block is None, reason="the native extension tba._shield is not built")


class Injected(BaseException):
    pass


def test_a_block_finalized_on_the_control_thread_exits_there(spill_dir, exit_kind):
    """A generator suspended in a block, freed by a collection the control thread runs: the exit
    job runs inline there instead of waiting for the control thread's own reply."""
    off = tba.Offloader(spill_dir, backend="threads", layers=[])

    def steps():
        with off:
            yield

    suspended = steps()
    next(suspended)
    torch._C._autograd._pop_saved_tensors_default_hooks()  # the generator's hooks, off this thread
    cycle: list = [suspended]
    cycle.append(cycle)
    del suspended, cycle
    collected = threading.Event()
    threading.Thread(target=lambda: (_control.call(gc.collect), collected.set()), daemon=True).start()
    assert collected.wait(30), "the control thread waited for itself"
    _control.settle()
    off.close()


def test_the_exit_jobs_error_is_chained_to_the_blocks_exception(spill_dir, exit_kind):
    off = tba.Offloader(spill_dir, backend="threads", layers=[])
    exit_job = off._exit_job

    def failing(failed: bool) -> None:
        exit_job(failed)
        raise RuntimeError("exit job failed")

    off._exit_job = failing
    with pytest.raises(RuntimeError, match="exit job failed") as raised:
        with off:
            raise KeyError("the user's error")
    assert isinstance(raised.value.__context__, KeyError)
    off.close()


@needs_extension
def test_the_exit_called_by_hand_takes_keywords_and_has_a_signature(spill_dir):
    off = tba.Offloader(spill_dir, backend="threads", layers=[])
    off.__enter__()
    assert off.__exit__(exc_type=None, exc=None, tb=None) is None
    assert "exc_type" in str(__import__("inspect").signature(type(off).__exit__))
    off.close()


class _GatedReads(Engine):
    """Threads engine whose reads wait for ``gate``."""

    name = "gated-reads"

    def __init__(self) -> None:
        self.inner = ThreadEngine(workers=2)
        self.pool = ThreadPoolExecutor(max_workers=2)
        self.gate = threading.Event()

    def _held(self, request):
        self.gate.wait()
        return self.inner.submit_many([request])[0].result()

    def submit_many(self, requests):
        return [self.pool.submit(self._held, r) if r.op is Op.READ else self.inner.submit_many([r])[0] for r in requests]

    def close(self) -> None:
        self.gate.set()
        self.pool.shutdown(wait=True)
        self.inner.close()


def test_a_read_that_ends_after_its_interrupted_unpack_let_the_storage_die(spill_dir, caplog):
    """The unpack is interrupted as it starts to wait; the graph is freed; the read then ends for a
    dead entry. Nothing is logged, and the next step is exact."""
    engine = _GatedReads()
    off = tba.Offloader(spill_dir, backend=engine, layers=[], policy="offload", min_offload_bytes=0,
                        prefetch_budget_bytes=0)
    x = torch.randn(256, 1024, requires_grad=True)
    with off:
        loss = (x.tanh() * 2).sigmoid().sum()
    off.flush()

    def trace(frame, event, arg):
        if event == "call" and frame.f_code.co_name == "wait" and frame.f_code.co_filename.endswith("_control.py"):
            raise Injected

    with pytest.raises(Injected):
        try:
            sys.settrace(trace)
            loss.backward()
        finally:
            sys.settrace(None)
    del loss
    gc.collect()
    _control.settle()
    caplog.clear()
    with caplog.at_level(logging.ERROR):
        engine.gate.set()
        deadline = time.monotonic() + 30
        while off._store._reading and time.monotonic() < deadline:
            time.sleep(0.01)
        _control.settle()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    x.grad = None
    with off:
        loss = (x.tanh() * 2).sigmoid().sum()
    loss.backward()
    got = x.grad.clone()
    x.grad = None
    (x.tanh() * 2).sigmoid().sum().backward()
    assert torch.equal(got, x.grad)
    off.close()
    engine.close()


def _top() -> object:
    return torch._C._autograd._top_saved_tensors_default_hooks(True)


def test_a_pair_pushed_in_the_block_and_popped_after_it_leaves_the_stack_balanced(spill_dir, exit_kind):
    """Not last in, first out: the exit pops the top pair, whoever's, and the user's later pop takes
    the offloader's; nothing more (an exit that also popped its own pair unbalanced this)."""
    def keep(tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    with torch.autograd.graph.save_on_cpu():
        below = _top()
        off = tba.Offloader(spill_dir, backend="threads", layers=[])
        with off:
            user = torch.autograd.graph.saved_tensors_hooks(keep, keep)
            user.__enter__()
        user.__exit__(None, None, None)
        assert _top() == below
        off.close()
    assert _top() is None


def test_an_entry_that_fails_keeps_the_previous_steps_profile(tmp_path):
    """A one-shot entry that fails before its runner's enter (the directory became a file) leaves
    the shared adaptive runner alone: the previous step's sample is still collected."""
    import shutil

    from torch import nn

    model = nn.Sequential(*(nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(3)))
    x = torch.randn(32, 64)
    good, bad = tmp_path / "spill", tmp_path / "gone"
    good.mkdir()
    bad.mkdir()

    def step(directory: str) -> tba.Offloader:
        ctx = tba.offload_activations(directory, backend="threads", layers=list(model), min_offload_bytes=0,
                                      profile_steps=3)
        with ctx as off:
            model(x).sum().backward()
        return off

    runner = step(str(good)).policy_runner
    ctx = tba.offload_activations(str(bad), backend="threads", layers=list(model), min_offload_bytes=0, profile_steps=3)
    shutil.rmtree(bad)
    bad.write_text("")
    with pytest.raises(tba.TbaError):
        with ctx:
            pass
    assert step(str(good)).policy_runner is runner
    assert runner._samples.count(runner._shape) == 1


def test_hooks_left_installed_after_their_block_keep_later_saves_in_memory(spill_dir, exit_kind, caplog):
    """A pair an inner context left (its exit skipped) is what the exit pops; the offloader's own
    stays installed, and tensors saved afterwards stay in memory, exactly, with one warning
    (Note [Hooks left installed after their block])."""
    def keep(tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    x = torch.randn(64, 64, requires_grad=True)
    (x.tanh() * x).sum().backward()
    want, x.grad = x.grad.clone(), None
    off = tba.Offloader(spill_dir, backend="threads", layers=[], min_offload_bytes=0)
    try:
        with off:
            torch._C._autograd._push_saved_tensors_default_hooks(keep, keep)  # never popped by its owner
        assert _top() == (off.pack, off.unpack)
        with caplog.at_level(logging.WARNING, logger="tba"):
            for _ in range(2):
                (x.tanh() * x).sum().backward()
                assert torch.equal(x.grad, want)
                x.grad = None
        assert caplog.text.count("still installed") <= 1
        assert off.stats.tensors_offloaded == 0
    finally:
        while _top() is not None:
            torch._C._autograd._pop_saved_tensors_default_hooks()
        off.close()


@needs_extension
def test_a_reply_whose_error_is_no_exception_raises_a_type_error_not_a_crash():
    """The C exit raised the reply's error as it stood: a reply whose error was no exception (a job's reply put by
    hand, not by the control thread's ``except``) gave ``PyException_GetTraceback`` a non-exception, a segmentation
    fault; the Python exit's ``raise error`` is a TypeError."""
    script = (
        "import queue, threading, types\n"
        "from tba._shield import exit_block\n"
        "class Jobs:\n"
        "    def put(self, item):\n"
        "        reply, job, args = item\n"
        "        reply.put(job(*args))\n"
        "state = types.SimpleNamespace(stopped=False, thread_ident=threading.get_ident() + 1, jobs=Jobs())\n"
        "control = types.SimpleNamespace(_control=state)\n"
        "try:\n"
        "    exit_block(print, lambda top: None, control, queue.SimpleQueue(), lambda failed: ('no exception', None),\n"
        "               print, [threading.get_ident()], None, None, None)\n"
        "except TypeError as error:\n"
        "    print('TypeError', error)\n"
    )
    done = run_python(["-c", script], timeout=60)
    assert done.returncode == 0 and done.stdout.startswith("TypeError"), (done.returncode, done.stdout, done.stderr)
