"""The Python work counter (tba/bench/python_work.py), and tba's per-storage Python, flat in the storages of a step."""

from __future__ import annotations

import sys
import threading

import torch

import tba
from tba import _control
from tba.bench.python_work import PythonWork, count_step
from tba.runtime import _entry, _writes


def _digits(n: int) -> int:
    total = 0
    for i in range(n):
        total += len(str(i))
    return total


def test_counts_by_phase_and_thread_and_unhooks_everything():
    work = PythonWork()
    with work:
        work.phase = "a"
        _digits(10)
        worker = threading.Thread(target=_digits, args=(5,), name="pool-3")
        worker.start()
        worker.join()
        work.phase = None
        _digits(1000)
        work.phase = "b"
        _control.call(_digits, 7)
        work.phase = None
    here = "test_python_work.py:_digits"
    assert work.functions["a", "MainThread", here] == 1
    assert work.functions["a", "pool", here] == 1, work.functions  # a pool's thread, its number dropped
    assert work.functions["b", "tba-control", here] == 1, work.functions
    assert 2 * 10 <= work.counts["lines"]["a", "MainThread"] < 1000  # the loop's lines, not the 1000 turns uncounted
    assert work.counts["c_calls"]["a", "MainThread"] >= 2 * 10  # len and str per turn
    assert work.counts["lines"]["b", "tba-control"] >= 2 * 7
    assert sys.gettrace() is None and sys.getprofile() is None
    assert threading.gettrace() is None and threading.getprofile() is None
    assert _control.call(sys.gettrace) is None and _control.call(sys.getprofile) is None


def _step(leaves: list[torch.Tensor], directory: str, mark) -> None:
    # A window of 1 MiB: every storage is written and read back at both counts, where a self-sized window held
    # every storage of the 100-storage step in memory (no read, no read completion) and read most of the 800.
    mark("forward")
    with tba.offload_activations(directory, prefetch_budget_bytes=1 << 20):
        sums = [torch.tanh(leaf).sum() for leaf in leaves]
    mark("backward")
    torch.autograd.backward(sums)


def test_the_hooks_it_replaced_are_put_back():
    def tracer(frame, event, arg):
        return None

    def profiler(frame, event, arg):
        return None

    sys.settrace(tracer)
    sys.setprofile(profiler)
    try:
        with PythonWork() as work:
            work.phase = "a"
            _digits(3)
        assert work.counts["lines"]["a", "MainThread"] > 0
        assert sys.gettrace() is tracer and sys.getprofile() is profiler
    finally:
        sys.settrace(None)
        sys.setprofile(None)


def _lines_per_storage(directory: str, count: int) -> dict[str, float]:
    """Lines per storage of each thread over forward and backward: a completion lands in either phase, as it comes."""
    leaves = [torch.randn(16384, requires_grad=True) for _ in range(count)]
    before = {thread.ident for thread in threading.enumerate()}
    work = count_step(lambda mark: _step(leaves, directory, mark))
    for thread in threading.enumerate():
        if thread.ident not in before:
            thread.join(timeout=10)  # a cancelled timer (the shared runtimes' reaper) ends on its own, soon
            assert not thread.is_alive(), f"{thread.name}, hooked by the count, outlived it"
    assert work.per_storage("forward", count).get("tba-control", 0) > 20, "tba's control thread ran no Python in forward"
    assert work.per_storage("backward", count).get("tba-control", 0) > 20, "nor in backward"
    lines: dict[str, float] = {}
    for phase in ("forward", "backward"):
        for thread, n in work.per_storage(phase, count).items():
            lines[thread] = lines.get(thread, 0.0) + n
    return lines


def test_python_per_storage_does_not_grow_with_the_storages_of_a_step(spill_dir):
    """What tba's threads run per saved storage is O(1) in the storages of the step (issue 25): a scan of every live
    entry per save or unpack would make the 800-storage step run several times the lines per storage of the 100."""
    small = _lines_per_storage(spill_dir, 100)
    large = _lines_per_storage(spill_dir, 800)
    for thread, lines in large.items():
        bound = 1.5 * small.get(thread, 0.0) + 20
        assert lines <= bound, (f"{thread} ran {lines:.1f} lines per storage at 800 storages, {small.get(thread, 0.0):.1f} "
                                f"at 100: {small} / {large}")


