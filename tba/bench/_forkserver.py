"""A server process that imports torch once and forks a fresh child for every measurement.

A search that measures tens of batch sizes (``python -m tba capacity``) would otherwise start a
Python process per measurement and spend about 1.5 s of each importing torch: a quarter of the
capacity run on the 2-core VM. :class:`ForkServer` starts one process under the measurements'
environment (the preloaded allocator and ``MALLOC_*`` settings are fixed at exec, so they are the
same for every child), which imports torch and nothing of tba, then waits for requests. Each
request is served by a child forked from it: a new address space whose memory counters
(``VmHWM``, reset through ``/proc/self/clear_refs``, see ``tba/bench/meters.py``) and malloc
state are its own, which imports tba, runs :func:`tba.bench.isolated._worker` exactly as
``python -m tba.bench.isolated`` would, and exits. Its stdout and stderr go to unlinked temporary
files the server reads back and answers with, as ``subprocess.run(capture_output=True)`` would
give them; nothing is named on disk, so a killed run leaves no file.

Note: [Why the server imports torch and nothing else]
Forking a process that runs threads copies only the forking thread; a lock another thread held
stays locked in the child. Importing torch starts no thread that the child needs; importing tba
starts its control thread (``tba/_control.py``), so the server leaves tba to the child: it is
this file loaded by path (``python -c`` with :data:`_BOOT`), not ``python -m tba.bench...``, which
would import the ``tba`` package first (a review caught the server doing so). The server never
runs a torch operator either, so no intra-op thread pool exists to be lost across
the fork, and a child's ``torch.get_num_threads()`` is what a fresh process gets
(``tests/bench/test_forkserver.py`` checks it).

Note: [The server imports dynamo too]
Every measurement builds an optimizer, and ``torch.optim``'s constructors import ``torch._dynamo``
on first use: 1.0-1.4 s of each child on the 2-core VM, most of the overhead of a one-step
measurement (``capacity --preset deep`` makes about 27). The server imports it once. It starts no
thread and runs no operator (``tests/bench/test_forkserver.py`` checks the child's threads and
thread count as before).

Protocol: one JSON line per request on the server's stdin, ``{"request": ..., "target": spec, "env": ...,
"cwd": ...}`` (``target``: a :func:`tba.bench.isolated.factory_spec` string naming the function the child
calls with ``request``, None for the isolated worker; ``env`` and ``cwd``, optional: the environment and
working directory the child takes before it imports anything); the server answers ``ready`` once torch is
imported, then one JSON line per request, ``{"status": ..., "out": ..., "err": ...}`` (the child's
exit status, negative when a signal killed it, and its output). EOF on stdin ends the server; its
own stderr goes to an unlinked temporary file.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from typing import IO

_PR_SET_PDEATHSIG = 1
"""``prctl`` option: the signal a process gets when its parent dies (linux/prctl.h)."""


class ForkServerError(RuntimeError):
    """The server process died or answered nonsense; its stderr is in the message."""


_BOOT = ("import importlib.util, sys; spec = importlib.util.spec_from_file_location('tba_forkserver', sys.argv[1]); "
         "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module); "
         "module._serve(sys.stdin, sys.stdout, sys.argv[2])")
"""The server's command: this file loaded by path, so that the ``tba`` package is not imported
(Note [Why the server imports torch and nothing else])."""

PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
"""The directory holding ``tba/``: a child that would find another tba (or none) puts it first on
its own ``sys.path``, so that it imports this same tba (the environment is left as it is)."""


class ForkServer:
    """Runs ``python -m tba.bench.isolated``'s worker in children forked from one process.

    Use as a context manager; :meth:`run` is safe from one thread at a time (a lock serialises it).
    A server that died is started again at the next :meth:`run`.

    Args:
        env: The environment the server (and so every child) runs under.
    """

    def __init__(self, env: dict[str, str]) -> None:
        self._env = dict(env)
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._stderr: IO[str] | None = None
        self._start()

    def __repr__(self) -> str:
        return f"ForkServer(pid={self.pid}, running={self._proc is not None and self._proc.poll() is None})"

    @property
    def pid(self) -> int | None:
        """The server process's id (None between a death and the restart)."""
        return self._proc.pid if self._proc is not None else None

    def _start(self) -> None:
        self._stderr = tempfile.TemporaryFile("w+")  # unlinked: nothing is left on disk, whatever kills us
        self._proc = subprocess.Popen([sys.executable, "-c", _BOOT, os.path.abspath(__file__), PACKAGE_ROOT],
                                      env=self._env, text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=self._stderr)
        if self._proc.stdout.readline().strip() != "ready":
            raise ForkServerError(f"the fork server did not start: {self._stop()}")

    def run(self, request_json: str, target: str | None = None, *, env: dict[str, str] | None = None,
            cwd: str | None = None) -> tuple[int, str, str]:
        """Serve one request; returns ``(exit status, stdout, stderr)`` of the child.

        ``target`` (``"module:function"`` or ``"file.py:function"``) is what the child calls with
        ``request_json``; None: the isolated worker, as ``python -m tba.bench.isolated`` runs it.
        ``env`` replaces the child's environment and ``cwd`` its working directory, before it imports
        anything; what the server's process fixed at its start (a preloaded library, the interpreter's
        own settings, torch's) stays as the server's environment set it.
        Raises :class:`ForkServerError` when the server died (the next call starts a new one).
        """
        message = {"request": request_json, "target": target, "env": env, "cwd": cwd}
        with self._lock:
            if self._proc is None:
                self._start()
            try:
                self._proc.stdin.write(json.dumps(message) + "\n")
                self._proc.stdin.flush()
                answer = json.loads(self._proc.stdout.readline())
            except (OSError, ValueError):
                raise ForkServerError(f"the fork server (pid {self._proc.pid}) stopped: {self._stop()}") from None
            return answer["status"], answer["out"], answer["err"]

    def close(self) -> None:
        """Stop the server (it exits at EOF on its stdin)."""
        with self._lock:
            if self._proc is not None:
                self._stop(timeout_s=30)

    def __enter__(self) -> ForkServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _stop(self, timeout_s: float = 0) -> str:
        """End the server (EOF first, then kill after ``timeout_s``), close its pipes; its stderr's tail."""
        proc, self._proc = self._proc, None
        try:
            proc.stdin.close()
        except OSError:
            pass
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        self._stderr.seek(0)
        text = self._stderr.read()[-2000:]
        self._stderr.close()
        return text or f"exit status {proc.returncode}"


