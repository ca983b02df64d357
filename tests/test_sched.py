"""TBA_THREAD_POLICY=batch runs tba's threads under SCHED_BATCH (tba/_sched.py, Note [tba's threads do not preempt compute])."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading

import pytest

from tba import _sched

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="no SCHED_BATCH on this platform")

_PROBE = """
import os, threading, torch, tba
x = torch.randn(512, 256, requires_grad=True)
with tba.offload_activations(directory={directory!r}, min_offload_bytes=0, backend="threads"):
    y = (x * 2).sin()
y.sum().backward()
print(",".join(f"{{t.name}}={{os.sched_getscheduler(t.native_id) == os.SCHED_BATCH}}"
               for t in threading.enumerate() if t.name.startswith("tba")))
print("main", os.sched_getscheduler(0) == os.SCHED_BATCH)
"""


def _threads(directory: str, policy: str | None) -> tuple[dict[str, bool], str]:
    env = {k: v for k, v in os.environ.items() if k != _sched.ENV}
    if policy is not None:
        env[_sched.ENV] = policy
    done = subprocess.run([sys.executable, "-c", _PROBE.format(directory=directory)], env=env, capture_output=True,
                          text=True, timeout=120, check=True)
    first, main = done.stdout.strip().splitlines()
    return {pair.split("=")[0]: pair.split("=")[1] == "True" for pair in first.split(",")}, main


def test_tba_threads_start_under_sched_batch_and_the_training_thread_is_left_alone(spill_dir):
    threads, main = _threads(spill_dir, "batch")
    assert "tba-control" in threads and any(name.startswith("tba-io") for name in threads), threads
    assert all(threads.values()), threads
    assert main == "main False"


def test_the_default_and_normal_leave_every_thread_as_it_was(spill_dir):
    for policy in (None, "normal"):
        threads, main = _threads(spill_dir, policy)
        assert threads and not any(threads.values()), (policy, threads)
        assert main == "main False"


def test_an_unknown_policy_warns_once_and_uses_the_default(monkeypatch, caplog):
    monkeypatch.setenv(_sched.ENV, "fifo")
    monkeypatch.setattr(_sched, "_warned", False)
    with caplog.at_level(logging.WARNING, logger="tba"):
        assert _sched.thread_policy() == "normal"
        assert _sched.thread_policy() == "normal"
    assert [r.getMessage() for r in caplog.records].count(
        "tba: TBA_THREAD_POLICY='fifo' is not one of batch, normal; using 'normal'") == 1


def test_background_changes_only_the_calling_thread(monkeypatch):
    monkeypatch.setenv(_sched.ENV, "batch")
    seen = {}

    def run() -> None:
        _sched.background()
        seen["worker"] = _sched.current_policy()

    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    assert seen["worker"] == "batch"
    assert _sched.current_policy() == "normal"


def test_only_an_ordinary_thread_moves_and_user_callbacks_run_ordinary(monkeypatch):
    monkeypatch.setenv(_sched.ENV, "batch")
    seen = {}

    def idle() -> None:
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except OSError:
            seen["idle"] = "skipped"
            return
        _sched.background()
        seen["idle"] = os.sched_getscheduler(0) == os.SCHED_IDLE  # never raised to SCHED_BATCH

    def callback_thread() -> None:
        _sched.background()
        with _sched.ordinary():
            child = threading.Thread(target=lambda: seen.setdefault("child", _sched.current_policy()))
            child.start()
            child.join()
            seen["inside"] = _sched.current_policy()
        seen["after"] = _sched.current_policy()

    for target in (idle, callback_thread):
        thread = threading.Thread(target=target)
        thread.start()
        thread.join()
    assert seen["idle"] in (True, "skipped")
    assert (seen["inside"], seen["child"], seen["after"]) == ("normal", "normal", "batch")
