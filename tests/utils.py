"""Helpers for the tests: gradient comparison and an engine that injects faults."""

from __future__ import annotations

import contextlib
import errno
import gc
import importlib.util
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn

import tba
from tba import _control
from tba.device._ops import DeviceOps
from tba.errors import ShortTransferError
from tba.io import Engine, Op, Request, ThreadEngine


def load_script(path: Path) -> ModuleType:
    """Import the script at ``path`` (under ``examples/``) as the module named by its file name.

    The module is registered in ``sys.modules`` first, so scripts that import a sibling by name
    find it once that sibling was loaded the same way; ``sys.path`` is left alone.
    """
    name = path.stem
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


class _Finalizing:
    """Cyclic garbage whose finalizer lets another thread run while the collector works, until ``stop``
    (a ``time.monotonic()``); after it, the finalizer does nothing.

    No collection starts while another runs its finalizers, so the garbage the other threads make meanwhile
    waits for the next one: one run ended with about 100,000 such objects left when the threads stopped,
    which one thread then finalized alone, a 75 us ``sleep(0)`` each with no other thread to switch to
    (8 s of a 1.5 s run). Those finalizers now return at once."""

    def __init__(self, stop: float) -> None:
        self.me = self
        self.stop = stop

    def __del__(self) -> None:
        if time.monotonic() < self.stop:
            time.sleep(0)


def threads_under_the_collector(new_body: Callable[[], Callable[[], None]], seconds: float = 1.5,
                                threads: int = 4) -> list[str]:
    """Run ``threads`` threads for ``seconds``, each calling its own ``new_body()`` in a loop beside cyclic
    garbage whose finalizers switch threads, with the collector run often; returns the errors raised."""
    errors: list[str] = []
    stop = time.monotonic() + seconds

    def worker() -> None:
        body = new_body()
        try:
            while time.monotonic() < stop:
                body()
                _Finalizing(stop)
        except Exception as err:  # noqa: BLE001 - any error is the failure
            errors.append(repr(err))

    thresholds = gc.get_threshold()
    gc.set_threshold(50, 1, 1)
    try:
        running = [threading.Thread(target=worker) for _ in range(threads)]
        for thread in running:
            thread.start()
        for thread in running:
            thread.join()
    finally:
        gc.set_threshold(*thresholds)
    return errors


def run_step(model: nn.Module, forward: Callable[[nn.Module], torch.Tensor], offloader=None, *,
             backward_passes: int = 1, seed: int = 1234, flush: bool = True):
    """One forward (inside ``offloader`` when given) and backward; returns (loss, grads by name).

    With ``flush`` every write completes before forward ends, so the storages are on disk (and
    backward reads them from the file) whatever the disk's speed; without it backward races the
    writes, as in training.
    """
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    if offloader is None:
        loss = forward(model)
    else:
        with offloader:
            loss = forward(model)
            if flush:
                offloader.flush()
    for index in range(backward_passes):
        loss.backward(retain_graph=index + 1 < backward_passes)
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def assert_exact(model: nn.Module, forward: Callable[[nn.Module], torch.Tensor], directory: str,
                 backend: str | Engine = "threads", *, backward_passes: int = 1, flush: bool = True,
                 **options) -> tba.Offloader:
    """Gradients and loss with tba are torch.equal to those without; returns the offloader."""
    ref_loss, ref_grads = run_step(model, forward, backward_passes=backward_passes)
    options.setdefault("min_offload_bytes", 0)
    offloader = tba.offload_activations(directory, backend=backend, **options)
    loss, grads = run_step(model, forward, offloader, backward_passes=backward_passes, flush=flush)
    assert torch.equal(ref_loss, loss), (ref_loss, loss)
    assert ref_grads.keys() == grads.keys()
    assert ref_grads, "the model produced no gradients"
    for name in ref_grads:
        assert torch.equal(ref_grads[name], grads[name]), f"gradient of {name} differs"
    return offloader


