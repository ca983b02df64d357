"""fork() after tba was used, or inside a ``with`` block: parent and child each train exactly, or the child gets a clear error.

Each scenario runs in a fresh interpreter (``subprocess``) that forks; the child reports through
its exit status, and ``alarm`` turns a hang into a failure.
"""

from __future__ import annotations

import textwrap

import pytest
from python_runs import run_python

PRELUDE = textwrap.dedent(
    """
    import os, signal, sys
    import torch
    from torch import nn
    import tba

    signal.alarm(30)
    backend, directory = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)  # torch's own OpenMP pool does not survive fork
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(256, 256), nn.GELU()) for _ in range(3)))
    batches = [torch.randn(256, 256) for _ in range(6)]

    def grads(loss):
        model.zero_grad(set_to_none=True)
        loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    want = [grads(model(x).square().mean()) for x in batches]

    def same(got, i):
        return all(torch.equal(g, w) for g, w in zip(got, want[i]))

    def finish(pid, bad):
        if pid == 0:
            os._exit(1 if bad else 0)
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        print("parent bad steps", bad, "child exit", code)
        sys.exit(0 if not bad and code == 0 else 1)
    """
)

REUSABLE = PRELUDE + textwrap.dedent(
    """
    off = tba.Offloader(directory, backend=backend, layers=list(model), min_offload_bytes=0)
    with off:
        loss = model(batches[0]).square().mean()
    assert same(grads(loss), 0)
    pid = os.fork()
    signal.alarm(30)
    bad = []
    for i in range(6):
        with off:
            loss = model(batches[i]).square().mean()
        if not same(grads(loss), i):
            bad.append(i)
    off.close()
    finish(pid, bad)
    """
)

ONE_SHOT = PRELUDE + textwrap.dedent(
    """
    with tba.offload_activations(directory, backend=backend, min_offload_bytes=0):
        pending = model(batches[0]).square().mean()
    pid = os.fork()
    signal.alarm(30)
    bad = []
    if pid == 0:
        try:
            pending.backward()
            bad.append("no error for a tensor saved before fork")
        except tba.TbaError as err:
            if "saved before this process was forked" not in str(err):
                bad.append(str(err))
    else:
        if not same(grads(pending), 0):
            bad.append("pending")
    del pending
    for i in range(6):
        with tba.offload_activations(directory, backend=backend, min_offload_bytes=0):
            loss = model(batches[i]).square().mean()
        if not same(grads(loss), i):
            bad.append(i)
    finish(pid, bad)
    """
)

MID_BLOCK = PRELUDE + textwrap.dedent(
    """
    off = tba.Offloader(directory, backend=backend, layers=list(model), min_offload_bytes=0)
    bad = []
    with off:
        h = model[0](batches[0])
        off.flush()
        pid = os.fork()
        signal.alarm(30)
        if pid == 0:
            try:
                model[1](h)
                bad.append("no error for a save inside a block entered before fork")
            except tba.TbaError as err:
                if "entered before os.fork()" not in str(err):
                    bad.append(str(err))
        else:
            loss = model[2](model[1](h)).square().mean()
    if pid == 0:
        try:
            h.sum().backward()
            bad.append("no error for a tensor saved before fork")
        except tba.TbaError as err:
            if "saved before this process was forked" not in str(err):
                bad.append(str(err))
        del h
    elif not same(grads(loss), 0):
        bad.append("step across the fork")
    for i in range(1, 4):
        with tba.offload_activations(directory, backend=backend, min_offload_bytes=0):
            loss = model(batches[i]).square().mean()
        if not same(grads(loss), i):
            bad.append(i)
    off.close()
    finish(pid, bad)
    """
)


@pytest.mark.parametrize("script", [REUSABLE, ONE_SHOT, MID_BLOCK], ids=["reusable", "one-shot", "mid-block"])
def test_fork_parent_and_child_train_exactly(spill_dir, backend, script):
    done = run_python(["-c", script, backend, spill_dir], timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]


