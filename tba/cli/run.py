"""Run a Python script or module under a caching malloc (jemalloc, tcmalloc or mimalloc), preloaded.

``python -m tba run [--allocator auto|jemalloc|tcmalloc|mimalloc|system] script.py args...``
(or ``... run -m package.module args...``, or ``... run -c "code" args...``) replaces itself with ``python script.py args...``
whose environment has the allocator's library first in ``LD_PRELOAD`` (plus
:data:`tba.allocator.SETTINGS` where unset: ``MALLOC_CONF=dirty_decay_ms:-1`` for jemalloc). One
line on stderr names the allocator, its library and the allocator variables set (``MALLOC_CONF``,
...). Arguments, standard streams, signals and the exit status are the script's own: the launcher
execs it, nothing stays in between.

``auto`` (default) takes the first found of tcmalloc, jemalloc, mimalloc (the order measured in
docs/cpu-memory.md), searching the Python environment (the ``cpu`` extra's ``cmeel-mimalloc``),
``ldconfig``'s cache and the usual library folders; with none installed it runs under the C
library's malloc and says so. A named allocator that is not installed is an error (exit status 2)
naming how to install it. Why it matters: Note [Why tba cares which malloc serves the process] in
``tba/allocator.py``. PyTorch's ``python -m torch.backends.xeon.run_cpu --enable-jemalloc`` does
the same for jemalloc and tcmalloc.
"""

from __future__ import annotations

import argparse
import os
import sys

from tba.allocator import CHOICES, INSTALL_HINTS, launch_env
from tba.errors import TbaConfigError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.usage = "python -m tba run [--allocator NAME] (script.py | -m module | -c code) [args ...]"
    parser.add_argument("--allocator", choices=CHOICES, default="auto",
                        help="malloc to preload: auto = first found of tcmalloc, jemalloc, mimalloc (default); "
                             "system = the C library's, no preload")
    parser.add_argument("-m", dest="module", nargs=argparse.REMAINDER, metavar="MODULE ...",
                        help="run a module as python -m does; everything after it is the module's")
    parser.add_argument("-c", dest="code", nargs=argparse.REMAINDER, metavar="CODE ...",
                        help="run code as python -c does; everything after the code is its sys.argv[1:]")
    parser.add_argument("script", nargs=argparse.REMAINDER, metavar="script.py args",
                        help="the script and its arguments")


def command_line(args: argparse.Namespace) -> list[str]:
    """The Python command the launcher execs: ``[python, script, args...]``, ``[python, -m, module, args...]`` or
    ``[python, -c, code, args...]``."""
    if args.code is not None:
        if not args.code:
            raise TbaConfigError('-c needs the code to run: python -m tba run -c "import torch; ..." [args ...]')
        return [sys.executable, "-c", *args.code]
    if args.module is not None:
        if not args.module:
            raise TbaConfigError("-m needs a module name: python -m tba run -m package.module [args ...]")
        return [sys.executable, "-m", *args.module]
    if not args.script:
        raise TbaConfigError("nothing to run: python -m tba run [--allocator NAME] (script.py | -m module | -c code) [args ...]")
    return [sys.executable, *args.script]


def run(args: argparse.Namespace) -> int:
    """Exec the script under the allocator; returns (exit status 2) only on a usage error."""
    try:
        argv = command_line(args)
        env, description = launch_env(args.allocator)
    except TbaConfigError as err:
        print(f"python -m tba run: error: {err}", file=sys.stderr)
        return 2
    if args.allocator == "auto" and description.startswith("system "):  # LD_PRELOAD may hold the user's own libraries
        description += f"; no caching allocator found: {INSTALL_HINTS['jemalloc']}, or {INSTALL_HINTS['mimalloc']}"
    print(f"tba run: malloc {description}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    try:
        os.execve(sys.executable, argv, env)
    except OSError as err:
        print(f"python -m tba run: error: cannot run {sys.executable}: {err}", file=sys.stderr)
        return 2
    return 0  # not reached: execve only returns by raising
