"""Which malloc serves this process, and where to find a caching one to run a program under.

Note: [Why tba cares which malloc serves the process]
tba frees each offloaded activation in the middle of forward, as soon as its write completes. That
only lowers the process's resident memory if the allocator reuses the freed block for the next
activation. glibc's malloc, with its default (adaptive) mmap threshold, serves tensors of a few MiB
from its heap; a freed one leaves a hole that small long-lived objects are carved out of, so the
next activation no longer fits and the heap grows at its top: resident memory ends up where
keeping every activation would have put it. tba works around it by handing the pages back to the
kernel (``tba/runtime/_trim.py``), which costs a page fault per 4 KiB when the memory is used
again, every step. Caching allocators (jemalloc, tcmalloc, mimalloc) keep size-classed blocks
and reuse a freed activation's block for the next one: no hand-back, no re-fault.

:func:`detect` names the allocator that serves ``malloc`` in this process: it resolves ``malloc``
the way the dynamic linker does for the program and asks ``dladdr`` which library holds it (a
preloaded library interposes its own). :func:`find_library` (``tba/_allocator_search.py``) finds a caching
allocator's shared library (the Python environment first, where the ``cpu`` extra's ``cmeel-mimalloc``
puts ``libmimalloc.so.3``, then ``ldconfig``'s cache and the usual library directories), and
:func:`launch_env` is the environment that preloads it into a new process, as
``python -m tba run`` and the benchmarks do.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import os
import sys

from tba import _elf
from tba._allocator_search import find_library, system_dirs
from tba.errors import TbaConfigError

CACHING = ("jemalloc", "tcmalloc", "mimalloc")
"""The caching allocators tba knows how to find and preload."""

AUTO_ORDER = ("tcmalloc", "jemalloc", "mimalloc")
"""What ``--allocator auto`` picks, first found wins. Measured on the ``bench`` GPT (docs/cpu-memory.md):
under tcmalloc keep-all and tba ran fastest in absolute time (tba 2.7 s a step at 0.18x keep-all's
activation peak); jemalloc with its defaults gave a slightly lower peak (0.15-0.16x) but every mode
ran about 1.3x slower, keep-all included (Note [jemalloc keeps its dirty pages])."""

CHOICES = ("auto", *CACHING, "system")
"""Values of every ``--allocator`` option; ``system`` is the C library's malloc (glibc on Linux)."""

INSTALL_HINTS = {
    "jemalloc": "apt-get install libjemalloc2 (Debian/Ubuntu) or dnf install jemalloc",
    "tcmalloc": "apt-get install libtcmalloc-minimal4 (Debian/Ubuntu) or dnf install gperftools-libs",
    "mimalloc": "pip install cmeel-mimalloc (or pip install 'tba-offload[cpu]'), or apt-get install libmimalloc2.0",
}

SETTINGS: dict[str, dict[str, str]] = {"jemalloc": {"MALLOC_CONF": "dirty_decay_ms:-1"}}
"""Environment set with each preloaded allocator unless the user already set it (a ``MALLOC_CONF`` of
the user's own replaces tba's whole). jemalloc keeps freed pages instead of returning them to the
kernel every step: Note [jemalloc keeps its dirty pages]. tcmalloc and mimalloc need nothing.

Note: [jemalloc keeps its dirty pages]
With its defaults (pages unused for 10 s handed back, and those of blocks over 8 MiB at once),
jemalloc gave the pages of a step's freed activations back to the kernel and the next step faulted
them in again: on the ``bench`` GPT keep-all took 640 thousand minor faults a step (2.5 GB of
first touches, at about 0.9 GB/s here), and every mode ran 1.3x slower than under tcmalloc.
``dirty_decay_ms:-1`` (never hand back a freed page; jemalloc still reuses it) took keep-all from
3.1-3.3 s to 2.4-2.5 s a step with 0-1 faults, as fast as tcmalloc (2.45 s, 875 faults); tba and
full recompute gained as much (``tools/bench_e2e.py --preset bench --usage bare --allocator jemalloc``:
3.37 to 2.80 s and 4.80 to 3.39 s). Longer decays (``dirty_decay_ms:60000``), routing large blocks
through the ordinary arenas (``oversize_threshold``) and PyTorch's own launcher settings still
faulted 570-660 thousand times a step. What it costs: the resident set never shrinks while the
process lives, as under tcmalloc, and offload-all's first step on ``bench`` peaked at 0.20-0.22x of
keep-all's activations instead of 0.13-0.17x (later steps 0.08-0.10x). ``background_thread:true``
let tba's peak grow step by step to 0.21x and is not set (docs/cpu-memory.md).
"""

