"""Report what this machine offers tba: I/O backends and why not, GPU paths, limits, bandwidth.

Each check only reports; none of them makes the command fail. The checks are: the io_uring
engine (extension built, kernel allows it, see :func:`tba.io._io_uring_probe.probe`), whether the offloader's
exit is the native one that no signal handler can skip (``tba/_whole_exit.py``), whether the offloader may write the
offload directory and ``O_DIRECT`` there (:func:`tba.io._directory.probe_direct_io`), whether CUDA is available, whether
kvikio and GPUDirect Storage are, which route CUDA storages take with ``backend="auto"`` (kvikio
with GDS, else staged through pinned host blocks), the locked-memory limit that bounds registered
(fixed) buffers, the malloc serving this process and the caching allocators ``python -m tba run``
can preload (``tba/allocator.py``),
and a quick sequential write and read through the engine that ``backend="auto"`` picks.
"""

from __future__ import annotations

import argparse
import logging
import os
import resource
import shutil

import torch

from tba._units import readable_size
from tba._whole_exit import exit_block
from tba.allocator import CACHING, detect, find_library, jemalloc_dirty_decay_ms
from tba.cli._checks import nonempty_path, positive_size
from tba.defaults import MIB
from tba.device import gds_unavailable_reason, kvikio_unavailable_reason
from tba.io import (
    Op,
    available_backends,
    directory_bandwidth,
    filesystem_type,
    make_engine,
    memory_backed,
    probe_direct_io,
    resolve_backend,
    resolve_directory,
)
from tba.runtime import native_parts

logger = logging.getLogger("tba")

DEFAULT_QUICK_SIZE_BYTES = 256 * MIB
QUICK_BLOCK_SIZE_BYTES = MIB


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the doctor's options to ``parser``."""
    parser.add_argument("--directory", type=nonempty_path, default=None,
                        help="offload directory to check (default $TBA_DIR or the system temp dir)")
    parser.add_argument("--quick-size", type=positive_size, default=DEFAULT_QUICK_SIZE_BYTES,
                        help="bytes for the bandwidth reading, rounded down to a multiple of 1M, at least 1M (default 256M)")
    parser.add_argument("--no-bandwidth", action="store_true", help="skip the bandwidth reading")


def _status(reason: str | None) -> str:
    return "yes" if reason is None else f"no ({reason})"


def _format_limit(value: int) -> str:
    return "unlimited" if value == resource.RLIM_INFINITY else f"{value / MIB:.1f} MiB"


def _cuda_route() -> str:
    """Which route CUDA storages take with ``backend='auto'``, and why (see ``tba/device/_router.py``)."""
    if _cuda_reason() is not None:
        return "none (no CUDA device)"
    gds = gds_unavailable_reason()
    if gds is None:
        return "kvikio (GPUDirect Storage available)"
    return f"staged through pinned host blocks ({gds})"


def _cuda_reason() -> str | None:
    try:
        return None if torch.cuda.is_available() else "torch.cuda.is_available() is False"
    except Exception as err:  # noqa: BLE001
        return f"{type(err).__name__}: {err}"


def quick_bandwidth(directory: str, size: int, direct: bool) -> dict[str, float]:
    """Write then read ``size`` bytes in 1 MiB blocks with the auto engine; GB/s per direction."""
    with make_engine("auto") as engine:
        write, read = directory_bandwidth(engine, directory, size, block_size_bytes=QUICK_BLOCK_SIZE_BYTES, direct=direct)
    return {Op.WRITE.value: write / 1e9, Op.READ.value: read / 1e9}


def directory_source(given: str | None) -> str:
    """Where the checked directory came from, as the offloader picks it (:func:`tba.io.resolve_directory`)."""
    if given is not None:
        return "--directory"
    return "$TBA_DIR" if os.environ.get("TBA_DIR") else "the default, the system temp dir"


def _missing_reason(directory: str, source: str) -> str:
    fix = {"--directory": "pass another --directory",
           "$TBA_DIR": "set TBA_DIR to an existing directory, or pass --directory"}.get(source, "pass --directory")
    if os.path.exists(directory):
        return f"{directory} (from {source}) is not a directory; {fix}"
    return f"{directory} (from {source}) does not exist; create it or {fix}"


def _unwritable_reason(directory: str) -> str | None:
    """Why the offloader refuses the existing ``directory`` as not writable (read-only mount, permissions), else None:
    the O_DIRECT probe's failure there ("Read-only file system") read as "tba falls back to buffered I/O"."""
    if not os.path.isdir(directory) or os.access(directory, os.W_OK | os.X_OK):
        return None
    return f"{directory} is not writable, so tba refuses it; pass another --directory (and tba's directory= or TBA_DIR)"


