"""The one place where tba.checkpoint touches the rest of tba, torch's private DCP names and the OS.

Everything the checkpoint package needs from tba's engine (``make_engine``, ``Request``, ``Op``,
``ALIGN_BYTES``), from ``tba.errors``, from ``tba.io._spill.resolve_directory`` and from the private
names of ``torch.distributed.checkpoint.filesystem`` (``_StorageInfo``, which DCP's own
``FileSystemReader`` expects in the metadata, and ``CURRENT_DCP_VERSION``, the
``Metadata.version`` its writer stamps) is imported here and only here, so that a move of those
modules changes one file.

It also holds the file-system primitives of an atomic checkpoint:

* :func:`host_buffer`: page-aligned host memory from an anonymous ``mmap``, asking for
  transparent huge pages before the first touch (fewer DMA segments per O_DIRECT request), and
  touched once up front because first touch runs at ~1 GB/s here.
* :func:`open_data_file`: a new file opened with ``O_DIRECT`` (buffered, with one warning, where
  the file system refuses it) and preallocated, so a full disk fails before any byte is written.
* :func:`fsync_path` and :func:`swap_into_place`: durability of directory entries and the final
  publication by ``rename`` or, when a checkpoint already sits at the target, by
  ``renameat2(RENAME_EXCHANGE)``, which swaps the two directories in one atomic step.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import logging
import mmap
import os

import torch
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION as DCP_VERSION
from torch.distributed.checkpoint.filesystem import _StorageInfo as StorageInfo

from tba.defaults import ALIGN_BYTES
from tba.errors import TbaConfigError, TbaError
from tba.io import Engine, Op, Request, make_engine, resolve_directory

logger = logging.getLogger("tba")

HUGE_PAGE_BYTES = 2 << 20
"""Host buffers are sized in multiples of this (bytes), the transparent huge page size."""

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100

__all__ = [
    "ALIGN_BYTES", "DCP_VERSION", "Engine", "Op", "Request", "StorageInfo", "TbaCheckpointError",
    "TbaConfigError", "TbaError", "align_up", "fsync_path", "host_buffer", "make_engine",
    "open_data_file", "resolve_directory", "swap_into_place",
]


class TbaCheckpointError(TbaError):
    """A checkpoint could not be written or read; any earlier checkpoint is left untouched."""


def align_up(nbytes: int, alignment_bytes: int = ALIGN_BYTES) -> int:
    """``nbytes`` rounded up to a multiple of ``alignment_bytes``."""
    return -(-nbytes // alignment_bytes) * alignment_bytes


def host_buffer(nbytes: int) -> torch.Tensor:
    """A 1-D ``uint8`` tensor of at least ``nbytes``, page-aligned, every page touched now.

    Args:
        nbytes: Wanted length in bytes; rounded up to :data:`HUGE_PAGE_BYTES`.
    """
    size = align_up(max(nbytes, 1), HUGE_PAGE_BYTES)
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        region.madvise(mmap.MADV_HUGEPAGE)
    buffer = torch.frombuffer(region, dtype=torch.uint8)
    buffer.zero_()
    return buffer


@functools.cache
def _warn_buffered(directory: str, reason: str) -> None:
    logger.warning("tba: checkpoint files in %s use buffered I/O: O_DIRECT refused (%s)", directory, reason)


def open_data_file(path: str, size_bytes: int) -> tuple[int, bool]:
    """Create ``path`` for writing, ``O_DIRECT`` where possible, with ``size_bytes`` preallocated.

    Returns:
        The descriptor and whether it is ``O_DIRECT``.

    Raises:
        OSError: ``ENOSPC`` when the space cannot be reserved, or the file cannot be created.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    try:
        fd, direct = os.open(path, flags | os.O_DIRECT, 0o644), True
    except OSError as err:
        if err.errno != errno.EINVAL:
            raise
        _warn_buffered(os.path.dirname(path), err.strerror)
        fd, direct = os.open(path, flags, 0o644), False
    try:
        if size_bytes:
            os.posix_fallocate(fd, 0, size_bytes)
    except OSError as err:
        if err.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            os.close(fd)
            raise
    return fd, direct


def fsync_path(path: str) -> None:
    """``fsync`` a file or directory by name, making its contents or entries durable."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _exchange(a: str, b: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    result = libc.renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if result != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), a)


def swap_into_place(staging: str, target: str) -> str | None:
    """Publish the directory ``staging`` as ``target`` atomically.

    When ``target`` does not exist this is one ``rename``. When it does, the two directories are
    exchanged with ``renameat2(RENAME_EXCHANGE)``, so that at every instant ``target`` names either
    the old checkpoint or the new one; the old one is then found at ``staging`` and the caller
    removes it. Where the file system has no exchange, the old one is first renamed aside (a
    window in which ``target`` is missing, logged once).

    Returns:
        The path now holding the replaced checkpoint, or None when there was none.
    """
    parent = os.path.dirname(target)
    if not os.path.lexists(target):
        os.rename(staging, target)
        fsync_path(parent)
        return None
    try:
        _exchange(staging, target)
        aside = staging
    except OSError as err:
        if err.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            raise
        logger.warning("tba: %s cannot exchange directories atomically (%s); renaming in two steps",
                       parent, err.strerror)
        aside = staging + ".old"
        os.rename(target, aside)
        os.rename(staging, target)
    fsync_path(parent)
    return aside
