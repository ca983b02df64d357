"""tests/python_runs.py: a forked run ends as ``python ARGS`` would (Note [Tests fork their Python runs from a server
that imported torch]), and the fork server's per-request environment and working directory."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from python_runs import run_python

ENDINGS = """
import atexit, os, sys, threading, time
atexit.register(lambda: print("atexit", flush=True))
threading.Thread(target=lambda: (time.sleep(0.2), print("thread", flush=True))).start()
print(sys.argv[1:], os.getcwd(), os.environ.get("TBA_PROBE"), sys.orig_argv[3:] == sys.argv[1:])
sys.exit(int(sys.argv[1]))
"""


def test_a_forked_run_sees_its_arguments_environment_and_directory_and_ends_as_python_does(tmp_path):
    env = dict(os.environ, TBA_PROBE="here")
    done = run_python(["-c", ENDINGS, "3", "x"], env=env, cwd=tmp_path, timeout=60)
    fresh = subprocess.run([sys.executable, "-c", ENDINGS, "3", "x"], env=env, cwd=tmp_path, capture_output=True,
                           text=True, timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr) == (
        3, f"['3', 'x'] {tmp_path} here True\nthread\natexit\n", "")


@pytest.mark.parametrize("code, status, message", [
    ("raise ValueError('boom')", 1, "ValueError: boom"),
    ("import sys; sys.exit('bad input')", 1, "bad input"),
    ("raise KeyboardInterrupt", -2, "KeyboardInterrupt"),
])
def test_a_forked_run_fails_as_python_does(code, status, message):
    done = run_python(["-c", code], timeout=60)
    assert done.returncode == status and message in done.stderr


def test_a_forked_run_that_takes_too_long_is_killed():
    with pytest.raises(subprocess.TimeoutExpired):
        run_python(["-c", "import time; time.sleep(60)"], timeout=1)
    assert run_python(["-c", "print('next')"], timeout=60).stdout == "next\n"  # the server serves the next run


def test_a_setting_fixed_at_start_gets_a_fresh_process():
    probe = "import sys; print('torch' in sys.modules)"
    assert run_python(["-c", probe], timeout=60).stdout == "True\n"  # forked from the server, which imported torch
    fresh = run_python(["-c", probe], env=dict(os.environ, PYTHONHASHSEED="7"), timeout=60)
    assert fresh.stdout == "False\n"


PATH_PROBE = "import sys; print(repr(sys.path[0]), '' in sys.path[1:])"


@pytest.mark.parametrize("form", ["-c", "-m", "script"])
def test_a_forked_run_starts_sys_path_as_python_does(tmp_path, form):
    (tmp_path / "path_probe.py").write_text(PATH_PROBE + "\n")
    args = {"-c": ["-c", PATH_PROBE], "-m": ["-m", "path_probe"], "script": [str(tmp_path / "path_probe.py")]}[form]
    done = run_python(args, cwd=tmp_path, timeout=60)
    fresh = subprocess.run([sys.executable, *args], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)
    assert done.stdout.endswith(" False\n") and done.returncode == 0
