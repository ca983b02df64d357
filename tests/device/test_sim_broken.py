"""A CUDA context that breaks mid-step, on the simulated device (Note [A broken context] in tba/device/sim/_faults.py).

Nothing queued on the device runs any more and every CUDA call fails. tba cannot save the step;
what it owes is an end: the error reaches the user, nothing hangs waiting for a copy that will
never complete, and close() leaves no spill file, no staging block lent and no thread behind (the
``sim`` fixture checks the threads and that no copy ran after its memory was given back).
"""

from __future__ import annotations

import contextlib
import threading
import types

import pytest
import torch
from model_cases import tiny_gpt
from sim_helpers import CheckedEngine
from utils import run_step, steps_equal

import tba
from tba.device.sim import fake_kvikio
from tba.io import memory_view

SMALL = dict(min_offload_bytes=0, block_size_bytes=8192, staging_bytes=8 * 8192)
BROKEN = "illegal memory access"
ENDS_WITHIN_S = 30.0


def _offloader(route: str, sim, tmp_path) -> tuple[tba.Offloader, CheckedEngine | None]:
    if route == "kvikio":
        return tba.Offloader(tmp_path, backend="kvikio", **SMALL), None
    engine = CheckedEngine(sim)
    return tba.Offloader(tmp_path, backend=engine, **SMALL), engine