SAVES_COUNTED = 200
"""Storages of 64 KiB in the step whose forward the call-count tests count."""


def _counted_forward_without_nvtx(spill_dir: str, why: str):
    """The Python work of a step of ``SAVES_COUNTED`` storages; the test skips where nvtx is installed (``why``)."""
    from tba._trace import nvtx_enabled

    if nvtx_enabled():
        import pytest

        pytest.skip(f"nvtx is installed: {why}")
    leaves = [torch.randn(16384, requires_grad=True) for _ in range(SAVES_COUNTED)]
    return count_step(lambda mark: _step(leaves, spill_dir, mark))


def test_a_save_on_the_control_thread_calls_no_python_for_a_range_a_tuple_or_a_rounding(spill_dir):
    """Without nvtx, a storage's save calls no no-op range (Note [No range without nvtx] in tba/_trace.py),
    no NamedTuple constructor (Note [Per-storage tuples made without their Python __new__] in tba/runtime/_host_io.py)
    and no ``round_up``: three Python calls per storage each, on the thread the forward waits for (docs/host-cost.md)."""
    work = _counted_forward_without_nvtx(spill_dir, "the write range is real")
    calls = dict(work.top_functions("forward", "tba-control", SAVES_COUNTED, top=1000))
    assert calls.get("tba/runtime/_writes.py:_start_write", 0) >= 0.9, calls  # the count sees the saves
    for where in ("contextlib.py:__enter__", "contextlib.py:__exit__", "<string>:<lambda>", "tba/_trace.py:nvtx_range"):
        assert calls.get(where, 0) < 0.5, f"{where}: {calls.get(where)} calls per storage saved"
    # The Python record (tba._record not built) rounds its extent_bytes through round_up: one call per storage.
    rounding = calls.get("tba/io/_memory.py:round_up", 0)
    assert rounding < (0.5 if _entry.NATIVE else 1.5), f"round_up: {rounding} calls per storage saved"


def test_a_host_save_calls_no_python_for_its_route_its_queueing_its_range_or_its_watch(spill_dir):
    """Without nvtx, a host storage's save goes from the store to the host batch with no Python call for the route,
    the queueing or the range (with tba._save, none for its bytes either: Note [A host save in C] in
    tba/runtime/_writes.py), its view's finalizer asks no Python whether the control thread runs, and the pack hook
    makes its version watch and skips the range inline (Note [The common save inline] in tba/runtime/_writes.py):
    one Python call per storage each, on the threads the forward waits for (docs/host-cost.md, thirty-second pass)."""
    work = _counted_forward_without_nvtx(spill_dir, "the pack and write ranges are real")
    control = dict(work.top_functions("forward", "tba-control", SAVES_COUNTED, top=1000))
    training = dict(work.top_functions("forward", "MainThread", SAVES_COUNTED, top=1000))
    assert control.get("tba/runtime/_writes.py:_start_write", 0) >= 0.9, control  # the count sees the saves
    assert training.get("tba/runtime/_hooks.py:_pack", 0) >= 0.9, training  # and the packs
    for where in ("tba/_trace.py:traced", "tba/runtime/_writes.py:_queue_write", "tba/device/_router.py:for_device",
                  "tba/_control_loop.py:ensure_started"):
        assert control.get(where, 0) < 0.5, f"{where}: {control.get(where)} calls per storage saved"
    if _writes.NATIVE:  # Note [A host save in C] in tba/runtime/_writes.py: the fresh save's Python is one C call
        where = "tba/runtime/_entry.py:storage_bytes"
        assert control.get(where, 0) < 0.5, f"{where}: {control.get(where)} calls per storage saved"
    for where in ("tba/_trace.py:traced", "tba/runtime/_views.py:version_watch"):
        assert training.get(where, 0) < 0.5, f"{where}: {training.get(where)} calls per storage packed"