def backward_twice_past_held_writes(offloader: tba.Offloader, xs: Sequence[torch.Tensor], release: threading.Event,
                                    *, min_skipped: int) -> list[torch.Tensor]:
    """Skipped device writes (Note [A write nobody needs is not started] in ``tba/device/_protocol.py``).

    Forward ``tanh`` of each leaf in ``xs`` under ``offloader`` while the caller holds its device
    writes back, backward through a retained graph, ``release`` the writes, then backward again:
    both backwards must be exact, and at least ``min_skipped`` writes skipped (the second backward
    finds those storages in memory). Returns the losses, whose graph the caller frees.
    """
    want = [torch.autograd.grad(torch.tanh(x).pow(2).sum(), x)[0] for x in xs]
    with offloader:
        ys = [torch.tanh(x) for x in xs]
    losses = [y.pow(2).sum() for y in ys]
    del ys
    torch.autograd.backward(losses, retain_graph=True)
    _control.settle()
    release.set()
    offloader.flush()
    assert all(torch.equal(x.grad, g) for x, g in zip(xs, want))
    assert offloader.stats.writes_skipped >= min_skipped, str(offloader.stats.as_dict())
    for x in xs:
        x.grad = None
    torch.autograd.backward(losses)
    assert all(torch.equal(x.grad, g) for x, g in zip(xs, want)), "the second backward differs"
    return losses


def call_skipped_writes_written(monkeypatch) -> None:
    """Mutant (helper-58): a skipped write marks its live storage ON_DISK instead of KEPT, as if written."""
    from tba.runtime._entry import State
    from tba.runtime._release import StoreRelease

    skip = StoreRelease._skip_unwritten

    def skip_but_call_it_written(self, entry):
        skip(self, entry)
        if entry.state is State.KEPT:
            entry.state = State.ON_DISK

    monkeypatch.setattr(StoreRelease, "_skip_unwritten", skip_but_call_it_written)


def steps_equal(reference: tuple, result: tuple) -> bool:
    """Whether two :func:`run_step` results have ``torch.equal`` losses and gradients."""
    (ref_loss, ref), (loss, got) = reference, result
    return torch.equal(ref_loss, loss) and ref.keys() == got.keys() and all(torch.equal(ref[n], got[n]) for n in ref)