PENDING_SAVE = textwrap.dedent(
    """
    import os, sys, torch, tba
    torch.set_num_threads(1)
    lin = torch.nn.Linear(256, 256)
    x = torch.randn(512, 256)
    with tba.offload_activations(sys.argv[2], backend=sys.argv[1], policy="offload"):
        loss = lin(x).sum()  # the last save may still wait for the control thread at the fork
        pid = os.fork()
        if pid == 0:
            try:
                loss.backward()
                print("child: no error")
            except tba.TbaError as err:
                print("child: TbaError", "fork" in str(err) or "saved before" in str(err))
            except BaseException as err:
                print("child: unexpected", type(err).__name__, err)
            sys.stdout.flush()
            os._exit(0)
        os.waitpid(pid, 0)
    loss.backward()
    print("parent:", bool(lin.weight.grad.isfinite().all()))
    """
)


def test_a_child_forked_mid_block_gets_a_tba_error_for_saves_still_queued(spill_dir, backend):
    done = run_python(["-c", PENDING_SAVE, backend, spill_dir], timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "child: TbaError True" in done.stdout and "parent: True" in done.stdout, done.stdout + done.stderr[-2000:]


@pytest.mark.parametrize("module, lock", [("tba.io._directory", "_warned_lock"), ("tba.runtime._release", "_WARNED_LOCK"),
                                          ("tba.runtime._trim", "_note_lock"), ("tba.runtime._trim", "trimmer._lock")])
def test_a_warning_lock_held_at_fork_is_free_in_the_child(module, lock):
    # A thread of the parent holding one of these locks at the fork (it warns, or counts bytes to trim, at that
    # moment) left it held in the child for good: the child's first warning of that kind hung, or under glibc its
    # first release of an offloaded storage (found by reviews).
    script = textwrap.dedent(f"""
        import functools, importlib, os, sys
        lock = functools.reduce(getattr, {lock!r}.split("."), importlib.import_module({module!r}))
        lock.acquire()
        pid = os.fork()
        if pid == 0:
            lock = functools.reduce(getattr, {lock!r}.split("."), importlib.import_module({module!r}))
            os._exit(0 if lock.acquire(timeout=10) else 3)
        _, status = os.waitpid(pid, 0)
        sys.exit(os.waitstatus_to_exitcode(status))
    """)
    result = run_python(["-c", script], timeout=60)
    assert result.returncode == 0, f"the child found {module}.{lock} held: {result.stderr[-2000:]}"


CLOCKS_AT_FORK = textwrap.dedent(
    """
    import os, signal, sys, torch, tba
    torch.set_num_threads(1)
    lin = torch.nn.Linear(256, 256)
    off = tba.Offloader(sys.argv[2], backend=sys.argv[1], policy="offload", min_offload_bytes=0)
    with off:
        lin(torch.randn(512, 256)).sum().backward()
    clock = off._store.write_clock
    clock.start()  # a write in flight at the fork, its completion thread inside the clock's lock
    clock._lock.acquire()
    pid = os.fork()
    if pid == 0:
        signal.alarm(10)
        before = off.stats.write_busy_s
        with off:
            loss = lin(torch.randn(512, 256)).sum()
        off.flush()
        loss.backward()
        grew = off.stats.write_busy_s > before
        off.close()
        os._exit(0 if grew else 3)
    clock._lock.release()
    clock.stop()
    off.close()
    _, status = os.waitpid(pid, 0)
    sys.exit(os.waitstatus_to_exitcode(status))
    """
)


def test_a_childs_write_clock_counts_none_of_the_parents_transfers(spill_dir, backend):
    # Forked with a write in flight, the child's write_busy_s never grew again (its profile saw an infinitely fast
    # disk), and with the completion thread inside the clock's lock its first write hung (found by a review).
    done = run_python(["-c", CLOCKS_AT_FORK, backend, spill_dir], timeout=120)
    assert done.returncode == 0, f"exit {done.returncode} (3: write_busy_s did not grow, -14: hung)\n{done.stderr[-3000:]}"