SETTING_PREFIXES = {"jemalloc": ("MALLOC_CONF",), "tcmalloc": ("TCMALLOC_",), "mimalloc": ("MIMALLOC_",)}
"""Environment variables each allocator reads; those set are named in :func:`launch_env`'s description."""


@dataclasses.dataclass(frozen=True)
class Allocator:
    """The malloc serving a process.

    Attributes:
        name: ``"jemalloc"``, ``"tcmalloc"``, ``"mimalloc"``, ``"glibc"``, ``"system"`` (another C
            library's malloc), or the file name of an unknown library that interposes ``malloc``.
        path: The shared object that holds ``malloc``, where known.
        version: The library's version, where it tells.
    """

    name: str
    path: str | None = None
    version: str | None = None

    @property
    def caching(self) -> bool:
        """Whether it is one of the caching allocators (:data:`CACHING`) that reuse freed activation blocks."""
        return self.name in CACHING

    def __str__(self) -> str:
        return self.name + (f" {self.version}" if self.version else "")


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


def _name_of(path: str) -> str | None:
    base = os.path.basename(path)
    return next((name for name in CACHING if name in base), None)


def _address(library: ctypes.CDLL, symbol: str) -> int | None:
    try:
        return ctypes.cast(getattr(library, symbol), ctypes.c_void_p).value
    except AttributeError:
        return None


def _version(name: str, process: ctypes.CDLL) -> str | None:
    try:
        if name == "jemalloc":
            value, size = ctypes.c_char_p(), ctypes.c_size_t(ctypes.sizeof(ctypes.c_char_p))
            if process.mallctl(b"version", ctypes.byref(value), ctypes.byref(size), None, ctypes.c_size_t(0)) == 0:
                return value.value.decode().split("-")[0]
        elif name == "mimalloc":
            number = process.mi_version()  # 209 for 2.0.9, 30403 for 3.4.3
            if number >= 10000:
                return f"{number // 10000}.{number // 100 % 100}.{number % 100}"
            return f"{number // 100}.{number // 10 % 10}.{number % 10}"
        elif name == "tcmalloc":
            process.tc_version.restype = ctypes.c_char_p
            text = process.tc_version(None, None, None)
            return text.decode().split()[-1] if text else None
    except (AttributeError, OSError, ValueError):
        return None
    return None


LIBC_SONAME = "libc.so.6"
"""glibc, by the name its loader knows (opened by that name, not through ``ctypes.util.find_library``, which runs
``ldconfig -p`` in a subprocess); elsewhere (musl) it is not found."""


@functools.lru_cache(maxsize=1)
def detect() -> Allocator:
    """The malloc serving this process (cached: it cannot change after the process starts)."""
    process = ctypes.CDLL(None)
    try:
        libc = ctypes.CDLL(LIBC_SONAME)
    except OSError:
        libc = process
    glibc = _address(libc, "gnu_get_libc_version") is not None
    served = _address(process, "malloc")
    if served is not None and served != _address(libc, "malloc"):
        info = _DlInfo()
        path = None
        if _address(libc, "dladdr") is not None and libc.dladdr(ctypes.c_void_p(served), ctypes.byref(info)):
            path = info.dli_fname.decode(errors="replace") if info.dli_fname else None
        name = _name_of(path) if path else None
        if name is None:
            # malloc linked into the executable itself, or a library named otherwise: ask by symbol.
            markers = {"jemalloc": "mallctl", "mimalloc": "mi_version", "tcmalloc": "MallocExtension_GetAllocatedSize"}
            name = next((n for n, symbol in markers.items() if _address(process, symbol) is not None), None)
        if name is not None:
            return Allocator(name, path, _version(name, process))
        if not _elf.is_executables_import(served, "malloc"):
            return Allocator(os.path.basename(path) if path else "unknown", path)
    if glibc:
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        return Allocator("glibc", None, libc.gnu_get_libc_version().decode())
    return Allocator("system")