def _die_with(server_pid: int) -> None:
    """Have the kernel kill this child when the server dies (Linux), so that a killed run leaves no
    measurement running on; a server already gone ends the child at once."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
    if os.getppid() != server_pid:
        os._exit(70)


def _use_package(root: str) -> None:
    """Put ``root`` first on ``sys.path`` unless ``tba`` is found there already (finding does not import it)."""
    spec = importlib.util.find_spec("tba")
    if spec is None or not spec.origin or os.path.dirname(os.path.dirname(spec.origin)) != root:
        sys.path.insert(0, root)


def _child(request_json: str, out: int, err: int, target: str | None = None, env: dict[str, str] | None = None,
           cwd: str | None = None) -> int:
    """In the forked child: output to the descriptors ``out`` and ``err``, the environment ``env`` and the
    working directory ``cwd`` when given, run the worker (or ``target``), exit status 0 or 1."""
    os.dup2(out, 1)
    os.dup2(err, 2)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    status = 0
    try:
        if env is not None:
            os.environ.clear()
            os.environ.update(env)
        if cwd is not None:
            os.chdir(cwd)
        from tba.bench.isolated import _worker, load_factory

        (load_factory(target) if target else _worker)(request_json)
    except BaseException:  # the child reports every failure through its exit status and stderr
        import traceback

        traceback.print_exc()
        status = 1
    finally:
        import atexit

        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
    return status


def _serve(requests: IO[str], answers: IO[str], root: str = PACKAGE_ROOT) -> None:
    import torch  # noqa: F401 (imported once here, shared by every child; see the module docstring)
    import torch._dynamo  # noqa: F401 (Note [The server imports dynamo too])

    server_pid = os.getpid()
    _use_package(root)  # once, for every child
    answers.write("ready\n")
    answers.flush()
    for line in requests:
        message = json.loads(line)
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            pid = os.fork()
            if pid == 0:
                status = 70
                try:
                    _die_with(server_pid)
                    status = _child(message["request"], out.fileno(), err.fileno(), message.get("target"),
                                    message.get("env"), message.get("cwd"))
                finally:  # never return into the server's loop, whatever happened before the child's handler
                    os._exit(status)
            _, wait_status = os.waitpid(pid, 0)
            texts = []
            for stream in (out, err):
                stream.seek(0)
                texts.append(stream.read().decode(errors="replace"))
        answers.write(json.dumps({"status": os.waitstatus_to_exitcode(wait_status), "out": texts[0],
                                  "err": texts[1]}) + "\n")
        answers.flush()
