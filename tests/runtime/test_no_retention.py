"""After a step, tba holds none of its memory: no worker thread keeps the last job it ran.

A worker loop (``item = queue.get(); run(item)``) keeps ``item``, and whatever the job's closure
references, until the next item arrives: between steps, through the optimizer step. On the first
GPU tba ran on (an H100), ``test_no_leak_over_twenty_steps`` saw device memory move by a read-back
buffer from one step to the next: the stager's and the copy waiters' last job held it. Found by
what survives a step, on the CPU and on the simulated device.
"""

from __future__ import annotations

import gc
import threading
import types

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

import tba
from tba import _control, defaults
from tba.device import CudaOps
from tba.device.sim import fake_kvikio


@pytest.fixture(autouse=True)
def _discard_small_storages(monkeypatch):
    """These cases use 64 KiB storages, which tba would not discard (Note [Small storages keep their
    pages] in tba/runtime/_trim.py); the lingering and discard paths under test need them to be."""
    monkeypatch.setattr(defaults, "DISCARD_MIN_BYTES", 0)


class Watched(nn.Module):
    """Linear, ReLU, Linear; remembers weak references to the storages of its activations."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(256, 256), nn.Linear(256, 4)
        self.storages: list[StorageWeakRef] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        r = torch.relu(h)
        self.storages += [StorageWeakRef(h.untyped_storage()), StorageWeakRef(r.untyped_storage())]
        return self.b(r).square().sum()


def _step(model: Watched, offloader: tba.Offloader, flush: bool) -> None:
    x = torch.randn(64, 256)
    with offloader:
        loss = model(x)
        if flush:
            offloader.flush()
    loss.backward()
    del loss
    offloader.flush()  # writes that raced backward are over: their sources are tba's no more
    gc.collect()
    _control.settle()


@pytest.mark.parametrize("backend", ["threads", "auto"])
@pytest.mark.parametrize("flush", [True, False], ids=["written-first", "racing-writes"])
def test_no_activation_outlives_its_step_on_the_cpu(tmp_path, backend, flush):
    model = Watched()
    offloader = tba.Offloader(tmp_path, backend=backend, min_offload_bytes=0)
    for _ in range(2):
        _step(model, offloader, flush)
        # Writes that raced backward and ended after their storage died are not counted as written.
        assert offloader.stats.bytes_written > 0 or (not flush and offloader.stats.write_busy_s > 0)
        alive = [ref for ref in model.storages if not ref.expired()]
        assert not alive, f"{len(alive)} of the step's activations are still alive after it"
        model.storages.clear()
    offloader.close()


@pytest.mark.parametrize("route", ["staged", "kvikio"])
@pytest.mark.parametrize("flush", [True, False], ids=["written-first", "racing-writes"])
def test_no_device_memory_outlives_its_step_on_the_simulated_device(sim, tmp_path, route, flush):
    import contextlib

    context = fake_kvikio(sim, gds=True) if route == "kvikio" else contextlib.nullcontext()
    with context:
        model = Watched()
        offloader = tba.Offloader(tmp_path, backend="kvikio" if route == "kvikio" else "threads",
                                  min_offload_bytes=0, block_size_bytes=8192, staging_bytes=4 * 8192)
        for _ in range(2):
            _step(model, offloader, flush)
            assert offloader.stats.bytes_read > 0 or not flush
            assert sim.memory_stats()["allocated_bytes"] == 0, "a read-back buffer outlived its step"
            alive = [ref for ref in model.storages if not ref.expired()]
            assert not alive, f"{len(alive)} of the step's activations are still alive after it"
            model.storages.clear()
        offloader.close()


def test_a_storage_the_program_held_when_its_write_ended_does_not_outlive_the_step(tmp_path):
    """Note [Nothing lingers past the step]: such a storage lingered in tba until the next step's first save."""
    from tba.runtime._trim import hands_back_pages

    if not hands_back_pages():
        pytest.skip("only glibc's malloc needs pages handed back, and only then does a storage linger")
    offloader = tba.Offloader(tmp_path, backend="threads", min_offload_bytes=0)
    x = torch.randn(64, 256, requires_grad=True)
    with offloader:
        h = torch.tanh(x)
        offloader.flush()  # written while the program still holds h
    h.pow(2).sum().backward()
    _control.settle()
    watched = StorageWeakRef(h.untyped_storage())
    del h
    gc.collect()
    _control.settle()
    assert watched.expired(), "tba still holds the storage after the program dropped it and backward ended"
    offloader.close()


class _Gated:
    """A kvikio future that finishes once ``gate`` is set and holds nothing."""

    def __init__(self, gate: threading.Event) -> None:
        self.gate = gate

    def get(self) -> int:
        assert self.gate.wait(10)
        return 0


class _NoWait:
    def synchronize(self) -> None:
        pass


def test_a_kvikio_write_holds_its_source_no_longer_than_its_completion(sim):
    """Found on an H200 (``test_no_leak_over_twenty_steps[kvikio]`` under the CUDA sanitizer): the
    waiter pool's work item held the source of a finished write until after its completion had
    been reported, so ``flush()`` could return while tba still held a written activation."""
    from tba.device._kvikio import KvikioRoute

    with fake_kvikio(sim, gds=True):
        route = KvikioRoute(CudaOps(torch.device("cpu")))
        gate = threading.Event()
        route._file = lambda fd: types.SimpleNamespace(pwrite=lambda buf, size, offset, task_size: _Gated(gate))
        try:
            for _ in range(20):  # the write thread may still be inside its job when a completion is reported
                gate.clear()
                src = torch.randn(1024)
                watched, seen, done = StorageWeakRef(src.untyped_storage()), [], threading.Event()

                def on_done(error, watched=watched, seen=seen, done=done):
                    seen.append((error, watched.expired()))
                    done.set()

                route.write(src, 0, -1, 0, on_done, _NoWait())
                del src
                gate.set()  # only now: the test's own reference is gone
                assert done.wait(10)
                assert seen == [(None, True)], "the route still held the written source when it reported the write"
        finally:
            route.stop()
            route.close()


