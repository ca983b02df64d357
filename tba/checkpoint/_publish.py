"""Staging directories and atomic publication of a checkpoint.

A save writes under a staging directory beside the checkpoint (``.<name>.tba-partial-m<machine>-<pid>-<id>``)
and publishes it with :func:`swap_into_place`: one ``rename`` when nothing is at the target, else
``renameat2(RENAME_EXCHANGE)``, which swaps the two directories in one atomic step, so the name
always holds a whole checkpoint. :func:`fsync_path` makes files and directory entries durable;
:func:`~tba.checkpoint._stale.remove_stale_partials` (``_stale.py``) removes staging directories of processes
that died mid-save (:func:`hold_staging` marks a live one).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import hashlib
import logging
import os
import re
import resource
import shutil
import socket

from tba.checkpoint._io import TbaCheckpointError, dangling_link
from tba.io import FULL_DISK_ERRNOS

logger = logging.getLogger("tba")

METADATA_NAME = ".metadata"
DATA_SUFFIX = ".distcp"
HELD_FDS: set[int] = set()
"""Descriptors holding the ``flock`` of this process's staging directories (:func:`hold_staging`)."""
ACTIVE_STAGING: set[str] = set()
"""Staging directories of saves in progress in this process (never removed as stale)."""
_PARTIAL = re.compile(r"\.(?P<name>.+)\.tba-partial-(?:m(?P<machine>[0-9a-f]{8})-)?(?P<pid>\d+)-[0-9a-f]+(\.old)?$")


def _machine_tag() -> str:
    """8 hex digits naming this kernel (its boot id; else the host name): pids mean something only there."""
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as stream:
            identity = stream.read().strip()
    except OSError:
        identity = socket.gethostname().encode()
    return hashlib.sha1(identity).hexdigest()[:8]


MACHINE = _machine_tag()
"""Part of every staging directory's name: partials of other machines are never judged by pid here."""


def staging_name(name: str, save_id: str) -> str:
    """The staging directory's name for a save of ``name``: ``.<name>.tba-partial-m<machine>-<pid>-<id>``."""
    return f".{name}.tba-partial-m{MACHINE}-{os.getpid()}-{save_id[:12]}"

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def checkpoint_error(err: OSError, what: str, directory: str) -> TbaCheckpointError:
    """A :class:`TbaCheckpointError` for ``err`` raised while doing ``what``, naming the fix."""
    link = dangling_link(directory) if err.errno in (errno.EEXIST, errno.ENOENT) else None
    if link is not None:  # a disk not mounted: makedirs said "File exists" (at the link) or "No such file" (below)
        return TbaCheckpointError(f"{what} in {directory} failed: {link} is a symbolic link to {os.path.realpath(link)}, "
                                  "which does not exist; create that (is its disk mounted?) or save to another directory")
    if err.errno in FULL_DISK_ERRNOS:
        fix = "free space there or save to another directory"
    elif err.errno == errno.EFBIG and (limit := resource.getrlimit(resource.RLIMIT_FSIZE)[0]) != resource.RLIM_INFINITY:
        # Note [A file-size limit is one cause] in tba/runtime/_release.py
        fix = f"this process may write files of at most {limit} bytes (ulimit -f): raise the limit (ulimit -f unlimited)"
    elif err.errno == errno.EFBIG:  # no ulimit -f: the file system's own largest file (FAT32's is 4 GiB)
        fix = "the file system there takes no file this large (FAT32's largest is 4 GiB): save to another file system"
    elif err.errno == errno.ENAMETOOLONG:  # the checkpoint's own name fits; its staging directory's is ~40 longer
        fix = "the staging directory tba makes beside the checkpoint adds about 40 characters to its name: choose a shorter name"
    elif err.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        fix = "save to a writable directory"
    else:
        fix = "check the directory and the disk"
    return TbaCheckpointError(f"{what} in {directory} failed: {err.strerror}; {fix}; any earlier "
                              "checkpoint is unchanged")


def is_checkpoint_dir(path: str) -> bool:
    """Whether ``path`` holds nothing but a checkpoint's files (so a save may replace it)."""
    return not _foreign_names(os.listdir(path))


def _foreign_names(names: list[str]) -> list[str]:
    """The ``names`` that are not a checkpoint's files (its metadata and data files), sorted."""
    return sorted(n for n in names if n != METADATA_NAME and not n.endswith(DATA_SUFFIX))