def finish_rank(out: str, result: dict) -> None:
    """End one rank of a multi-process test: write ``<out>/rank<N>.json``, wait for every rank, leave the group."""
    import torch.distributed as dist

    with open(os.path.join(out, f"rank{result['rank']}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


class FaultyEngine(Engine):
    """A thread engine whose writes or reads fail, come back short, or wait for a gate.

    Args:
        write_errno: Fail every write with this errno (None: writes succeed).
        read_errno: Fail every read with this errno.
        short_reads: Make reads fail as a short read at end of file.
        gate: When set, writes start only after the event is set.
    """

    name = "faulty"

    def __init__(self, *, write_errno: int | None = None, read_errno: int | None = None,
                 short_reads: bool = False, gate: threading.Event | None = None) -> None:
        self.inner = ThreadEngine(workers=4)
        self._gated = ThreadPoolExecutor(max_workers=4, thread_name_prefix="tba-test-gate")
        self.write_errno = write_errno
        self.read_errno = read_errno
        self.short_reads = short_reads
        self.gate = gate
        self.failed = 0
        self.closed = False

    def _failure(self, request: Request) -> OSError | None:
        if request.op is Op.WRITE and self.write_errno is not None:
            return OSError(self.write_errno, errno.errorcode[self.write_errno])
        if request.op is Op.READ and self.read_errno is not None:
            return OSError(self.read_errno, errno.errorcode[self.read_errno])
        if request.op is Op.READ and self.short_reads:
            return ShortTransferError("read", request.nbytes // 2, request.nbytes, request.offset)
        return None

    def submit_many(self, requests: Sequence[Request]) -> list[Future]:
        futures = []
        for request in requests:
            error = self._failure(request)
            if error is not None:
                self.failed += 1
                future: Future = Future()
                future.set_exception(error)
            elif request.op is Op.WRITE and self.gate is not None:
                future = self._gated.submit(self._gated_write, request)
            else:
                future = self.inner.submit_many([request])[0]
            futures.append(future)
        return futures

    def _gated_write(self, request: Request) -> int:
        self.gate.wait()
        return self.inner.submit_many([request])[0].result()

    def close(self) -> None:
        self.closed = True
        self._gated.shutdown(wait=True)
        self.inner.close()


class FakeDeviceOps(DeviceOps):
    """Asynchronous device ordering on CPU: streams are single-thread executors, events futures.

    ``mark_ready`` returns an event that completes only when ``producer_gate`` is set (when one is
    given), standing for kernels still running on the compute stream. It records what happened
    in ``log`` so tests can check the order.
    """

    def __init__(self, producer_gate: threading.Event | None = None) -> None:
        self.side = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fake-side")
        self.prefetch = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fake-prefetch")
        self.producer_gate = producer_gate
        self.log: list[str] = []
        self.consumed: list[Future] = []
        self._noted = threading.Condition()

    def _note(self, what: str) -> None:
        with self._noted:
            self.log.append(what)
            self._noted.notify_all()

    def wait_for(self, what: str, timeout_s: float) -> bool:
        """Block until ``what`` is in ``log`` or ``timeout_s`` passes; whether it is there."""
        with self._noted:
            return self._noted.wait_for(lambda: what in self.log, timeout=timeout_s)

    def mark_ready(self) -> Future:
        event: Future = Future()
        if self.producer_gate is None:
            event.set_result(None)
        else:
            threading.Thread(target=lambda: (self.producer_gate.wait(), event.set_result(None)), daemon=True).start()
        return event

    def copy_to_host(self, src, dst, after: Future) -> Future:
        def copy():
            after.result()
            dst.copy_(src)
            self._note("d2h")

        return self.side.submit(copy)

    def empty(self, nbytes: int, device) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def copy_to_device(self, src, dst) -> Future:
        def copy():
            dst.copy_(src)
            self._note("h2d")

        return self.prefetch.submit(copy)

    def when_done(self, event: Future, callback) -> None:
        event.add_done_callback(lambda f: callback(f.exception()))

    def consume(self, event: Future, tensor) -> None:
        self.consumed.append(event)
        if event is not None:
            event.result()

    def close(self) -> None:
        self.side.shutdown(wait=True)
        self.prefetch.shutdown(wait=True)


def pinned_steps(make_layer: Callable[[], nn.Module], width: int, directory, plan: tuple[str, ...] | None, *,
                 between: Callable[[nn.Module], None] | None = None) -> tuple[list[torch.Tensor], nn.Sequential]:
    """Two steps of ``nn.Sequential(make_layer(), make_layer())`` on ``(4, width)`` inputs, each inside a bare context
    pinned to ``plan`` (placements per layer; None: without tba), ``between(model)`` run after forward; returns each
    step's loss and gradients, and the model (whose state the caller compares)."""
    torch.manual_seed(0)
    model = nn.Sequential(make_layer(), make_layer())
    result: list[torch.Tensor] = []
    for step in range(2):
        x = torch.randn(4, width, generator=torch.Generator().manual_seed(step))
        with (tba.offload_activations(directory, layers=list(model), policy=tba.Plan(plan, window_bytes=1 << 20))
              if plan else contextlib.nullcontext()):
            loss = model(x).pow(2).mean()
        if between is not None:
            between(model)
        loss.backward()
        result += [loss.detach(), *(p.grad.clone() for p in model.parameters())]
        model.zero_grad()
    return result, model


class RecomputeWherePossible(tba.Policy):
    """Recomputes every layer the profile allows, and keeps what the profile said."""

    def __init__(self) -> None:
        self.recomputable: list[bool] = []

    def plan(self, profile):
        self.recomputable = [layer.recomputable for layer in profile.layers]
        return tba.Plan(tuple("recompute" if r else "offload" for r in self.recomputable), window_bytes=1 << 20)


class SaveSum(torch.autograd.Function):
    """``x`` through, saving ``h`` (any tensor, unrelated to ``x``): ``x``'s gradient is ``h.sum()`` per element, read
    from the saved ``h`` in backward."""

    @staticmethod
    def forward(ctx, x, h):
        ctx.save_for_backward(h)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        (h,) = ctx.saved_tensors
        return grad * h.sum(), None


def train_counting_graphs(model: nn.Module, step_loss: Callable[[nn.Module, int], torch.Tensor],
                          contexts: Callable[[nn.Module], Any], steps: int) -> tuple[list, list, int]:
    """``steps`` SGD steps (lr 0.1) of ``model``, each forward ``step_loss(model, step)`` inside ``contexts(model)``: the
    losses, the final parameters and how many graphs Dynamo compiled (its counters as the caller left them)."""
    from torch._dynamo.utils import counters

    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        with contexts(model):
            loss = step_loss(model, step)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return losses, [p.detach().clone() for p in model.parameters()], counters["stats"]["unique_graphs"]
