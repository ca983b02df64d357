"""The fork server: its children run the isolated worker as a fresh process would; failures come back."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from tba.bench._forkserver import ForkServerError
from tba.bench.isolated import IsolatedRunError, fork_server, run_isolated

PROBE = os.path.join(os.path.dirname(__file__), "forkserver_probe.py")


@pytest.mark.slow
def test_children_measure_what_fresh_processes_measure(spill_dir):
    options = dict(steps=1, warmup=0, directory=spill_dir, backend="threads", prime=True)
    fresh = run_isolated("tba", "tiny", **options)
    with fork_server() as server:
        forked = [run_isolated("tba", "tiny", server=server, **options) for _ in range(2)]
        with pytest.raises(IsolatedRunError) as failed:
            run_isolated("no-such-mode", "tiny", server=server, **options)
        after = run_isolated("keep", "tiny", server=server, **options)
    assert [r.losses for r in forked] == [fresh.losses] * 2 and forked[0].allocator == fresh.allocator
    assert all(r.offload_stats["tensors_offloaded"] == fresh.offload_stats["tensors_offloaded"] > 0 for r in forked)
    assert "no-such-mode" in failed.value.stderr  # the failure ended only that child
    assert after.losses == fresh.losses
    assert os.listdir(spill_dir) == []


@pytest.mark.slow
def test_a_child_is_a_new_process_with_a_fresh_process_threads():
    fresh = json.loads(subprocess.run([sys.executable, PROBE, "x"], capture_output=True, text=True,
                                      check=True).stdout)
    torch_only = subprocess.run([sys.executable, "-c", "import os, torch; print(len(os.listdir('/proc/self/task')))"],
                                capture_output=True, text=True, check=True).stdout
    with fork_server() as server:
        server_threads = len(os.listdir(f"/proc/{server.pid}/task"))  # ready: torch imported, nothing forked yet
        answers = [server.run(f"request {i}", target=f"{PROBE}:facts") for i in range(2)]
    children = [json.loads(stdout) for status, stdout, _ in answers if status == 0]
    assert len(children) == 2, answers
    assert children[0]["pid"] != children[1]["pid"] and children[1]["request"] == "request 1"
    assert [c["threads"] for c in children] == [fresh["threads"]] * 2
    assert server_threads == int(torch_only)  # no tba thread in the server: they start in each child


@pytest.mark.slow
def test_a_failing_child_reports_its_status_and_a_dead_server_fails_one_run_then_restarts(spill_dir):
    options = dict(steps=1, warmup=0, directory=spill_dir, backend="threads", prime=True)
    with fork_server() as server:
        status, stdout, stderr = server.run("not json")
        assert status == 1 and "JSONDecodeError" in stderr and stdout == ""
        first = server.pid
        os.kill(first, signal.SIGKILL)
        with pytest.raises(ForkServerError, match="fork server .* stopped"):
            server.run("{}")
        assert run_isolated("keep", "tiny", server=server, **options).losses  # a new server
        second = server.pid
        os.kill(second, signal.SIGKILL)  # run_isolated tries once more on a new server: no failed point
        assert run_isolated("keep", "tiny", server=server, **options).losses
        assert len({first, second, server.pid}) == 3
        named = [os.readlink(f"/proc/{server.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{server.pid}/fd")]
        # what a killed run could leave behind: only pipes, devices and unlinked files are open
        assert all(not os.path.isfile(target) or target.endswith("(deleted)")
                   or target.startswith(sys.prefix) or target.startswith(sys.base_prefix) for target in named), named
    with pytest.raises(OSError):
        os.kill(first, 0)  # reaped, not a zombie of this process


def test_a_child_dies_with_its_server(tmp_path):
    with fork_server() as server:
        pid_file = tmp_path / "child"
        answers = []

        def measure():
            try:
                server.run(str(pid_file), f"{PROBE}:sleep_forever")
            except ForkServerError as err:
                answers.append(err)

        runner = threading.Thread(target=measure)
        runner.start()
        deadline = time.monotonic() + 30
        while not pid_file.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        child = int(pid_file.read_text())
        os.kill(server.pid, signal.SIGKILL)
        runner.join(30)
        deadline = time.monotonic() + 10
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child), "the measurement went on after its server was killed"
        assert len(answers) == 1  # the caller heard that the server stopped


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