def hold_staging(staging: str) -> int:
    """Open ``staging`` and ``flock`` it for as long as the save runs; returns the fd to close when it has ended.

    Note: [Whose partial directory is dead]
    A save killed mid-write leaves its staging directory; the next save to the *same* name removed
    it, so per-step names (``ckpt/step100``, never saved again) kept theirs for ever (helper-41).
    Every save and load now removes the dead partial directories of *every* name in its directory,
    so "dead" must never be wrong: a directory is removed only when its owner's pid is gone (or is
    this process and the save is not in progress) *and* the ``flock`` its owner holds can be taken.
    The staging name carries a tag of the machine (its boot id), and partials of other machines
    are left to them; the lock protects a live save of another PID namespace on this machine,
    whose pid means nothing here, and a kernel frees it the moment its owner dies. Where the file system
    has no ``flock``, only partial directories of the name being saved are removed, by pid, as before.
    """
    fd = os.open(staging, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno not in (errno.EOPNOTSUPP, errno.ENOLCK, errno.EINVAL):
                raise
        held, named = os.fstat(fd), os.stat(staging)
        if (held.st_dev, held.st_ino) != (named.st_dev, named.st_ino):  # removed before it was locked
            raise OSError(errno.ENOENT, "the staging directory was removed by another process", staging)
    except BaseException:
        os.close(fd)
        raise
    HELD_FDS.add(fd)
    return fd


def release_staging(fd: int) -> None:
    """Close a descriptor from :func:`hold_staging` (one a forked child has closed already is left alone)."""
    if fd in HELD_FDS:
        HELD_FDS.discard(fd)
        os.close(fd)


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


def _foreign(path: str) -> list[str]:
    """What at ``path`` a save must not replace: names in the directory that are not a checkpoint's, or the file."""
    if os.path.islink(path) or not os.path.lexists(path):
        return []  # a link (a ``latest`` pointer) is replaced, never what it names
    if not os.path.isdir(path):
        return [os.path.basename(path)]
    return _foreign_names(os.listdir(path))


def _refuse(target: str, names: list[str]) -> TbaCheckpointError:
    """Note: [Files added to the path while a save runs]
    ``prepare_local_plan`` refuses a path holding anything but a checkpoint's files, but a lazy save
    publishes seconds after ``save()`` returned: a ``config.json`` written into the path meanwhile (as
    beside ``save_pretrained``'s weights) was in the directory the publication replaced, and was
    deleted with it (helper-153). :func:`swap_into_place` looks again before it publishes, and once
    more at what it moved aside (a file written between the look and the swap): the old directory is
    put back and the save fails, its files kept.
    """
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return TbaCheckpointError(f"{target} held {shown} when the save was about to publish, written there after it "
                              "started; tba never replaces other files, so this checkpoint was not published and "
                              "the directory is as it was; write such files after handle.wait(), or elsewhere")


def swap_into_place(staging: str, target: str, overwrite: bool = True) -> str | None:
    """Publish the directory ``staging`` as ``target`` atomically.

    When ``target`` does not exist this is one ``rename``. When it does, the two directories are
    exchanged with ``renameat2(RENAME_EXCHANGE)``, so that at every instant ``target`` names either
    the old checkpoint or the new one; the old one is then found at ``staging`` and the caller
    removes it. Where the file system has no exchange, the old one is first renamed aside (a
    window in which ``target`` is missing, logged once). A ``target`` holding other files is never
    replaced (Note [Files added to the path while a save runs]), nor, with ``overwrite`` False, a checkpoint
    another process published there since the save began.

    Returns:
        The path now holding the replaced checkpoint, or None when there was none.
    """
    parent = os.path.dirname(target)
    if names := _foreign(target):
        raise _refuse(target, names)
    if not os.path.lexists(target):
        try:
            os.rename(staging, target)
            fsync_path(parent)
            return None
        except OSError as err:  # another process published there since the look: exchange with it
            if err.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
    if not overwrite:
        raise TbaCheckpointError(f"a checkpoint was published at {target} by another save since this one began, and "
                                 "overwrite=False keeps it; this checkpoint was not published")
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
        try:
            if names := _foreign(aside):
                raise _refuse(target, names)
            os.rename(staging, target)
        except BaseException:
            with contextlib.suppress(OSError):  # the old checkpoint goes back: the save failed, nothing changed
                os.rename(aside, target)
            raise
    else:
        if names := _foreign(aside):
            _exchange(staging, target)  # the old directory goes back; the new checkpoint is at staging again
            raise _refuse(target, names)
    fsync_path(parent)
    return aside


def remove_replaced(path: str) -> None:
    """Remove what :func:`swap_into_place` moved aside: the old checkpoint, or a symlink that named it.

    A symlink at the target (a ``latest`` pointer to a checkpoint) is exchanged like a directory;
    ``shutil.rmtree`` refuses links and its error was ignored, so the link stayed behind under the
    staging name (helper-41). The link goes; the checkpoint it pointed to stays.
    """
    if os.path.islink(path):
        with contextlib.suppress(OSError):
            os.unlink(path)
    else:
        shutil.rmtree(path, ignore_errors=True)


def _forget_in_child() -> None:
    """A forked child has none of its parent's save threads: it owns none of their staging directories."""
    ACTIVE_STAGING.clear()
    for fd in HELD_FDS:  # the lock is the parent's: held here too, it kept a killed parent's partial "alive"
        with contextlib.suppress(OSError):
            os.close(fd)
    HELD_FDS.clear()


os.register_at_fork(after_in_child=_forget_in_child)
