"""``python ARGS`` for tests, forked from a server that imported torch once per test process.

Note: [Tests fork their Python runs from a server that imported torch]
A third of the suite's CPU went to starting Python: about 150 runs of ``python -m tba ...``, of tools and
of ``-c`` probes, each of which spent about 3 s of CPU importing torch (and often 1-2 more importing
dynamo through ``torch.optim``) before its first line of work; CI has two cores. :func:`run_python` serves
such a run from :class:`tba.bench._forkserver.ForkServer` (one per test process, started at first use):
the child is forked from a process that imported torch and dynamo and nothing of tba (Note [Why the
server imports torch and nothing else] in ``tba/bench/_forkserver.py``), takes the run's environment and
working directory, then runs its ``-m`` module, ``-c`` code or script as ``__main__`` and ends as the
interpreter would: non-daemon threads joined, ``atexit`` run, the exit status of ``SystemExit``.

It is not a fresh process in three ways, so such tests keep :func:`subprocess.run`: torch is imported before
the run's first line (a test of what imports it); what is fixed when a process starts (a preloaded
allocator, ``MALLOC_*``, ``PYTHON*``, OpenMP's and torch's own variables; :func:`run_python` starts a real
process when the run's environment changes one of them); and the interpreter's own finalization (a test of
what happens at exit: daemon threads, finalizers, ``Py_Finalize``).
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import threading

FIXED_AT_START = ("LD_", "MALLOC_", "PYTHON", "OMP_", "KMP_", "GOMP_", "MKL_", "TORCH_", "CUDA_")
"""Prefixes of environment variables a process reads when it starts: a run that changes one is a fresh process."""

LONG_RUN_TIMEOUT_S = 240.0
"""Time limit of a test's longest child runs (a two-rank job, an end-to-end demo or bench), below the suite's per-test
limit (``timeout`` in ``pyproject.toml``, 300 s): past that one the worker's watchdog ends the worker (Note [A test
past its timeout in a worker says so] in ``tests/timeout_report.py``) and the child, never killed, runs on; below it
the child is killed and the test fails with what it printed."""

_server = None
_server_lock = threading.Lock()


def run_python(args: list[str], *, env: dict[str, str] | None = None, cwd: str | os.PathLike | None = None,
               timeout: float | None = None) -> subprocess.CompletedProcess:
    """``subprocess.run([sys.executable, *args], capture_output=True, text=True, ...)``, forked from the
    server where that is the same run (Note [Tests fork their Python runs from a server that imported torch])."""
    command = [sys.executable, *args]
    cwd = None if cwd is None else os.fspath(cwd)
    env = dict(os.environ if env is None else env)
    if not _forkable(args, env, _server[1] if _server is not None else os.environ):  # the server's, once started
        return subprocess.run(command, capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout)
    server = _the_server()[0]
    killed = threading.Event()
    timer = None
    if timeout is not None:
        timer = threading.Timer(timeout, _kill_children, (server.pid, killed))
        timer.start()
    try:
        request = json.dumps({"args": list(args), "cwd": cwd or os.getcwd()})
        status, out, err = server.run(request, f"{os.path.abspath(__file__)}:run_as_main", env=env, cwd=cwd)
    finally:
        if timer is not None:
            timer.cancel()
    if killed.is_set():
        raise subprocess.TimeoutExpired(command, timeout, output=out, stderr=err)
    return subprocess.CompletedProcess(command, status, out, err)


def _forkable(args: list[str], env: dict[str, str], server_env: dict[str, str]) -> bool:
    if not args or not (args[0] in ("-m", "-c") or args[0].endswith(".py")):
        return False
    changed = {name for name in set(env) | set(server_env) if env.get(name) != server_env.get(name)}
    return not any(name.startswith(FIXED_AT_START) for name in changed)


def _the_server():
    """The server of this process and the environment it started under (started at the first call)."""
    global _server
    with _server_lock:
        if _server is None:
            from tba.bench._forkserver import ForkServer

            environment = dict(os.environ)
            _server = (ForkServer(environment), environment)
            atexit.register(_server[0].close)
        return _server


def _kill_children(server_pid: int | None, killed: threading.Event) -> None:
    """The run took too long: kill the server's child (the server answers with its death by SIGKILL)."""
    try:
        with open(f"/proc/{server_pid}/task/{server_pid}/children") as children:
            pids = [int(pid) for pid in children.read().split()]
    except (OSError, ValueError):
        return
    killed.set()
    for pid in pids:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass


def run_as_main(request_json: str) -> None:
    """In the forked child: run ``args`` as ``python`` would, then end as the interpreter would; never returns."""
    import runpy
    import signal
    import traceback
    import types

    request = json.loads(request_json)
    args = request["args"]
    sys.orig_argv = [sys.executable, *args]  # what a script re-executing itself runs again (tba.allocator's)
    status = 0
    interrupted = False
    try:
        if args[0] == "-m":
            sys.argv = [args[1], *args[2:]]
            _path_first(request["cwd"])
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        elif args[0] == "-c":
            sys.argv = ["-c", *args[2:]]
            _path_first("")
            main = types.ModuleType("__main__")
            sys.modules["__main__"] = main
            exec(compile(args[1], "<string>", "exec"), main.__dict__)
        else:
            sys.argv = list(args)
            script = os.path.abspath(args[0])
            _path_first(os.path.dirname(script))
            runpy.run_path(script, run_name="__main__")
    except SystemExit as done:
        status = _exit_status(done.code)
    except KeyboardInterrupt:
        traceback.print_exc()
        interrupted = True
    except BaseException:  # noqa: BLE001 - reported as the interpreter reports an uncaught exception
        traceback.print_exc()
        status = 1
    try:
        threading._shutdown()  # the interpreter joins non-daemon threads first, then runs atexit
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if interrupted:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(status)


def _path_first(entry: str) -> None:
    """``sys.path`` as ``python`` starts it for the run: ``entry`` (the script's directory, the working directory for
    ``-m``, ``""`` for ``-c``) first, in place of the server's own ``""``."""
    sys.path[:] = [entry, *(path for path in sys.path if path != "")]


def _exit_status(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1
