"""Run a measurement in a fresh Python process, so that one mode's freed memory does not hide the next one's peak.

:func:`run_isolated` sends the request as JSON to ``python -m tba.bench.isolated`` and reads a
:class:`~tba.bench.harness.ModeResult` back from the last line of its output. A user's model is
named by ``"module:function"`` or ``"path/to/file.py:function"`` factories (:func:`factory_spec`).
With ``malloc_env`` (default) the child runs under :data:`~tba.bench.meters.MALLOC_ENV`; see
Note [Why measured processes fix glibc's mmap threshold] in ``tba/bench/meters.py``. ``allocator``
(``system`` by default, or ``auto``, ``jemalloc``, ``tcmalloc``, ``mimalloc``) is preloaded into
the child (:func:`tba.allocator.launch_env`), the same for every mode; the child reports the
allocator it found serving it, and a mismatch (a preload the loader refused) is an error. Many
measurements under one environment can share a :func:`fork_server`, which forks each child from a
process that has imported torch already (``tba/bench/_forkserver.py``) instead of starting Python.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from tba.allocator import CACHING, detect, launch_env, resolve
from tba.bench._forkserver import ForkServer, ForkServerError
from tba.bench.harness import ModeResult, run_mode, run_steps
from tba.bench.meters import MALLOC_ENV
from tba.bench.models import PRESETS


def factory_spec(factory: Callable[..., Any] | str) -> str:
    """``"module:qualname"`` (or ``"file.py:qualname"`` for a script's own functions) naming ``factory``."""
    if isinstance(factory, str):
        return factory
    module = factory.__module__
    if module == "__main__":
        module = os.path.abspath(sys.modules["__main__"].__file__)
    if "<" in factory.__qualname__:
        raise ValueError(f"{factory.__qualname__} cannot be imported in a fresh process; define it at module level")
    return f"{module}:{factory.__qualname__}"


def load_factory(spec: str) -> Callable[..., Any]:
    """The function named by :func:`factory_spec`."""
    module_name, _, name = spec.rpartition(":")
    if module_name.endswith(".py"):
        loader = importlib.util.spec_from_file_location("tba_user_factories", module_name)
        module = importlib.util.module_from_spec(loader)
        loader.loader.exec_module(module)
    else:
        module = importlib.import_module(module_name)
    target: Any = module
    for part in name.split("."):
        target = getattr(target, part)
    return target


class IsolatedRunError(RuntimeError):
    """A measured process failed; ``reason`` is its last line (the exception), ``stderr`` all of it."""

    def __init__(self, mode: str, stderr: str) -> None:
        lines = [line for line in stderr.strip().splitlines() if line.strip()]
        self.mode = mode
        self.stderr = stderr
        self.reason = lines[-1].strip() if lines else "no output"
        super().__init__(f"mode {mode} failed:\n{stderr[-4000:]}")


def process_environment(allocator: str, malloc_env: bool) -> dict[str, str]:
    """The environment of a measured process: ``allocator`` preloaded, glibc tuned by ``malloc_env``."""
    env, _ = launch_env(allocator, dict(os.environ, **MALLOC_ENV) if malloc_env else _plain_env())
    return env


def fork_server(*, malloc_env: bool = True, allocator: str = "system") -> ForkServer:
    """A :class:`~tba.bench._forkserver.ForkServer` for :func:`run_isolated` calls with these same
    ``malloc_env`` and ``allocator``; use it as a context manager."""
    return ForkServer(process_environment(allocator, malloc_env))


def run_isolated(mode: str, preset: str | None, *, malloc_env: bool = True, allocator: str = "system",
                 server: ForkServer | None = None, **kwargs: Any) -> ModeResult:
    """:func:`run_mode` in a fresh Python process; keyword arguments as for :func:`run_mode`.

    With ``malloc_env`` (default) the process runs under :data:`~tba.bench.meters.MALLOC_ENV`;
    without it, in a plain environment as a user's training would (glibc's adaptive mmap threshold).
    ``allocator`` is preloaded into the process (an ``--allocator`` value, see :mod:`tba.allocator`);
    the result's ``allocator`` is the one the process found serving it. With ``server`` (from
    :func:`fork_server`, given the same ``malloc_env`` and ``allocator``), the process is forked from it.

    With ``preset=None``, pass ``model_factory`` and ``batch_factory`` (callables defined at
    module level, or their :func:`factory_spec` strings) to measure any model with :func:`run_steps`.
    """
    for key in ("model_factory", "batch_factory"):
        if key in kwargs:
            kwargs[key] = factory_spec(kwargs[key])
    request = json.dumps({"mode": mode, "preset": preset, **kwargs})
    last_line, stderr = run_request(request, mode, module="tba.bench.isolated", server=server, allocator=allocator,
                                    malloc_env=malloc_env)
    _relay_warnings(stderr)
    result = ModeResult(**json.loads(last_line))
    check_allocator(result, allocator, malloc_env, stderr)
    return result


def run_request(request: str, label: str, *, module: str, target: str | None = None, server: ForkServer | None = None,
                allocator: str = "system", malloc_env: bool = True) -> tuple[str, str]:
    """Run ``python -m module request`` in a fresh process, or ``target(request)`` in a child of ``server``
    (None: its default worker, :func:`_worker`); returns the last line of its output and its standard error.

    Raises :class:`IsolatedRunError` (named ``label``) when the process fails or prints nothing.
    """
    if server is not None:
        try:
            returncode, stdout, stderr = server.run(request, target)
        except ForkServerError:  # the server died (not the measurement): once more, on a new server
            try:
                returncode, stdout, stderr = server.run(request, target)
            except ForkServerError as err:
                raise IsolatedRunError(label, str(err)) from None
    else:
        proc = subprocess.run([sys.executable, "-m", module, request], capture_output=True, text=True,
                              env=process_environment(allocator, malloc_env))
        returncode, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    lines = stdout.strip().splitlines()
    if returncode != 0 or not lines:
        raise IsolatedRunError(label, stderr or f"exit status {returncode} and no result")
    return lines[-1], stderr


def check_allocator(result: ModeResult, allocator: str, malloc_env: bool, stderr: str) -> None:
    """Raise when the malloc that served a measured process is not the one asked for (a preload the loader refused)."""
    wanted = resolve(allocator)[0]
    if result.allocator != wanted and not (wanted == "system" and result.allocator not in CACHING):
        raise RuntimeError(f"mode {result.mode} was to run under {wanted} but {result.allocator} served it "
                           f"(LD_PRELOAD={process_environment(allocator, malloc_env).get('LD_PRELOAD', '')!r}):\n"
                           f"{stderr[-2000:]}")


_relayed: set[str] = set()


def _relay_warnings(stderr: str) -> None:
    """Repeat tba's own warnings from a measured process on this one's stderr, each text once per run
    (the glibc malloc warning, say, which every tba mode's process logs once)."""
    for line in stderr.splitlines():
        if line.startswith("tba: ") and line not in _relayed:
            _relayed.add(line)
            print(line, file=sys.stderr, flush=True)


def _plain_env() -> dict[str, str]:
    """The environment without any glibc malloc tuning (``MALLOC_*_`` variables such as
    ``MALLOC_MMAP_THRESHOLD_``, and ``MALLOC_ARENA_MAX``).

    jemalloc's ``MALLOC_CONF`` is not glibc's and stays: it is the caching allocator's own setting,
    which the benchmark's header names, and every mode runs under it alike.
    """
    return {key: value for key, value in os.environ.items() if not key.startswith("MALLOC_") or key == "MALLOC_CONF"}


def _worker(request_json: str) -> None:
    request = json.loads(request_json)
    preset = request.pop("preset")
    if preset is None:
        model = load_factory(request.pop("model_factory"))()
        batch = load_factory(request.pop("batch_factory"))()
        result = run_steps(request.pop("mode"), model, tuple(batch), **request)
        result.allocator = detect().name
        print(json.dumps(dataclasses.asdict(result)))
        return
    config = PRESETS[preset]
    if "config_overrides" in request:
        config = dataclasses.replace(config, **request.pop("config_overrides"))
    result = run_mode(request.pop("mode"), config, **request)
    result.allocator = detect().name
    print(json.dumps(dataclasses.asdict(result)))


if __name__ == "__main__":
    _worker(sys.argv[1])
