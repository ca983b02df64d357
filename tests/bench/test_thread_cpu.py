"""Per-thread CPU readings: a busy named thread is found under its name, a pool's threads add up, and
bench-hooks reports each thread's time per storage."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest

from tba.bench import thread_cpu

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_busy_threads_add_up_under_their_pool_name_and_an_idle_one_costs_nothing():
    release = threading.Event()

    def busy_then_wait():
        _spin(0.05)
        release.wait()

    workers = [threading.Thread(target=busy_then_wait, name=f"probe-busy-{i}") for i in range(2)]
    before = thread_cpu.snapshot()
    for thread in workers:
        thread.start()
    idle = threading.Thread(target=release.wait, name="probe-idle")
    idle.start()
    deadline = time.monotonic() + 10
    spent = {}
    while time.monotonic() < deadline:
        spent = thread_cpu.by_name(before, thread_cpu.snapshot())
        if spent.get("probe-busy", 0) >= 2 * 45_000_000:
            break
        time.sleep(0.01)
    release.set()
    for thread in (*workers, idle):
        thread.join()
    assert spent.get("probe-busy", 0) >= 2 * 45_000_000, spent
    assert not any(name.startswith("probe-busy-") for name in spent)
    assert spent.get("probe-idle", 0) < 20_000_000, spent


def test_a_native_thread_keeps_its_kernel_name_and_an_ended_one_is_still_counted():
    """A thread Python did not start is not reported as 'Dummy' once it ran Python code; a thread that ended
    between two readings shows up as their remainder."""
    import _thread

    before = thread_cpu.snapshot()
    ready, release = threading.Event(), threading.Event()

    def native():
        threading.current_thread()  # makes a threading._DummyThread for this thread
        _spin(0.05)
        ready.set()
        release.wait()

    _thread.start_new_thread(native, ())
    assert ready.wait(10)
    live = thread_cpu.by_name(before, thread_cpu.snapshot())
    release.set()
    assert not any(name.startswith("Dummy") for name in live), live
    ended = threading.Thread(target=_spin, args=(0.05,), name="probe-ended")
    middle = thread_cpu.snapshot()
    ended.start()
    ended.join()
    time.sleep(0.05)  # the kernel reaps the task
    spent = thread_cpu.by_name(middle, thread_cpu.snapshot())
    if thread_cpu.CLOCK == "schedstat":
        assert spent.get(thread_cpu.EXITED, 0) >= 40_000_000, spent


def test_bench_hooks_reports_thread_cpu(tmp_path, capsys):
    import argparse
    import json

    from tba.cli import bench_hooks

    parser = argparse.ArgumentParser()
    bench_hooks.add_arguments(parser)
    out = tmp_path / "h.json"
    disk = tmp_path / "disk"
    disk.mkdir()
    args = parser.parse_args(["--quick", "--no-disk", "--many", "--disk-dir", str(disk), "--ram-dir", str(tmp_path),
                              "--thread-cpu", "--json", str(out)])
    assert bench_hooks.run(args) == 0
    printed = capsys.readouterr().out
    assert "CPU us per storage by thread" in printed
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert [row["path"] for row in rows].count("offload") == 2 and "thread_cpu_us" in report["many"]
    if not os.path.exists("/proc/self/schedstat"):
        return  # clock ticks (10 ms) are too coarse for a quick run's few storages
    assert "MainThread" in printed and report["many"]["thread_cpu_us"].get("MainThread", 0) > 0
    assert all(row["thread_cpu_us"].get("MainThread", 0) > 0 for row in rows)
    assert all(row["base_thread_cpu_us"].get("MainThread", 0) > 0 for row in rows)
    assert all(any(name.startswith("tba-") for name in row["thread_cpu_us"]) for row in rows if row["path"] == "offload")
