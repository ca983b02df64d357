"""Spill files: where offloaded bytes live, and the disk space they hold.

A :class:`SpillFile` is one file with no name in the offload directory (``O_TMPFILE`` or unlinked
at once, ``O_DIRECT`` where it works: ``tba/io/_directory.py``) plus the allocator of its space,
:class:`tba.io._extents.ExtentAllocator`. Space is reserved with ``fallocate`` ahead of the writes
that use it (Note [Reserve file space ahead of writes]), except on file systems held in memory
(Note [No reservation in memory]), and an idle file gives it back (Note [Idle spill files hold no
disk space]): every open spill file of the process is registered, so that a new file that finds the
disk full (:func:`create_preallocated`, used by checkpoints too) first asks the idle ones for
their space (:func:`release_idle_space`) and then tries again. :class:`SpillFile` calls the
directory's functions by this module's names (``open_anonymous``, ``probe_direct_io``,
``resolve_directory`` are importable from here as they were before ``_directory.py``).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import threading

from tba._weak import WeakRegistry
from tba.defaults import ALIGN_BYTES, IDLE_SPACE_MIN_FREE_FRACTION, SPILL_RESERVE_MIN_BYTES
from tba.errors import TbaConfigError
from tba.io._directory import (
    FULL_DISK_ERRNOS,
    OUT_OF_DESCRIPTORS_ERRNOS,
    check_writable,
    memory_file,
    open_anonymous,
    out_of_descriptors,
    prepare_directory,
    probe_direct_io,
    resolve_directory,
    warn_buffered_once,
    warn_if_memory_backed,
)
from tba.io._extents import ExtentAllocator
from tba.io._fs import file_creation_failure, memory_backed

logger = logging.getLogger("tba")


def create_preallocated(path: str, size_bytes: int, *, directory: str | None = None) -> tuple[int, bool]:
    """Create ``path`` for writing (it must not exist), ``O_DIRECT`` where the file system takes it
    (else buffered, with one warning per ``directory``, by default the file's own: a checkpoint passes
    its parent, not the save's staging directory, new at each save), with ``size_bytes`` preallocated,
    so that a full disk fails here rather than at a write. Returns the descriptor and whether it is ``O_DIRECT``.

    Raises:
        OSError: ``ENOSPC`` when the space cannot be reserved, or the file cannot be created.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    try:
        fd, direct = os.open(path, flags | os.O_DIRECT, 0o644), True
    except OSError as err:
        if err.errno != errno.EINVAL:
            raise
        directory = directory or os.path.dirname(path)
        warn_buffered_once(directory, f"O_DIRECT refused in {directory} ({err.strerror})")
        # Note [A failed open can leave its name] (tba/io/_directory.py): O_EXCL says the name is this call's.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        fd, direct = os.open(path, flags, 0o644), False
    try:
        if size_bytes:
            _fallocate_or_free_idle(fd, size_bytes)
    except OSError as err:
        if err.errno not in NO_RESERVATION_ERRNOS:
            os.close(fd)
            raise
    return fd, direct


def _fallocate_or_free_idle(fd: int, size_bytes: int) -> None:
    """``fallocate``, and once more after idle spill files gave their space back if the disk was full."""
    try:
        reserve(fd, 0, size_bytes)  # Note [No reservation written as zeros]
    except OSError as err:
        if err.errno != errno.ENOSPC or not release_idle_space():
            raise
        logger.info("tba: the disk was full; idle spill files gave their space back for a new file")
        reserve(fd, 0, size_bytes)


_libc = ctypes.CDLL(None, use_errno=True)
_fallocate = getattr(_libc, "fallocate64", None) or getattr(_libc, "fallocate", None)
if _fallocate is not None:
    _fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
    _fallocate.restype = ctypes.c_int


NO_RESERVATION_ERRNOS = (errno.EOPNOTSUPP, errno.EINVAL)
""":func:`reserve` failing with these says the file system reserves nothing: the file grows with its writes."""


def reserve(fd: int, offset: int, length: int) -> None:
    """Allocate ``[offset, offset + length)`` of ``fd`` without writing it (``fallocate(2)``), or raise ``OSError``.

    Note: [No reservation written as zeros]
    Where the file system has no ``fallocate`` (ext2, NFSv3, many FUSE file systems), glibc's
    ``posix_fallocate`` writes a byte into every block instead: a buffered spill file's first 1 MiB
    extent wrote 256 MiB of zeros through the page cache first (1.2 s on ext2 here; over NFS, one
    round trip per 4 KiB block). The reservation only saves work where it writes nothing, so this
    calls ``fallocate`` itself, which answers ``EOPNOTSUPP`` there (``posix_fallocate`` without glibc).
    """
    if _fallocate is None:
        os.posix_fallocate(fd, offset, length)
        return
    while _fallocate(fd, 0, offset, length) != 0:
        err = ctypes.get_errno()
        if err != errno.EINTR:
            raise OSError(err, os.strerror(err))


def free_bytes(fd: int) -> int:
    """Bytes an unprivileged writer may still take on ``fd``'s file system (unbounded where it reports no sizes).

    Note: [No reservation past the free space]
    ext4's fallocate takes free blocks until none is left before it fails: a reservation step larger than the free
    space held every free block until Note [A failed reservation keeps nothing]'s truncation, and meanwhile every
    other writer of the disk (another rank's spill file, a checkpoint) failed with ENOSPC, at each step's first
    reservation. So a step that cannot fit is not tried: the file grows with its writes, as after a refusal.
    """
    stat = os.fstatvfs(fd)
    return stat.f_bavail * stat.f_frsize if stat.f_blocks else 1 << 62  # FUSE and others may report no sizes


_open_spills = WeakRegistry()
_open_spills_lock = threading.Lock()


def _after_fork_in_child() -> None:
    global _open_spills_lock
    _open_spills_lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def release_idle_space() -> int:
    """Make every open spill file of this process that holds no live extent give its space back.

    Returns how many did. Safe at any moment: a file in use keeps its space, and an idle one that is
    used again reserves space anew (see :meth:`SpillFile.release_space`).
    """
    with _open_spills_lock:
        spills = _open_spills.alive()
    return sum(spill.release_space() for spill in spills)


class SpillFile:
    """One anonymous file plus the allocator of its space.

    Args:
        directory: Where the file lives; see :func:`resolve_directory`.
        direct: True requires ``O_DIRECT`` (error if unsupported), False never uses it, None
            (default) uses it when supported and otherwise warns once and uses buffered I/O.
    """

    def __init__(self, directory: str | os.PathLike | None = None, *, direct: bool | None = None) -> None:
        self.directory = resolve_directory(directory)
        prepare_directory(self.directory)
        check_writable(self.directory)
        warn_if_memory_backed(self.directory)
        reason = probe_direct_io(self.directory) if direct is not False else "disabled by direct_io=False"
        if reason is not None and direct:
            raise TbaConfigError(
                f"{reason}; choose a directory on a file system with O_DIRECT (ext4, xfs) "
                "or pass direct_io=None to fall back to buffered I/O"
            )
        if reason is not None and direct is None:
            warn_buffered_once(self.directory, reason)
        self.direct = reason is None
        self.in_memory = False
        """The file lives in memory (``memfd_create``): the disk had no room for it (Note [A disk too full for the
        spill file spills into memory])."""
        try:
            self.fd = open_anonymous(self.directory, direct=self.direct)
        except OSError as err:
            if err.errno in OUT_OF_DESCRIPTORS_ERRNOS:
                raise out_of_descriptors("a spill file", err) from err
            if err.errno not in FULL_DISK_ERRNOS:
                raise TbaConfigError(
                    f"offload directory: {file_creation_failure(self.directory, err)}; "
                    "pass directory= (or set TBA_DIR) to a writable directory on a local disk"
                ) from err
            self.fd, self.direct, self.in_memory = memory_file(self.directory, err), False, True
        self._allocator = ExtentAllocator(ALIGN_BYTES)
        self.size_bytes = 0
        """Largest end of any extent so far: the space the file has grown to (bytes)."""
        self.reserved_bytes = 0
        """Bytes allocated to the file ahead of use by ``fallocate`` (0 where it is refused)."""
        # Note: [No reservation in memory]
        # ``fallocate`` on tmpfs allocates and zeroes every page of the range, and the truncation that
        # gives an idle file's space back frees them again: 256 MiB took 0.8 s and 0.3 s here, per step,
        # for no gain (there is no extending write to avoid in memory). Such files grow with their writes.
        self._reserve = self._reservable = not self.in_memory and not memory_backed(self.directory)
        self._release_when_idle = False
        self._lock = threading.Lock()
        with _open_spills_lock:
            _open_spills.add(self)

    @property
    def closed(self) -> bool:
        return self.fd < 0

    def allocate(self, nbytes: int) -> int:
        """Reserve an aligned extent of at least ``nbytes``; returns its file offset."""
        with self._lock:
            self._release_when_idle = False
            offset = self._allocator.allocate(nbytes)
            self.size_bytes = max(self.size_bytes, self._allocator.end_bytes)
            if self.size_bytes > self.reserved_bytes and self._reserve:
                self._grow(max(self.size_bytes, self.reserved_bytes + max(SPILL_RESERVE_MIN_BYTES, self.reserved_bytes)))
            return offset

    def _grow(self, nbytes: int) -> None:
        # Note: [Reserve file space ahead of writes]
        # An O_DIRECT write past the end of the file extends it: ext4 then allocates blocks and
        # updates the size under the inode lock, one write at a time. Space reserved by fallocate
        # (unwritten extents, no bytes written) turns every later write into a plain overwrite.
        try:
            if nbytes - self.reserved_bytes > free_bytes(self.fd):  # Note [No reservation past the free space]
                raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (less free than the reservation)")
            reserve(self.fd, self.reserved_bytes, nbytes - self.reserved_bytes)
        except OSError as err:
            # Note: [A failed reservation keeps nothing]
            # ext4's fallocate, failing with ENOSPC, keeps the blocks it allocated before it ran out: a
            # 1 MiB extent took a nearly full disk's last 13 MiB, which other writers (another rank's spill
            # file, a checkpoint) then lacked. No extent lies past the reserved bytes, so they are cut off.
            with contextlib.suppress(OSError):
                os.ftruncate(self.fd, self.reserved_bytes)
            self._reserve = False
            # A full disk refuses for now: the file reserves again once idle (_truncate_locked); others for good.
            self._reservable = self._reservable and err.errno in FULL_DISK_ERRNOS
            logger.debug("tba: fallocate refused in %s (%s); the spill file grows with its writes", self.directory, err)
            return
        self.reserved_bytes = nbytes

    def free(self, offset: int) -> None:
        """Give back the extent at ``offset``; a no-op after :meth:`close`."""
        with self._lock:
            if self.fd >= 0:
                self._allocator.free(offset)
                if self._release_when_idle and not self._allocator.in_use:
                    self._truncate_locked()

    def short_of_space(self) -> bool:
        """Whether the file system is nearly full: less free than twice what this file holds, or than
        :data:`~tba.defaults.IDLE_SPACE_MIN_FREE_FRACTION` of its size."""
        with self._lock:
            if self.fd < 0:
                return False
            held_bytes = max(self.size_bytes, self.reserved_bytes)
            stat = os.fstatvfs(self.fd)
        free = stat.f_bavail * stat.f_frsize
        return free < max(2 * held_bytes, IDLE_SPACE_MIN_FREE_FRACTION * stat.f_blocks * stat.f_frsize)

    def release_space(self, *, when_idle: bool = False) -> bool:
        """Give the file's disk space back when no extent is in use (an idle file); True if it did.

        With ``when_idle``, a file that still has an extent in use (a storage the program holds after
        its context ended) gives its space back when that extent is freed, unless it is used again
        first.

        Note: [Idle spill files hold no disk space]
        A spill file kept open between contexts kept the blocks its writes and ``fallocate`` took, so
        a checkpoint to the same disk could fail with ENOSPC until the file was closed. Truncating it
        to zero returns them; the next context reserves space again as it writes. When that happens
        is the shared runtime's choice (Note [Idle space is kept for the next step] in
        ``tba/runtime/_shared.py``); a new file that finds the disk full asks for it at once
        (:func:`release_idle_space`).
        """
        with self._lock:
            if self.fd < 0 or not (self.size_bytes or self.reserved_bytes):
                return False
            if self._allocator.in_use:
                self._release_when_idle = self._release_when_idle or when_idle
                return False
            self._truncate_locked()
            return True

    def _truncate_locked(self) -> None:
        # Note: [The file is truncated last]
        # release_idle_space() runs in the caller's thread, where a signal handler's exception
        # (Ctrl-C) can land between two statements. Truncated first, a file interrupted before its
        # counters were reset kept counting its 256 MiB reservation: the next steps skipped
        # fallocate and grew the file with extending writes. Reset first, an interrupted file
        # holds space it no longer counts, which its next reservation and truncation take again.
        self._allocator = ExtentAllocator(ALIGN_BYTES)
        self.size_bytes = self.reserved_bytes = 0
        self._reserve = self._reservable
        self._release_when_idle = False
        os.ftruncate(self.fd, 0)

    def forget_after_fork(self) -> None:
        """In a forked child: close this process's copy of the descriptor; the parent's stays open."""
        self._lock = threading.Lock()
        self.close()

    def close(self) -> None:
        """Close the descriptor; the kernel frees the file's space. Idempotent."""
        with self._lock:
            fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)
