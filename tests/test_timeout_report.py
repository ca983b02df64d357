"""tests/timeout_report.py: a test past its timeout in a pytest-xdist worker prints where every thread was
(Note [A test past its timeout in a worker says so])."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import tomllib
from python_runs import LONG_RUN_TIMEOUT_S

TESTS = pathlib.Path(__file__).resolve().parent

HANGS = """
import time


def test_hangs_here():
    time.sleep(60)
"""


def test_a_test_past_its_timeout_in_a_worker_prints_every_threads_stack(tmp_path):
    # CI printed only "[gw1] node down: Not properly terminated": pytest-timeout's report went to the worker's
    # stdout, /dev/null.
    (tmp_path / "test_hang.py").write_text(HANGS)
    (tmp_path / "pytest.ini").write_text("[pytest]\ntimeout = 1\ntimeout_method = thread\n")
    (tmp_path / "conftest.py").write_text(f"import sys\nsys.path.insert(0, {str(TESTS)!r})\n"
                                          "pytest_plugins = ('timeout_report',)\n")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "1", "-p", "no:cacheprovider", "test_hang.py"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTEST_ADDOPTS": ""})
    assert "crashed while running 'test_hang.py::test_hangs_here'" in done.stdout, done.stdout + done.stderr
    assert "Timeout (0:00:01)!" in done.stderr, done.stderr
    assert 'test_hang.py", line 6 in test_hangs_here' in done.stderr, done.stderr


def test_the_longest_child_runs_end_before_the_suite_limit_does():
    """A child run's own time limit must fire first: past the suite's, the worker's watchdog ends the worker and the
    child, never killed, runs on (python_runs.LONG_RUN_TIMEOUT_S; the suite's limit went from 600 s to 300 s while
    five tests still gave their child 300 s)."""
    limit = tomllib.loads((TESTS.parent / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["timeout"]
    assert LONG_RUN_TIMEOUT_S < limit
    at_the_limit = re.compile(r"\btimeout=([0-9]+)\b")
    over = [(path.name, seconds) for path in TESTS.rglob("*.py") for seconds in at_the_limit.findall(path.read_text())
            if int(seconds) >= limit]
    assert over == [], "a child's time limit the suite's limit cuts short (use python_runs.LONG_RUN_TIMEOUT_S)"