def jemalloc_dirty_decay_ms() -> int | None:
    """jemalloc's ``opt.dirty_decay_ms`` in this process (-1: freed pages are never handed back), or
    None when jemalloc does not serve it (Note [jemalloc keeps its dirty pages])."""
    if detect().name != "jemalloc":
        return None
    value, size = ctypes.c_ssize_t(), ctypes.c_size_t(ctypes.sizeof(ctypes.c_ssize_t))
    mallctl = ctypes.CDLL(None).mallctl
    if mallctl(b"opt.dirty_decay_ms", ctypes.byref(value), ctypes.byref(size), None, ctypes.c_size_t(0)) != 0:
        return None
    return value.value


def resolve(choice: str) -> tuple[str, str | None]:
    """``(name, library path)`` for an ``--allocator`` value; ``("system", None)`` for the C library's malloc.

    ``auto`` is the first of :data:`AUTO_ORDER` found, else ``system``. A named allocator that is not
    installed raises :class:`tba.TbaConfigError` naming how to install it.
    """
    if choice not in CHOICES:
        raise TbaConfigError(f"unknown allocator {choice!r}; choose one of {', '.join(CHOICES)}")
    if choice == "system":
        return "system", None
    for name in AUTO_ORDER if choice == "auto" else (choice,):
        path = find_library(name)
        if path is not None:
            return name, path
    if choice == "auto":
        return "system", None
    raise TbaConfigError(f"allocator {choice!r} not found (searched the Python environment, ldconfig and "
                         f"{', '.join(system_dirs())}, passing over paths with a space or colon, which LD_PRELOAD cannot "
                         f"carry); install it: {INSTALL_HINTS[choice]}, or pass --allocator system")


def launch_env(choice: str, env: dict[str, str] | None = None) -> tuple[dict[str, str], str]:
    """``(environment, description)`` that runs a new process under allocator ``choice``.

    The environment is ``env`` (default ``os.environ``) with the library first in ``LD_PRELOAD`` and
    its :data:`SETTINGS` added where unset. ``system`` removes known allocators from ``LD_PRELOAD``,
    so that a process started under one still measures glibc when asked to. The description names
    the allocator, its library and its settings, for a header line.
    """
    name, path = resolve(choice)
    out = dict(os.environ if env is None else env)
    kept = [item for item in out.get("LD_PRELOAD", "").replace(":", " ").split()
            if _name_of(item) is None]
    if path is None:
        if kept:
            out["LD_PRELOAD"] = " ".join(kept)
        else:
            out.pop("LD_PRELOAD", None)
        return out, f"system (the C library's malloc, {'no preload' if not kept else 'preloading only ' + ' '.join(kept)})"
    out["LD_PRELOAD"] = " ".join([path, *kept])
    for key, value in SETTINGS.get(name, {}).items():
        out.setdefault(key, value)
    settings = [f"{key}={value}" for key, value in sorted(out.items()) if key.startswith(SETTING_PREFIXES[name])]
    return out, f"{name} ({path}{', ' + ', '.join(settings) if settings else ''})"


REEXEC_MARK = "TBA_ALLOCATOR_REEXEC"
"""Set in the environment of a script re-executed by :func:`run_script_under`, so that it happens once."""


def serves(allocator: Allocator, name: str) -> bool:
    """Whether ``allocator`` is what :func:`resolve` called ``name`` (``system``: any non-caching malloc)."""
    return not allocator.caching if name == "system" else allocator.name == name


def run_script_under(choice: str) -> Allocator:
    """Make the running script run under allocator ``choice``; returns the allocator serving it.

    If another malloc serves this process, the interpreter is executed again with the same command
    line (``sys.orig_argv``) and the allocator preloaded (:func:`launch_env`), once: if the new
    process is still not served by it (the dynamic loader refused the preload), a
    :class:`tba.TbaConfigError` says so. For a training script's ``--allocator`` option; call it
    before any work, since nothing of this process survives the re-execution.
    """
    name, path = resolve(choice)
    current = detect()
    if serves(current, name):
        return current
    if os.environ.get(REEXEC_MARK) == choice:
        raise TbaConfigError(f"ran again with {path} preloaded, but {current} still serves this process: the "
                             f"dynamic loader refused the preload (see its message above); pass --allocator system")
    env, _ = launch_env(choice)
    env[REEXEC_MARK] = choice
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
    raise AssertionError("not reached")
