"""Run-queue waits of the other compute threads (tba/runtime/_preempted.py)."""

from __future__ import annotations

import hashlib
import os
import threading
import time

import pytest
import torch
from torch import nn

from tba.runtime import _preempted
from tba.runtime._timer import LayerTimer

needs_schedstat = pytest.mark.skipif(not os.path.exists("/proc/self/schedstat") or not hasattr(os, "sched_setaffinity"),
                                     reason="needs Linux schedstats and CPU affinity")


def test_waits_count_only_threads_that_computed_for_a_share_of_the_interval():
    before = {1: (0, 0), 2: (0, 0), 3: (0, 0)}
    after = {1: (500_000_000, 200_000_000),  # computed half of the second: its wait counts
             2: (50_000_000, 300_000_000),  # 5%: an idle thread's wake-ups are not compute waiting
             3: (900_000_000, -1),  # a counter never goes back; clamped
             4: (900_000_000, 400_000_000)}  # started meanwhile: no baseline
    assert _preempted.waited_s(before, after, 1.0) == pytest.approx(0.2)
    assert _preempted.waited_s(None, after, 1.0) is None
    assert _preempted.waited_s(before, None, 1.0) is None


def _spin(cpu: int, ready: threading.Barrier, stop: threading.Event) -> None:
    os.sched_setaffinity(threading.get_native_id(), {cpu})
    data = b"x" * (1 << 20)
    ready.wait()
    while not stop.is_set():
        hashlib.sha256(data).digest()  # releases the GIL: both threads want the one CPU


def _contend(cpu: int) -> tuple[float | None, int, _preempted.Snapshot | None, int]:
    """A worker and a thread named as tba's spin on ``cpu`` for 0.4 s: the run-queue wait counted, the
    worker's and tba's thread ids, and the snapshot after."""
    ready, stop = threading.Barrier(3), threading.Event()
    worker = threading.Thread(target=_spin, args=(cpu, ready, stop), name="worker")
    tba_thread = threading.Thread(target=_spin, args=(cpu, ready, stop), name="tba-io-test")
    worker.start()
    tba_thread.start()
    try:
        ready.wait()
        before, start = _preempted.snapshot(), time.perf_counter()
        time.sleep(0.4)
        after, wall = _preempted.snapshot(), time.perf_counter() - start
    finally:
        stop.set()
        worker.join()
        tba_thread.join()
    return _preempted.waited_s(before, after, wall), worker.native_id, after, tba_thread.native_id


@needs_schedstat
def test_a_compute_thread_sharing_its_cpu_with_tbas_thread_is_seen_waiting_and_tbas_thread_is_not():
    cpu = min(os.sched_getaffinity(0))
    for _ in range(5):  # other processes on that CPU (a loaded machine) can starve the worker below the share
        waited, worker, after, tba_thread = _contend(cpu)
        assert after is not None and threading.get_native_id() not in after  # the caller's clocks are its own
        assert worker in after and tba_thread not in after
        if waited is not None and waited >= 0.1:  # about half of the 0.4 s spent waiting for the other
            break
    else:
        pytest.fail(f"no run-queue wait seen in five tries (last: {waited})")


@needs_schedstat
def test_the_timer_measures_the_waits_over_its_span_on_the_cpu_only():
    layers = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    timer = LayerTimer([layers[0], layers[2]])
    timer.attach()
    layers(torch.randn(4, 8, requires_grad=True)).sum().backward()
    timer.detach()
    assert timer.span_s() is not None
    waited = timer.span_preempted_s()
    assert waited is not None and 0.0 <= waited < 1.0
    gpu_like = LayerTimer([layers[0], layers[2]], synchronize=lambda: None)
    gpu_like.attach()
    layers(torch.randn(4, 8, requires_grad=True)).sum().backward()
    gpu_like.detach()
    assert gpu_like.span_s() is not None and gpu_like.span_preempted_s() is None
