"""The keep_io baseline: another process moves tba's bytes at tba's rate; nothing is left behind."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from tba.bench import io_load
from tba.bench.harness import ModeResult, run_mode
from tba.bench.models import PRESETS
from tba.defaults import MIB


def _children() -> set[int]:
    me = os.getpid()
    found = set()
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == me:
                found.add(int(pid))
    return found


SMALL_FILE = 16 * MIB


def test_the_load_runs_at_its_rate_and_leaves_nothing(tmp_path):
    before = _children()
    with io_load.BackgroundIO(str(tmp_path), 24 * MIB, 12 * MIB, file_bytes=SMALL_FILE) as load:
        assert "24 MiB/s" in repr(load) and _children() - before
        time.sleep(1.0)
    assert not _children() - before
    assert os.listdir(tmp_path) == []  # its file never had a name
    summary = load.summary
    for moved, rate in (("written_bytes", 24 * MIB), ("read_bytes", 12 * MIB)):
        # paced per block: never more than one block ahead of the rate, and not far behind it
        assert 0.5 * rate * summary["seconds"] <= summary[moved] <= rate * summary["seconds"] + io_load.BLOCK_BYTES


def test_the_load_is_even_and_one_rate_may_be_zero(tmp_path):
    read_end, write_end = os.pipe()
    result = {}
    worker = threading.Thread(target=lambda: result.update(
        io_load.serve(str(tmp_path), 16 * MIB, 0, file_bytes=SMALL_FILE, stop_fd=read_end)))
    worker.start()
    time.sleep(1.3)
    os.close(write_end)
    worker.join(30)
    os.close(read_end)
    assert result["read_bytes"] == 0
    assert 0.5 * 16 * MIB * result["seconds"] <= result["written_bytes"] <= 16 * MIB * result["seconds"] + io_load.BLOCK_BYTES


def test_a_load_that_cannot_start_says_why(tmp_path):
    with pytest.raises(RuntimeError, match="did not start"):
        io_load.BackgroundIO("/proc/self", MIB, MIB).__enter__()


def test_a_load_that_falls_short_raises(tmp_path, monkeypatch):
    monkeypatch.setattr(io_load, "SHORTFALL_FRACTION", 100.0)  # no disk can move 100x its rate
    with pytest.raises(RuntimeError, match="could not keep up"):
        with io_load.BackgroundIO(str(tmp_path), 16 * MIB, 0, file_bytes=SMALL_FILE):
            time.sleep(1.0)


def test_the_load_stops_when_its_parent_dies(tmp_path):
    code = ("import sys, time; from tba.bench.io_load import BackgroundIO; "
            f"BackgroundIO({str(tmp_path)!r}, 8 << 20, 8 << 20, file_bytes={SMALL_FILE}).__enter__(); "
            "print('in', flush=True); time.sleep(60)")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout.readline().strip() == "in"
        load_pid = next(int(pid) for pid in os.listdir("/proc") if pid.isdigit() and _parent_of(int(pid)) == parent.pid)
    finally:
        parent.kill()
        parent.wait()
        parent.stdout.close()
    deadline = time.monotonic() + 20
    while os.path.exists(f"/proc/{load_pid}") and _state(load_pid) != "Z" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{load_pid}") or _state(load_pid) == "Z"
    assert os.listdir(tmp_path) == []


def _parent_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except OSError:
        return None


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_negative_rates_are_refused(tmp_path):
    with pytest.raises(ValueError, match="must not be negative"):
        io_load.BackgroundIO(str(tmp_path), -1, 0)


def test_keep_io_trains_as_keep_all_beside_the_load(spill_dir, monkeypatch):
    loads = []
    real_enter = io_load.BackgroundIO.__enter__

    def recording_enter(self):
        loads.append(self)
        self.file_bytes = SMALL_FILE
        return real_enter(self)

    monkeypatch.setattr(io_load.BackgroundIO, "__enter__", recording_enter)
    tiny = PRESETS["tiny"]
    keep = run_mode("keep", tiny, steps=2, warmup=1)
    assert keep.io_rates() is None and keep.written_bytes == []
    keep_io = run_mode("keep_io", tiny, steps=2, warmup=1, directory=spill_dir, io_rates=(16 * MIB, 8 * MIB))
    assert keep_io.losses == keep.losses and keep_io.written_bytes == [] and len(keep_io.step_s) == 2
    assert len(loads) == 1 and loads[0].directory == spill_dir and loads[0].summary["seconds"] > 0
    with pytest.raises(ValueError, match="keep_io needs io_rates"):
        run_mode("keep_io", tiny, steps=1, directory=spill_dir)


def test_the_rates_are_the_median_of_the_steps():
    result = ModeResult("tba", step_s=[1.0, 2.0, 0.5], activation_peak_bytes=[0, 0, 0], losses=[],
                        written_bytes=[100, 400, 100], read_bytes=[10, 20, 30])
    assert result.io_rates() == (200.0, 10.0)  # 100/1, 400/2, 100/0.5 and 10/1, 20/2, 30/0.5


@pytest.mark.parametrize("usage", ["bare", "reusable"])
def test_a_runs_bytes_are_counted_per_step(spill_dir, usage):
    """With no warm-up, the measured steps' bytes add up to the run's (a step may write nothing: a
    write backward no longer needs is never sent)."""
    run = run_mode("tba", PRESETS["tiny"], steps=3, warmup=0, directory=spill_dir, usage=usage, backend="threads")
    assert len(run.written_bytes) == len(run.read_bytes) == 3
    assert sum(run.written_bytes) == run.offload_stats["bytes_written"]
    assert sum(run.read_bytes) == run.offload_stats["bytes_read"]
