"""Argument types for the command line that reject bad values before any work starts.

Each function is an ``argparse`` ``type=``: it returns the parsed value or raises
:class:`argparse.ArgumentTypeError` with a message naming the accepted values, which the parser of
:mod:`tba.cli` prints as one line before exiting with status 2.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import math
import os
import sys
import tempfile
from collections.abc import Callable
from typing import NoReturn

from tba._units import parse_size
from tba.defaults import MAX_QUEUE_DEPTH
from tba.errors import did_you_mean, linked_errors
from tba.io import FULL_DISK_ERRNOS, backend_names, file_creation_failure


def queue_depth(text: str) -> int:
    """A queue depth in ``1..MAX_QUEUE_DEPTH``."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if not 1 <= value <= MAX_QUEUE_DEPTH:
        raise argparse.ArgumentTypeError(f"{value} is out of range; pass a queue depth in 1..{MAX_QUEUE_DEPTH}")
    return value


def int_at_least(least: int) -> Callable[[str], int]:
    """A type for a whole number ``>= least`` (a count of steps, cases, storages)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number; pass one >= {least}") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"{value} is too small; pass a whole number >= {least}")
        return value

    return parse


def fraction(text: str) -> float:
    """A type for a fraction in [0, 1] (a rate of faults or of steps); ``nan`` and ``inf`` are refused."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; pass a fraction from 0 to 1, such as 0.1") from None
    if not 0.0 <= value <= 1.0:  # False for nan too
        raise argparse.ArgumentTypeError(f"{text} is not a fraction; pass a number from 0 to 1, such as 0.1")
    return value


def nonempty_path(text: str) -> str:
    """A type for a file or directory path that is not empty: ``--directory ''`` (an unset shell variable)
    meant the current directory to ``os.path.abspath``, and ``--json ''`` meant no JSON at all."""
    if not text.strip():
        raise argparse.ArgumentTypeError("the path is empty (an unset shell variable?); pass a path")
    return text


def why_unwritable(directory: str) -> str | None:
    """Why a file cannot be created in ``directory`` (a real try, removed at once: root passes os.access
    on /proc), or None when it can."""
    try:
        fd, probe = tempfile.mkstemp(prefix=".tba-probe-", dir=directory)
    except OSError as err:
        return file_creation_failure(directory, err)
    os.close(fd)
    os.unlink(probe)
    return None


def output_file(option: str, path: str) -> str:
    """Check, before any work, that ``path`` can be written as a file; raises ValueError naming the fix."""
    if os.path.isdir(path):
        raise ValueError(f"{option} {path} is a directory; pass a file path")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise ValueError(f"{option} {path}: no directory {parent}; create it or pass another path")
    problem = why_unwritable(parent)
    if problem is None and os.path.exists(path) and not os.access(path, os.W_OK):
        problem = f"{path} is not writable"
    if problem:
        raise ValueError(f"{option} {path}: {problem}; pass another path")
    return path


MISSING_REFUSED = "an existing one: a missing one is refused, not created as Python's directory= does"
"""The end of every spill directory's ``--help``: Note [The command line refuses a missing directory]."""


def existing_directory(option: str, path: str) -> str:
    """Check, before any work, that ``path`` is an existing directory a file can be created in; raises
    ValueError naming the fix.

    Note: [The command line refuses a missing directory]
    ``tba.offload_activations(directory=...)`` (and ``$TBA_DIR`` there) creates a missing directory with its
    parents (logged at DEBUG, ``tba/io/_directory.py``): a training script names its own scratch place. A
    command given a missing ``--directory`` or ``$TBA_DIR`` refuses it instead, before any work, naming the
    fix: a mistyped path on the command line (``/mnt/nmve``) would otherwise become a new directory on
    whatever disk holds its parent, and a benchmark would measure that disk and leave the directory behind.
    Every command that takes a spill directory says so in its ``--help`` (:data:`MISSING_REFUSED`).
    """
    if not os.path.exists(path):
        raise ValueError(f"{option} {path} does not exist; create it or pass an existing directory")
    if not os.path.isdir(path):
        raise ValueError(f"{option} {path} is not a directory; pass a directory")
    problem = why_unwritable(path)
    if problem:
        raise ValueError(f"{option} {path}: {problem}; choose a writable directory on a local disk (or tmpfs)")
    return path


def spill_directory(given: str | None) -> str:
    """The spill directory: ``--directory`` (``given``), else ``$TBA_DIR``, else the temp directory, as tba's offloader
    picks it, checked before any work (:func:`existing_directory`). The demo and gpu-report used the temp directory
    where ``$TBA_DIR`` was set, though their help said otherwise; a bad ``$TBA_DIR`` failed every tba run, one by one."""
    if given is not None:
        return existing_directory("--directory", given)
    return env_directory("--directory") or tempfile.gettempdir()


