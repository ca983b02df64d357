"""A lazy checkpoint started just before exit is published (issue 21, item 6), and a forked child can
take its own lazy checkpoints while the parent's is in flight (item 7)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap

import pytest

LAST_ACT = textwrap.dedent("""
    import sys, torch
    from torch import nn
    import tba.checkpoint as ck
    model = nn.Linear(1024, 1024)
    ck.save_lazy(ck.state_dict(model), sys.argv[1])
""")

FORK = textwrap.dedent("""
    import os, sys, torch
    from torch import nn
    import tba.checkpoint as ck
    model = nn.Linear(2048, 2048)
    ck.save_lazy(ck.state_dict(model), sys.argv[1] + "/parent")
    pid = os.fork()
    if pid == 0:
        ck.save_lazy(ck.state_dict(model), sys.argv[1] + "/child").wait()
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    ck.save_lazy(ck.state_dict(model), sys.argv[1] + "/parent2").wait()
    sys.exit(os.waitstatus_to_exitcode(status))
""")

FORK_LOAD = textwrap.dedent("""
    import os, signal, sys, time, torch
    from torch import nn
    import tba.checkpoint as ck
    from tba.checkpoint import _layout
    path, model = sys.argv[1] + "/c", nn.Linear(256, 256)
    ck.save_lazy(ck.state_dict(model), path).wait()
    write_image = _layout.write_image
    _layout.write_image = lambda *a, **k: (time.sleep(3), write_image(*a, **k))[1]
    handle = ck.save_lazy(ck.state_dict(model), path)
    pid = os.fork()
    if pid == 0:
        signal.alarm(20)
        torch.set_num_threads(1)  # GNU OpenMP hangs a child's first parallel region after the parent's, tba or not
        ck.load(path, nn.Linear(256, 256))
        os._exit(0 if not handle.done() else 3)
    _, status = os.waitpid(pid, 0)
    handle.wait()
    sys.exit(os.waitstatus_to_exitcode(status))
""")

FORK_WAIT = textwrap.dedent("""
    import os, signal, sys, time, torch
    import tba.checkpoint as ck
    from tba.checkpoint import _layout
    path = sys.argv[1] + "/c"
    ck.save_lazy({"w": torch.ones(3)}, path).wait()
    write_image = _layout.write_image
    _layout.write_image = lambda *a, **k: (time.sleep(1.5), write_image(*a, **k))[1]
    handle = ck.save_lazy({"w": torch.ones(3)}, path)
    pid = os.fork()
    if pid == 0:
        signal.alarm(20)
        handle.wait_snapshot()
        try:
            handle.wait()
        except ck.TbaCheckpointError as err:
            os._exit(0 if "forked" in str(err) else 4)
        os._exit(3)
    _, status = os.waitpid(pid, 0)
    handle.wait()
    sys.exit(os.waitstatus_to_exitcode(status))
""")


def _run(script: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.slow
def test_save_lazy_as_the_last_act_publishes_and_exits_cleanly(tmp_path):
    for run in range(3):
        target = tmp_path / f"c{run}"
        result = _run(LAST_ACT, str(target))
        assert result.returncode == 0, result.stderr[-2000:]
        assert "terminate called" not in result.stderr
        assert (target / ".metadata").exists(), f"run {run} published nothing"
    assert not [p for p in os.listdir(tmp_path) if "tba-partial" in p]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_save_lazy_in_a_forked_child_does_not_wait_for_the_parent(tmp_path):
    result = _run(FORK, str(tmp_path), timeout=90)
    assert result.returncode == 0, result.stderr[-2000:]
    for name in ("parent", "child", "parent2"):
        assert (tmp_path / name / ".metadata").exists(), name


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_loads_a_path_the_parent_is_saving_to_without_waiting(tmp_path):
    """The child inherited the parent's registry of lazy saves (Note [A load waits for the saves to its path]) and
    its load waited for ever for a save thread it does not have (helper-41)."""
    result = _run(FORK_LOAD, str(tmp_path), timeout=90)
    assert result.returncode == 0, f"child status {result.returncode} (-14: hung until SIGALRM)\n{result.stderr[-2000:]}"


FORK_THEN_KILLED = textwrap.dedent("""
    import os, sys, threading, time, torch
    import tba.checkpoint as ck
    from tba.checkpoint import _layout
    ck.save_lazy({"w": torch.ones(100)}, sys.argv[1] + "/step0").wait()
    writing = threading.Event()
    _layout.write_image = lambda *a, **k: (print("writing", flush=True), writing.set(), time.sleep(600))
    ck.save_lazy({"w": torch.ones(100)}, sys.argv[1] + "/step1")
    writing.wait()  # the staging directory is locked: its descriptor is one the child must close
    if os.fork() == 0:
        print(os.getpid(), flush=True)  # after the fork handlers: the inherited lock is closed by now
        time.sleep(600)
        os._exit(0)
    time.sleep(600)
""")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_partial_of_a_killed_parent_is_removed_while_its_forked_child_lives(tmp_path):
    """The child inherited the staging directory's flock, so a killed parent's partial counted as live as long as
    the child lived (helper-41). The child says its pid only once its fork handlers have run: the parent saying it
    raced them, and under load the save below found the lock still held (a fresh-clone CI run)."""
    import signal

    import torch
    import torch.distributed.checkpoint as dcp

    from tba.checkpoint import TbaStorageWriter

    parent = subprocess.Popen([sys.executable, "-c", FORK_THEN_KILLED, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONWARNINGS": "ignore"})
    try:
        assert parent.stdout.readline().strip() == "writing"
        child = int(parent.stdout.readline())
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        dcp.save({"w": torch.ones(8)}, storage_writer=TbaStorageWriter(str(tmp_path / "step2")), no_dist=True)
        assert sorted(os.listdir(tmp_path)) == ["step0", "step2"]
    finally:
        parent.kill()
        parent.wait()
        parent.stdout.close()
        with contextlib.suppress(ProcessLookupError, UnboundLocalError):
            os.kill(child, signal.SIGKILL)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_waiting_on_the_parents_handle_is_told_it_cannot(tmp_path):
    """Note [A forked child cannot wait for its parent's save] in tba/checkpoint/_handle.py: it waited for ever."""
    result = _run(FORK_WAIT, str(tmp_path), timeout=90)
    assert result.returncode == 0, f"child status {result.returncode} (-14: hung until SIGALRM)\n{result.stderr[-2000:]}"


AT_EXIT = textwrap.dedent("""
    import atexit, sys, torch
    from torch import nn
    import tba.checkpoint as ck
    model = nn.Linear(1024, 1024)
    atexit.register(lambda: ck.save_lazy(ck.state_dict(model), sys.argv[1]))
""")


def test_save_lazy_in_an_atexit_handler_publishes_and_exits_cleanly(tmp_path):
    """Note [A save started at exit is waited for]: the interpreter had joined its threads already, so it
    finalized under the save thread ("terminate called without an active exception"), and nothing was published
    (helper-153)."""
    target = tmp_path / "final"
    result = _run(AT_EXIT, str(target))
    assert "terminate called" not in result.stderr, result.stderr[-2000:]
    assert result.returncode == 0, result.stderr[-2000:]
    assert (target / ".metadata").exists(), "published nothing"
    assert not [p for p in os.listdir(tmp_path) if "tba-partial" in p]
