"""A child forked while another thread makes the process's first use of tba uses tba itself (Note [An import in flight
at a fork] in tba/__init__.py; helper-94 found the child waiting for ever for an import lock of the parent's thread)."""

from __future__ import annotations

import textwrap

import pytest
from python_runs import run_python

SCRIPT = textwrap.dedent("""
    import faulthandler, os, sys, tempfile, threading, time
    import torch
    import tba

    directory = tempfile.mkdtemp(dir=sys.argv[2])
    weight, x = torch.randn(64, 64, requires_grad=True), torch.randn(64, 64)

    # Elementwise ops only: a fork while the other thread ran a matrix product (nn.Linear) left the child's own
    # first product hung in torch's BLAS (a fresh-clone CI run), a hazard of torch's, not of tba's import.
    def step():
        with tba.offload_activations(directory, min_offload_bytes=0):  # the first use imports tba's runtime
            loss = (weight.tanh() * x).sigmoid().sum()
        loss.backward()

    thread = threading.Thread(target=step)
    thread.start()
    time.sleep(float(sys.argv[1]))
    pid = os.fork()
    if pid == 0:
        faulthandler.dump_traceback_later(30, exit=True)  # exit status 1: the child hung
        step()
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    thread.join()
    print("child", os.waitstatus_to_exitcode(status))
""")


@pytest.mark.parametrize("delay_s", ["0", "0.01"])
def test_a_child_forked_during_the_first_use_of_tba(tmp_path, delay_s):
    script = tmp_path / "fork_during_import.py"
    script.write_text(SCRIPT)
    done = run_python([str(script), delay_s, str(tmp_path)], timeout=90)
    assert done.returncode == 0 and "child 0" in done.stdout, done.stdout + done.stderr[-3000:]