def env_directory(option: str) -> str | None:
    """``$TBA_DIR``, the offload directory a user has set for tba, checked as ``option`` would be when it is not given
    (:func:`existing_directory`); None when it is not set."""
    if not os.environ.get("TBA_DIR"):
        return None
    return existing_directory(f"$TBA_DIR (used where {option} is not given)", os.environ["TBA_DIR"])


def output_directory(option: str, path: str) -> str:
    """Check, before any work, that ``path`` is a directory files can be written in, creating it when
    missing (the command writes its results there); raises ValueError naming the fix."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{option} {path} is a file; pass a directory (it is created if missing)")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as err:
        why = file_creation_failure(os.path.dirname(os.path.abspath(path)), err, "a directory")
        raise ValueError(f"cannot create {option} {path}: {why}; pass a writable directory") from None
    problem = why_unwritable(path)
    if problem:
        raise ValueError(f"{option} {path}: {problem}; pass a writable directory")
    return path


def backend_name(text: str) -> str:
    """One of the backend names (:func:`tba.io.backend_names`)."""
    if text not in backend_names():
        raise argparse.ArgumentTypeError(f"unknown backend {text!r}; {did_you_mean(text, backend_names())}"
                                         f"choose one of {', '.join(backend_names())}")
    return text


def device_name(text: str) -> str:
    """``auto`` (a CUDA device when torch sees one, else the CPU), ``cpu``, ``cuda`` or ``cuda:N``;
    whether the device is usable is checked later, with the rest of the set-up."""
    if text == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return text


def positive_size(text: str) -> int:
    """A type for a size above zero (``64K``, ``1G``, bytes)."""
    try:
        value = parse_size(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not positive; pass a size such as 1G")
    return value


def positive_list(what: str) -> Callable[[str], str]:
    """A type for a comma-separated list of positive numbers (kept as the text, already checked)."""

    def parse(text: str) -> str:
        for item in text.split(","):
            try:
                value = float(item)
            except ValueError:
                raise argparse.ArgumentTypeError(
                    f"{item.strip()!r} is not a number; pass {what} as comma-separated numbers, e.g. 0.5,0.25"
                ) from None
            if not value > 0:
                raise argparse.ArgumentTypeError(f"{item.strip()} is not positive; pass {what} > 0")
            if not math.isfinite(value):
                raise argparse.ArgumentTypeError(f"{item.strip()} is not a finite number; pass {what} as numbers "
                                                 "such as 0.5,0.25")
        return text

    return parse


def factory(text: str) -> str:
    """``MODULE:FUNC`` (or ``path/to/file.py:FUNC``) naming a callable that can be imported now."""
    module_name, sep, func_name = text.rpartition(":")
    if not sep or not module_name or not func_name:
        raise argparse.ArgumentTypeError(f"{text!r} is not MODULE:FUNC, e.g. mypkg.train:make_model")
    if module_name.endswith(".py"):
        if not os.path.isfile(module_name):
            raise argparse.ArgumentTypeError(f"no file {module_name!r}; pass an existing path/to/file.py:FUNC")
        return text
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise argparse.ArgumentTypeError(
            f"cannot import module {module_name!r} ({err}); check the name and that it is on PYTHONPATH"
        ) from None
    if not callable(getattr(module, func_name, None)):
        raise argparse.ArgumentTypeError(f"module {module_name!r} has no function {func_name!r}")
    return text


def usage_error(command: str, message: str) -> NoReturn:
    """Exit like an argparse error: one line ``python -m tba COMMAND: error: MESSAGE`` on stderr, status 2."""
    sys.stderr.write(f"python -m tba {command}: error: {message}\n")
    raise SystemExit(2)


DISK_FULL_ERRNOS = (*FULL_DISK_ERRNOS, errno.EFBIG)
"""No space left, a quota reached, a file past its size limit (``ulimit -f``): the disk, not the command, failed."""


def disk_full_in(err: BaseException) -> OSError | None:
    """The full-disk ``OSError`` behind ``err`` (torch.save raises its own RuntimeError with it as the context), if any;
    None for a signal's exception, whatever it wraps, which ends the command as the signal would."""
    if any(isinstance(linked, (SystemExit, KeyboardInterrupt)) for linked in linked_errors(err)):
        return None
    return next((linked for linked in linked_errors(err)
                 if isinstance(linked, OSError) and linked.errno in DISK_FULL_ERRNOS), None)
