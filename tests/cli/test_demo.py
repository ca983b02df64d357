"""python -m tba demo: both modes in fresh processes, then by turns in one process; losses compared."""

from __future__ import annotations

import re
import subprocess

import pytest
from python_runs import LONG_RUN_TIMEOUT_S, run_python

from tba.cli import main


def _demo(spill_dir: str, *extra: str) -> subprocess.CompletedProcess:
    return run_python(["-m", "tba", "demo", "--preset", "tiny", "--steps", "1", "--allocator", "system", "--directory",
                       spill_dir, "--backend", "threads", *extra], timeout=LONG_RUN_TIMEOUT_S)


@pytest.mark.slow
def test_the_demo_prints_the_steps_by_turns(spill_dir):
    done = _demo(spill_dir)
    assert done.returncode == 0, done.stderr
    assert "turns s" in done.stdout and "losses identical: yes" in done.stdout
    assert "steps taken in turn in one process" in done.stdout
    assert re.search(r"under glibc: tba \(plan [KORS]+\) activation peak is", done.stdout), done.stdout  # the plan chosen
    assert "one step of each in turn" in done.stderr  # progress


@pytest.mark.slow
def test_no_turns_skips_them(spill_dir, capsys):
    # In this process (the modes still run in their own): the command line itself is the test above's.
    assert main(["demo", "--preset", "tiny", "--steps", "1", "--allocator", "system", "--directory", spill_dir,
                 "--backend", "threads", "--no-turns"]) == 0
    out = capsys.readouterr().out
    assert "turns s" not in out and "steps taken in turn" not in out
    assert "its step time" in out
    # The byte columns count the 3 warm-up steps too (helper-156 read them as the measured steps'): said under the table.
    assert "(written / read MiB: what tba moved over all 4 steps, the warm-up and profiled ones too;" in out
