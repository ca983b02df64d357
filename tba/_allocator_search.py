"""Where a caching allocator's shared library is on this machine, for :mod:`tba.allocator` to preload it.

:func:`find_library` tries each of the allocator's file names (:data:`LIBRARY_FILES`, preferred
first) in three places, in order: the running Python environment (``<site-packages>/cmeel.prefix/lib``,
where the ``cpu`` extra's ``cmeel-mimalloc`` puts ``libmimalloc.so.3``, and ``<prefix>/lib``), the
dynamic linker's cache (``ldconfig -p``, entries of this machine's architecture), then
:func:`system_dirs` (``/usr/lib/<multiarch>`` and the usual library folders). Nothing is loaded:
a path is returned where a file of that name exists and ``LD_PRELOAD`` can carry it.

Note: [LD_PRELOAD cannot carry every path]
The dynamic loader splits ``LD_PRELOAD`` at spaces and colons, with no escape. A library in a
virtual environment under ``~/My Projects`` was preloaded as two missing files: the loader printed
two errors and the program ran under the C library's malloc, while ``python -m tba run`` had named
the caching one. Such paths are passed over (:func:`preloadable`), and the search goes on.
"""

from __future__ import annotations

import os
import site
import subprocess
import sys
import sysconfig

LIBRARY_FILES = {
    "jemalloc": ("libjemalloc.so.2", "libjemalloc.so"),
    "tcmalloc": ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4", "libtcmalloc_minimal.so", "libtcmalloc.so"),
    "mimalloc": ("libmimalloc.so.3", "libmimalloc.so.2", "libmimalloc.so"),
}
"""Shared-library file names of each caching allocator, preferred first."""

LIBRARY_DIRS = ("/usr/local/lib", "/usr/lib64", "/usr/lib", "/lib64", "/lib")

PRELOAD_SEPARATORS = (" ", ":")
"""Characters at which the dynamic loader splits ``LD_PRELOAD`` (Note [LD_PRELOAD cannot carry every path])."""


def preloadable(path: str) -> bool:
    """Whether ``LD_PRELOAD`` can carry ``path``: it holds none of :data:`PRELOAD_SEPARATORS`."""
    return not any(separator in path for separator in PRELOAD_SEPARATORS)


def _environment_dirs() -> list[str]:
    """Library folders inside the running Python environment (cmeel wheels, conda, a venv's lib)."""
    roots = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    try:
        roots.update(site.getsitepackages())
    except AttributeError:
        pass
    dirs = [os.path.join(root, "cmeel.prefix", "lib") for root in sorted(roots)]
    return dirs + [os.path.join(sys.prefix, "lib")]


def _ldconfig_paths() -> dict[str, str]:
    """file name -> path from the dynamic linker's cache (``ldconfig -p``), this machine's architecture first."""
    for ldconfig in ("ldconfig", "/sbin/ldconfig", "/usr/sbin/ldconfig"):
        try:
            # Paths are file names, decoded as Python decodes them: a library path that is not UTF-8 raised.
            out = subprocess.run([ldconfig, "-p"], capture_output=True, text=True, timeout=10,
                                 encoding=sys.getfilesystemencoding(), errors="surrogateescape").stdout
        except (OSError, subprocess.SubprocessError):
            continue
        marker = "x86-64" if os.uname().machine == "x86_64" else ""
        found: dict[str, str] = {}
        for line in out.splitlines():
            name, arrow, path = line.strip().partition(" => ")
            if arrow and marker in name:
                found.setdefault(name.split(" (")[0], path.strip())
        return found
    return {}


def system_dirs() -> list[str]:
    """The usual library folders, searched last: ``/usr/lib/<multiarch>``, ``/lib/<multiarch>``, then :data:`LIBRARY_DIRS`."""
    multiarch = sysconfig.get_config_var("MULTIARCH")
    arch_dirs = [f"/usr/lib/{multiarch}", f"/lib/{multiarch}"] if multiarch else []
    return arch_dirs + list(LIBRARY_DIRS)


def find_library(name: str) -> str | None:
    """The path of caching allocator ``name``'s shared library on this machine, or None.

    Searched in order: the Python environment (``<site-packages>/cmeel.prefix/lib``, ``<prefix>/lib``),
    the dynamic linker's cache (``ldconfig -p``), then ``/usr/lib/<multiarch>`` and the usual library folders,
    passing over paths ``LD_PRELOAD`` cannot carry (Note [LD_PRELOAD cannot carry every path]).
    """
    if name not in LIBRARY_FILES:
        raise ValueError(f"unknown allocator {name!r}; choose one of {', '.join(LIBRARY_FILES)}")
    files = LIBRARY_FILES[name]
    found = _first_file(_environment_dirs(), files)
    if found is not None:
        return found
    cache = _ldconfig_paths()
    for file in files:
        if file in cache and preloadable(cache[file]) and os.path.isfile(cache[file]):
            return cache[file]
    return _first_file(system_dirs(), files)


def _first_file(folders: list[str], files: tuple[str, ...]) -> str | None:
    """The first of ``files`` found in the first of ``folders`` holding one, folder by folder (preloadable ones)."""
    for folder in folders:
        for file in files:
            path = os.path.join(folder, file)
            if preloadable(path) and os.path.isfile(path):
                return path
    return None