def _filesystem_row(directory: str) -> str:
    """The file system of ``directory``, or of its nearest existing parent (named) when it does not exist yet."""
    wanted = read = os.path.abspath(directory)
    while not os.path.exists(read) and os.path.dirname(read) != read:
        read = os.path.dirname(read)
    fs_type = filesystem_type(read) or "unknown"
    if read != wanted:
        fs_type += f" (of {read}, the nearest existing parent)"
    if memory_backed(directory):
        return (f"{fs_type}: IN MEMORY, offloading here saves nothing; pass --directory (and tba's directory= "
                "or TBA_DIR) on a disk")
    return fs_type


def _malloc_rows() -> list[tuple[str, str]]:
    """The malloc serving this process, and the caching allocators found for ``python -m tba run``."""
    allocator = detect()
    found = {name: find_library(name) for name in CACHING}
    listed = ", ".join(f"{name} ({path})" for name, path in found.items() if path) or "none"
    decay_ms = jemalloc_dirty_decay_ms()
    if decay_ms is not None and decay_ms >= 0:
        serving = (f"{allocator} ({allocator.path or 'linked in'}) with dirty_decay_ms={decay_ms}: freed activations' "
                   "pages go back to the kernel and fault in again every step; set MALLOC_CONF=dirty_decay_ms:-1, "
                   "as `python -m tba run` does (docs/cpu-memory.md)")
    elif allocator.caching:
        serving = f"{allocator} ({allocator.path or 'linked in'}): freed activations are reused, nothing handed back"
    elif allocator.name == "glibc":
        serving = (f"glibc {allocator.version}: freed activations' pages are handed back and fault in again every "
                   "step; run training under `python -m tba run script.py` (docs/cpu-memory.md)")
    else:
        serving = f"{allocator}: not a caching allocator tba knows; pages are handed back as under glibc"
    return [("malloc in this process", serving), ("caching allocators found", listed)]


def _native_row() -> str:
    """Whether the storage record, the request forming and the host save run in C (their Python fallbacks cost more
    per tensor)."""
    missing = [f"tba._{name}" for name, built in native_parts().items() if not built]
    if not missing:
        return "yes (tba._record, tba._requests, tba._save)"
    return (f"no: {', '.join(missing)} not built or stale, Python serves (more host time per saved tensor; "
            "reinstall with a C compiler)")


def run(args: argparse.Namespace) -> int:
    """Print the report. Always returns 0."""
    directory, source = resolve_directory(args.directory), directory_source(args.directory)
    backends = available_backends()
    unwritable = _unwritable_reason(directory)
    direct_reason = (probe_direct_io(directory) if os.path.isdir(directory) and unwritable is None
                     else unwritable or _missing_reason(directory, source))
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    rows = [
        ("io_uring engine", _status(backends["io_uring"])),
        ("threads engine", _status(backends["threads"])),
        ("exit safe from signals", "yes (tba._shield; a with statement, not contextlib.ExitStack)" if exit_block is not None else
                                   "no: the native extension tba._shield was not built (reinstall with a C compiler)"),
        ("per-storage path in C", _native_row()),
        ("backend 'auto' uses", resolve_backend("auto")),
        ("offload directory", f"{directory} (from {source})"),
        (f"O_DIRECT in {directory}", _status(direct_reason)),
        (f"file system of {directory}", _filesystem_row(directory)),
        ("CUDA available", _status(_cuda_reason())),
        ("kvikio usable", _status(kvikio_unavailable_reason())),
        ("GPUDirect Storage", _status(gds_unavailable_reason())),
        ("CUDA route with 'auto'", _cuda_route()),
        ("memlock limit (soft/hard)", f"{_format_limit(soft)} / {_format_limit(hard)}"
                                      + (" (root: not applied to io_uring buffer registration)" if os.geteuid() == 0 else "")),
        *_malloc_rows(),
    ]
    size = max(QUICK_BLOCK_SIZE_BYTES, args.quick_size - args.quick_size % QUICK_BLOCK_SIZE_BYTES)
    if not args.no_bandwidth and not os.path.isdir(directory):
        rows.append(("bandwidth", f"not measured ({_missing_reason(directory, source)})"))
    elif not args.no_bandwidth and unwritable is not None:
        rows.append(("bandwidth", f"not measured ({unwritable})"))
    elif not args.no_bandwidth and size > shutil.disk_usage(directory).free:  # the probe failed with a bare ENOSPC
        rows.append(("bandwidth", f"not measured (--quick-size {readable_size(size)} is more than the "
                                  f"{readable_size(shutil.disk_usage(directory).free)} free in {directory}; "
                                  "pass a smaller --quick-size)"))
    elif not args.no_bandwidth:
        try:
            gbps = quick_bandwidth(directory, size, direct=direct_reason is None)
            mode = "O_DIRECT" if direct_reason is None else "buffered"
            rows.append((f"bandwidth ({size >> 20} MiB, {mode})",
                         f"write {gbps['write']:.2f} GB/s, read {gbps['read']:.2f} GB/s"))
        except Exception as err:  # noqa: BLE001 - report, never fail
            rows.append(("bandwidth", f"not measured ({type(err).__name__}: {err})"))
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    return 0
