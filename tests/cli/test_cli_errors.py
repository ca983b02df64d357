"""User errors on the command line: one line naming the fix, exit status 2, before any work."""

from __future__ import annotations

import subprocess
import sys

import pytest


def tba_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tba", *args], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(
    "args, match",
    [
        (["bench-io", "--queue-depth", "99999"], "pass a queue depth in 1..4096"),
        (["demo", "--backend", "bogus"], "unknown backend 'bogus'; choose one of auto, io_uring, threads"),
        (["rok", "--budgets", "abc"], "'abc' is not a number; pass --budgets as comma-separated numbers"),
        (["rok", "--budgets-mib", "-5"], "-5 is not positive; pass --budgets-mib > 0"),
        (["rok", "--model", "nosuchmod:make", "--batch", "nosuchmod:batch"], "cannot import module 'nosuchmod'"),
        (["rok", "--model", "tba.bench.models:make_gpt"], "--model needs --batch: pass --batch MODULE:FUNC"),
        (["rok", "--batch", "tba.bench.models:make_batch"], "--batch needs --model: pass --model MODULE:FUNC"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(args, match):
    done = tba_cli(*args)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and match in lines[0], done.stderr
    assert "Traceback" not in done.stderr


def test_doctor_on_missing_directory(tmp_path):
    missing = tmp_path / "nope"
    done = tba_cli("doctor", "--directory", str(missing), "--no-bandwidth")
    assert f"{missing} does not exist" in done.stdout + done.stderr
    assert not missing.exists()