@pytest.mark.parametrize("with_layers", [False, True], ids=["bare", "layers"])
def test_a_model_trained_under_one_shot_contexts_is_freed_after_its_last_step(tmp_path, with_layers):
    # Note [A profiled step holds the store, not the offloader] in tba/runtime/_store_owner.py: a bare
    # context's runner stays registered for its directory, and its last profiled step held the offloader,
    # which holds the model's layers; every model trained on a fresh directory (a sweep) stayed alive.
    import weakref

    from tba.bench.models import PRESETS, make_batch, make_gpt

    config = PRESETS["tiny"]
    refs = []
    for trial in range(2):
        model, batch = make_gpt(config, seed=trial), make_batch(config)
        refs += [weakref.ref(model), weakref.ref(model.blocks[0])]  # the blocks are what the offloader held
        directory = tmp_path / f"trial{trial}"
        for _ in range(2):  # the second step is profiled: its counters wait for a next entry that never comes
            with tba.offload_activations(directory, layers=model if with_layers else None):
                loss = model(*batch)
            loss.backward()
        del model, loss
    _control.settle()
    gc.collect()
    assert [ref() for ref in refs] == [None] * 4, "tba kept a model's blocks alive after its last step"


@pytest.mark.parametrize("how", ["closed", "dropped", "one-shot"])
def test_an_offloader_nobody_references_is_freed_without_the_garbage_collector(tmp_path, how):
    # Note [Dropping an offloader frees it]: a saved_tensors_hooks object held by the offloader, holding
    # its bound pack and unpack, made a cycle; the offloader and the layers it was given (their parameters
    # and gradients) stayed until a collection. On an H200 the next test's device memory fell by a
    # previous offloader's 790 KiB when one ran mid-test.
    import weakref

    import torch._dynamo  # noqa: F401 - its first import leaves frames in a cycle (torch's, the next test covers it)

    from tba.bench.models import PRESETS, make_batch, make_gpt

    config = PRESETS["tiny"]
    model, batch = make_gpt(config), make_batch(config)
    block = weakref.ref(model.blocks[0])
    enabled = gc.isenabled()
    gc.disable()
    try:
        offloader = (tba.Offloader(tmp_path, layers=model, min_offload_bytes=0) if how != "one-shot" else None)
        for _ in range(3):
            context = offloader or tba.offload_activations(tmp_path, layers=model, min_offload_bytes=0)
            with context:
                loss = model(*batch)
            loss.backward()
            del loss, context
        if how == "closed":
            offloader.close()
        dropped = weakref.ref(offloader) if offloader is not None else None
        del offloader, model
        _control.settle()
        assert dropped is None or dropped() is None, "the offloader outlived its last reference"
        assert block() is None, "a block of the model outlived its last reference"
    finally:
        if enabled:
            gc.enable()


_FIRST_OFFLOADER = """
import gc, sys, weakref
import torch
from torch import nn
import tba
from tba import _control

assert "torch._dynamo" not in sys.modules, "importing tba imported torch._dynamo"
directory, how = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
model = nn.Sequential(*(nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(3)), nn.Linear(64, 1))
x = torch.randn(8, 64)
block = weakref.ref(model[0])
gc.disable()
options = {"policy": tba.Plan(("keep", "offload", "offload"), window_bytes=0)} if how == "plan" else {}
offloader = tba.Offloader(directory, layers=list(model)[:3], min_offload_bytes=0, **options)
with offloader:
    loss = model(x).sum()
loss.backward()
offloader.close()
dropped = weakref.ref(offloader)
del offloader, model, loss
_control.settle()
print("offloader", dropped() is not None, "block", block() is not None, "dynamo", "torch._dynamo" in sys.modules)
sys.exit(1 if dropped() is not None or block() is not None else 0)
"""


@pytest.mark.parametrize("how", ["layers", "plan"])  # a plan without recompute: torch's checkpoint imports it too
def test_the_first_offloader_of_a_process_is_freed_without_the_garbage_collector(tmp_path, how):
    # Note [Asking about compiled modules imports nothing] in tba/runtime/_compile.py: the entry's check for
    # compiled layers imported torch._dynamo, whose first import leaves its caller's frames in a cycle; the
    # first offloader of a process (with the layers it was given) stayed until a collection.
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _FIRST_OFFLOADER, str(tmp_path), how], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_an_offloader_its_entering_thread_holds_is_freed_without_the_garbage_collector(tmp_path):
    """A thread object that holds the offloader it enters (``self.offloader`` of a ``threading.Thread`` subclass): the
    offloader held the last thread that entered it, a cycle, and both outlived their last reference until a collection
    (Note [Dropping an offloader frees it] in tba/runtime/_step_cycle.py)."""
    import weakref

    class Worker(threading.Thread):
        def __init__(self) -> None:
            super().__init__()
            self.offloader = tba.Offloader(tmp_path, layers=[], min_offload_bytes=0)

        def run(self) -> None:
            x = torch.randn(8, 8, requires_grad=True)
            with self.offloader:
                loss = torch.tanh(x).sum()
            loss.backward()

    enabled = gc.isenabled()
    gc.disable()
    try:
        worker = Worker()
        worker.start()
        worker.join()
        dropped = weakref.ref(worker.offloader)
        del worker
        _control.settle()
        assert dropped() is None, "the offloader outlived its last reference"
    finally:
        if enabled:
            gc.enable()
