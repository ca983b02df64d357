"""The offload directory, and files in it that nobody else can open.

Each offload context opens its spill file (``tba/io/_spill.py``) in its directory and never gives
it a name that anyone else could open:

* ``O_TMPFILE`` creates an inode with no directory entry. Nothing appears in the directory, and
  the kernel frees the space when the last descriptor closes, including when the process is killed.
* Where the file system refuses ``O_TMPFILE``, a uniquely named file is created with ``O_EXCL``
  and unlinked immediately after ``open``, which gives the same guarantees after that instant.

Two processes, ranks or contexts sharing a directory therefore never see each other's data: each
has its own inode.

``O_DIRECT`` is used when the file system supports it (bypassing the page cache, so offloaded
bytes leave host memory as well); :func:`probe_direct_io` tries it with a real aligned write and
read, since some file systems accept the flag at ``open`` and fail later. The directory is
resolved (``directory=``, ``$TBA_DIR``, the temp directory), created and checked here, and what is
wrong with it (buffered I/O, a file system held in RAM) is logged once per process and directory.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import resource
import tempfile
import uuid

from tba._fork_lock import ForkSafeLock
from tba.defaults import ALIGN_BYTES
from tba.errors import TbaConfigError, TbaError
from tba.io._fs import file_creation_failure, memory_backed
from tba.io._memory import aligned_empty, memory_view

logger = logging.getLogger("tba")

_NO_TMPFILE_ERRNOS = (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL, errno.ENOENT)

OUT_OF_DESCRIPTORS_ERRNOS = (errno.EMFILE, errno.ENFILE)
"""The process (``EMFILE``) or the system (``ENFILE``) has no file descriptor left: says nothing about the disk or the kernel."""


class OutOfDescriptorsError(TbaError):
    """The process has no file descriptor left for a spill file or a ring (``EMFILE``/``ENFILE``)."""


def out_of_descriptors(what: str, err: BaseException) -> OutOfDescriptorsError:
    """The error for ``what`` (``"a spill file"``) failing to open for want of a descriptor, naming the fix."""
    reason = getattr(err, "strerror", None) or os.strerror(errno.EMFILE)
    return OutOfDescriptorsError(
        f"cannot open {what}: {reason} (this process may open {resource.getrlimit(resource.RLIMIT_NOFILE)[0]} "
        "descriptors); close files or offloaders you no longer use (a one-shot context keeps its file until autograd frees "
        "its graph: a loss in a reference cycle, with the cycle collector off, until gc.collect()), call tba.shutdown(), "
        "or raise the limit (ulimit -n)")


def lacks_descriptors(err: BaseException) -> bool:
    """Whether ``err`` comes from the lack of a descriptor: an ``OSError``'s errno, or an import's (``dlopen``) message."""
    if isinstance(err, OSError):
        return err.errno in OUT_OF_DESCRIPTORS_ERRNOS
    return isinstance(err, ImportError) and any(os.strerror(code) in str(err) for code in OUT_OF_DESCRIPTORS_ERRNOS)


def resolve_directory(directory: str | os.PathLike | None) -> str:
    """The directory to use: ``directory``, else ``$TBA_DIR``, else the system temp directory."""
    if directory is None:
        directory = os.environ.get("TBA_DIR") or tempfile.gettempdir()
    return os.path.abspath(os.fspath(directory))


def open_anonymous(directory: str, *, direct: bool) -> int:
    """Open a read-write file in ``directory`` that has no name; returns its descriptor.

    Raises:
        OSError: the directory cannot hold a file (permissions, missing, read-only).
    """
    flags = os.O_RDWR | os.O_CLOEXEC | (os.O_DIRECT if direct else 0)
    try:
        return os.open(directory, flags | os.O_TMPFILE, 0o600)
    except OSError as err:
        if err.errno not in _NO_TMPFILE_ERRNOS or not os.path.isdir(directory):
            raise
    path = os.path.join(directory, f".tba-{os.getpid()}-{uuid.uuid4().hex}")
    # Note: [A failed open can leave its name]
    # ``open(O_CREAT | O_DIRECT)`` on a file system without O_DIRECT (ramfs) creates the inode and
    # then fails the open with EINVAL, so the name exists although no descriptor does: remove it.
    try:
        fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        raise
    try:
        os.unlink(path)
    except BaseException:  # EBUSY (CIFS may refuse to remove an open file): neither the descriptor nor the name stays
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise
    return fd


def _direct_round_trip(fd: int) -> None:
    buf = aligned_empty(2 * ALIGN_BYTES)
    buf[:ALIGN_BYTES].fill_(0x5A)
    view = memory_view(buf.data_ptr(), 2 * ALIGN_BYTES)
    if os.pwrite(fd, view[:ALIGN_BYTES], 0) != ALIGN_BYTES:
        raise OSError(errno.EIO, "short O_DIRECT probe write")
    if os.preadv(fd, [view[ALIGN_BYTES:]], 0) != ALIGN_BYTES or not bool((buf[ALIGN_BYTES:] == 0x5A).all()):
        raise OSError(errno.EIO, "O_DIRECT probe read back different bytes")


FULL_DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
"""The disk (or the user's quota) is full now: a probe failing so says nothing about ``O_DIRECT``, nor a reservation
refused so that the file system refuses reservations."""


def memory_file(directory: str, err: OSError) -> int:
    """A file in memory in place of a spill file that ``directory``'s disk had no room to create.

    Note: [A disk too full for the spill file spills into memory]
    A full disk makes each write fail, and the store keeps that storage in memory with one warning. But on a file
    system out of inodes (or XFS or btrfs out of metadata space) the spill file itself cannot be made, and entering
    the offloader raised a TbaConfigError: training stopped on a full disk where it otherwise goes on. The file is
    made in memory then (``memfd_create``), with one warning: training goes on exact, and saves no memory, for as
    long as this file lives: a reusable offloader's, until it is closed; a one-shot context's, until it ends (Note [A
    spill file in memory is not kept idle] in ``tba/runtime/_shared.py``).
    """
    fd = os.memfd_create("tba-spill", os.MFD_CLOEXEC)
    with _WARNED_FULL_LOCK:
        first = directory not in _WARNED_FULL
        _WARNED_FULL.add(directory)
    (logger.warning if first else logger.debug)(
        "tba: cannot create the spill file in %s (%s): offloaded activations go to a file in memory instead, which "
        "saves no memory, until this context ends (a reusable Offloader: until it is closed); free space there or pass "
        "directory= (or set TBA_DIR) to another disk", directory, err.strerror)
    return fd


_WARNED_FULL: set[str] = set()
"""Directories whose spill file was made in memory, warned about once each."""
_WARNED_FULL_LOCK = ForkSafeLock()


def probe_direct_io(directory: str) -> str | None:
    """None when ``O_DIRECT`` reads and writes work in ``directory`` (or cannot be told from a full disk),
    else the reason they do not.

    Note: [A full disk says nothing about O_DIRECT]
    The probe writes one aligned block. On a full file system (or one another process fills at that
    moment) that write fails with ``ENOSPC``, whatever the I/O mode: buffered writes would fail too.
    Taken as "no O_DIRECT", it made tba warn that it fell back to the page cache, blame the file
    system, and run the whole process on buffered I/O (activations back in memory, through the page
    cache) once space came back. So a full disk counts as O_DIRECT working: the spill file's own
    writes then fail, and the store keeps those tensors in memory with its one disk-full warning.
    """
    try:
        fd = open_anonymous(directory, direct=True)
    except OSError as err:
        if err.errno in OUT_OF_DESCRIPTORS_ERRNOS:
            # Note: [No descriptor says nothing about O_DIRECT]
            # Taken as "no O_DIRECT", a process at its descriptor limit warned (once per directory) that
            # the file system lacked O_DIRECT, and with direct_io=True raised a TbaConfigError telling to
            # move to ext4 or xfs (and, not being OutOfDescriptorsError, the shared runtimes' retry after
            # closing idle ones never ran). The spill file's own open then reports the lack of descriptors.
            return None
        if err.errno in FULL_DISK_ERRNOS:
            return None  # no inode or block left for the file itself: the spill file's own open says so
        return f"opening a file with O_DIRECT in {directory} failed: {err.strerror}"
    try:
        _direct_round_trip(fd)
    except OSError as err:
        if err.errno in FULL_DISK_ERRNOS:
            logger.debug("tba: the O_DIRECT probe in %s found the disk full (%s); assuming O_DIRECT works", directory,
                         err.strerror)
            return None
        if err.errno in (errno.EFBIG, errno.EINVAL) and _file_size_limit_below(2 * ALIGN_BYTES):
            # Note: [A file-size limit says nothing about O_DIRECT]
            # Under ``ulimit -f`` below one block the probe's aligned write is cut at the limit and O_DIRECT refuses
            # the unaligned rest (EINVAL; EFBIG at a limit of 0): tba warned that the file system lacked O_DIRECT, and
            # with direct_io=True raised a TbaConfigError telling to move to ext4 or xfs (helper-161). The limit is
            # the cause, in any directory: the spill file's own writes fail on it, and their warning names it.
            logger.debug("tba: the O_DIRECT probe in %s met the process's file-size limit (%s); assuming O_DIRECT "
                         "works", directory, err.strerror)
            return None
        return f"O_DIRECT I/O in {directory} failed: {err.strerror or err}"
    finally:
        os.close(fd)
    return None


def _file_size_limit_below(nbytes: int) -> bool:
    soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    return soft != resource.RLIM_INFINITY and soft < nbytes


def check_writable(directory: str) -> None:
    """Raise :class:`TbaConfigError` when the existing ``directory`` cannot be written."""
    if os.path.isdir(directory) and not os.access(directory, os.W_OK | os.X_OK):
        raise TbaConfigError(
            f"offload directory {directory} is not writable; pass directory= (or set TBA_DIR) "
            "to a writable directory on a fast local disk"
        )


def prepare_directory(directory: str) -> None:
    """Create ``directory`` (and its parents) if it is missing, saying so at DEBUG; raise :class:`TbaConfigError`
    when that fails or it is a file. The command line refuses a missing one instead (Note [The command line
    refuses a missing directory] in ``tba/cli/_checks.py``)."""
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise TbaConfigError(
            f"offload directory {directory} exists but is not a directory; pass directory= "
            "(or set TBA_DIR) to a directory"
        )
    missing = not os.path.exists(directory)
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as err:
        link = dangling_link(directory)
        reason = file_creation_failure(os.path.dirname(os.path.abspath(directory)), err, "a directory")
        fix = "pass directory= (or set TBA_DIR) to a writable directory on a fast local disk"
        if link is not None:
            reason = f"{link} is a symbolic link to {os.path.realpath(link)}, which does not exist"
            fix = f"create that (is its disk mounted?) or {fix}"
        raise TbaConfigError(f"cannot create the offload directory {directory}: {reason}; {fix}") from err
    if missing:
        logger.debug("tba: created the offload directory %s, which did not exist", directory)


def dangling_link(directory: str) -> str | None:
    """The first name on the way to ``directory`` that is a symbolic link to nothing (a disk not mounted), if any:
    ``makedirs`` then fails with "File exists" (at the link) or "No such file or directory" (below it)."""
    path = os.sep
    for part in directory.split(os.sep):
        path = os.path.join(path, part)
        if os.path.islink(path) and not os.path.exists(path):
            return path
    return None


_warned: set[tuple[int, str, str]] = set()
_warned_lock = ForkSafeLock()


def _warn_once(kind: str, directory: str, message: str, *args: object) -> None:
    """Log ``message`` at WARNING once per process, directory and ``kind`` (not once per context); the record's
    ``tba_notice`` attribute is ``kind``, which a handler or filter may select on."""
    key = (os.getpid(), directory, kind)
    with _warned_lock:
        if key in _warned:
            return
        _warned.add(key)
    logger.warning(message, *args, extra={"tba_notice": kind})


def warn_buffered_once(directory: str, reason: str) -> None:
    _warn_once("buffered", directory, "tba: using buffered I/O (page cache) instead of O_DIRECT: %s", reason)


def warn_if_memory_backed(directory: str) -> None:
    """Warn once when ``directory`` is on a file system held in RAM: offloading there saves nothing."""
    fs_type = memory_backed(directory)
    if fs_type is not None:
        _warn_once("memory-backed", directory, "tba: the offload directory %s is on %s, which keeps its files in RAM, so "
                   "offloading saves no memory; pass directory= (or set TBA_DIR) to a directory on a disk", directory,
                   fs_type)