def _ends(what, *args) -> None:
    """Run ``what(*args)`` on a thread and fail the test if it has not returned within ENDS_WITHIN_S (a hang)."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            what(*args)
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    thread = threading.Thread(target=run, name="test-broken-close", daemon=True)
    thread.start()
    thread.join(ENDS_WITHIN_S)
    assert not thread.is_alive(), f"{what.__qualname__} still waits {ENDS_WITHIN_S} s after the context broke"
    assert not errors, errors


def _raised_from_broken_context(error: BaseException) -> bool:
    while error is not None:
        if BROKEN in str(error):
            return True
        error = error.__cause__ or error.__context__
    return False


def _closed_clean(offloader: tba.Offloader, engine: CheckedEngine | None, tmp_path) -> None:
    routes = offloader._store.routes
    _ends(offloader.close)
    if engine is not None:
        engine.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "a spill file outlived close()"
    pool = routes.staging_pool
    if pool is not None:
        assert pool.free_blocks == pool.capacity_blocks, "a staging block stayed lent after close()"


@pytest.mark.parametrize("route", ["staged", "kvikio"])
def test_a_context_broken_between_forward_and_backward(sim, tmp_path, route):
    model, forward = tiny_gpt()
    with fake_kvikio(sim, gds=True) if route == "kvikio" else contextlib.nullcontext():
        offloader, engine = _offloader(route, sim, tmp_path)
        with offloader:
            loss = forward(model)
        offloader.flush()
        sim.break_context()
        with pytest.raises(Exception) as raised:
            loss.backward()
        assert _raised_from_broken_context(raised.value), raised.value
        del loss, raised
        _closed_clean(offloader, engine, tmp_path)


@pytest.mark.parametrize("route, kind, after", [("staged", "copy", 3), ("staged", "record", 5), ("staged", "synchronize", 0),
                                               ("kvikio", "record", 5), ("kvikio", "synchronize", 0)])
def test_a_context_that_breaks_in_the_middle_of_forward(sim, tmp_path, route, kind, after, caplog):
    """The fault breaks the context while forward's copies are under way (kvikio's route makes no device copy):
    forward (or the backward after it) raises the CUDA error, and the offloader still ends."""
    model, forward = tiny_gpt()
    with fake_kvikio(sim, gds=True) if route == "kvikio" else contextlib.nullcontext():
        offloader, engine = _offloader(route, sim, tmp_path)
        sim.inject_fault(kind, after=after, breaks_context=True)
        with pytest.raises(Exception) as raised:
            with offloader:
                loss = forward(model)
            offloader.flush()
            loss.backward()
        assert _raised_from_broken_context(raised.value), raised.value
        assert sim.broken is not None
        assert "Free space" not in caplog.text, "a failed device copy was blamed on the disk"
        loss = raised = None
        _closed_clean(offloader, engine, tmp_path)


def test_the_simulator_runs_nothing_queued_after_the_context_broke(sim):
    """The seam itself: a copy queued on a stalled stream never runs once the context broke, every call raises
    the error, and a host thread already waiting for an event raises it instead of waiting for ever."""
    src = sim.empty(4096)
    src.fill_(7)
    dst = sim.empty(4096)
    dst.zero_()
    side = sim.Stream()
    sim.synchronize()
    sim.stall()
    with sim.stream(side):
        sim.copy_(dst, src)
        event = sim.Event()
        event.record(side)
    waited: list[BaseException] = []

    def wait() -> None:
        try:
            event.synchronize()
        except RuntimeError as error:
            waited.append(error)

    waiter = threading.Thread(target=wait, name="test-waiter")
    waiter.start()
    sim.break_context()
    sim.stall(False)
    waiter.join(ENDS_WITHIN_S)
    assert not waiter.is_alive() and len(waited) == 1 and BROKEN in str(waited[0])
    for call in (sim.Event, sim.Stream, sim.synchronize, lambda: sim.empty(4096), lambda: sim.host_empty(4096),
                 event.query, lambda: sim.copy_(dst, src)):
        with pytest.raises(RuntimeError, match=BROKEN):
            call()
    sim.clear_faults()
    with pytest.raises(RuntimeError, match=BROKEN):
        sim.Event()
    with pytest.raises(RuntimeError, match=BROKEN):
        torch.add(dst, 1)  # a kernel launched in a broken context
    assert bytes(memory_view(dst.data_ptr(), 4096)) == bytes(4096), "a copy queued before the context broke still ran"


def test_the_bare_context_ends_after_the_context_broke(sim, tmp_path):
    """The one-shot contexts share a runtime: after a broken context, the next step's error is the CUDA error
    (not a hang in tba), and tba.shutdown() closes the shared runtime and its spill file."""
    model, forward = tiny_gpt()
    with tba.offload_activations(tmp_path, **SMALL):
        loss = forward(model)
    loss.backward()
    with tba.offload_activations(tmp_path, **SMALL):
        loss = forward(model)
    sim.break_context()
    with pytest.raises(Exception) as raised:
        loss.backward()
    assert _raised_from_broken_context(raised.value), raised.value
    with pytest.raises(Exception) as raised:
        with tba.offload_activations(tmp_path, **SMALL):
            forward(model)
    assert _raised_from_broken_context(raised.value), raised.value
    loss = raised = None
    _ends(tba.shutdown)
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "a spill file outlived tba.shutdown()"


@pytest.mark.parametrize("seed", range(int(__import__("os").environ.get("BRK_SEEDS", "6"))))
def test_a_context_broken_at_a_random_point_of_a_step(tmp_path, seed):
    """Randomised: a fault of a random kind breaks the context after a random number of such calls, in forward,
    in backward or never. The step is then exact (the fault never came) or raises the CUDA error; either way
    close() ends, the spill file goes, no staging block stays lent, no thread is left and the device saw
    no race."""
    import random

    from tba.device.sim import simulate

    draw = random.Random(seed)
    kind = draw.choice(["copy", "record", "synchronize"])
    after = draw.randrange(0, 80)
    before = set(threading.enumerate())
    with simulate(seed=seed) as sim:
        model, forward = tiny_gpt()
        reference = run_step(model, forward)
        engine = CheckedEngine(sim)
        offloader = tba.Offloader(tmp_path, backend=engine, **SMALL)
        sim.inject_fault(kind, after=after, breaks_context=True)
        try:
            result = run_step(model, forward, offloader, flush=draw.random() < 0.5)
        except Exception as error:  # noqa: BLE001 - checked below
            assert sim.broken is not None and _raised_from_broken_context(error), (kind, after, error)
            result = error = None
        else:
            assert sim.faults_raised == 0, f"a {kind} fault was raised and the step still went on"
            assert steps_equal(reference, result), f"not exact, {kind} fault after {after} calls never came"
        _closed_clean(offloader, engine, tmp_path)
        _ends(tba.shutdown)
    assert sim.problems() == [], "\n".join(sim.problems())
    left = [t.name for t in set(threading.enumerate()) - before if t.is_alive() and t.name.startswith(("tba", "fake"))]
    assert not left, f"threads left: {left}"


@pytest.mark.parametrize("gds", [True, False], ids=["gds", "compat"])
def test_kvikio_writes_under_way_when_the_context_breaks_fail_as_the_gpus(sim, tmp_path, caplog, gds):
    """kvikio transfers already handed over when the context broke ran on as if nothing happened: the fake moved their
    bytes, where kvikio's compatibility mode copies through the device (a CUDA call, which fails) and cuFile's DMA of a
    broken context fails too. They fail with the context's error now, and the writes' warning names the GPU, not the
    disk (Note [A broken context] in tba/device/sim/_faults.py)."""
    with fake_kvikio(sim, gds=gds) as kvikio:
        offloader = tba.Offloader(tmp_path, backend="kvikio", **SMALL)
        kvikio.write_gate = types.SimpleNamespace(wait=sim.break_context)  # breaks it under the write's task
        with offloader:
            saved = offloader.pack(torch.randn(4096) * 2)
            offloader.flush()
        assert offloader.stats.bytes_kept_on_error > 0, "a write handed over before the context broke moved its bytes"
        assert "The GPU failed, not the disk" in caplog.text and "Check the disk" not in caplog.text, caplog.text
        del saved
        _closed_clean(offloader, None, tmp_path)
