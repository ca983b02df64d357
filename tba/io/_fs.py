"""Which file system holds a directory, and whether it lives in memory.

A spill file on ``tmpfs`` or ``ramfs`` (``/dev/shm``, often ``/tmp`` and ``/run``) keeps every
offloaded byte in RAM: it moves activations from one part of memory to another and saves nothing.
The type is read from ``/proc/self/mountinfo`` (the mount whose point is the longest prefix of the
directory's real path), so no extra dependency or ``statfs`` binding is needed. The same table names
the pseudo file systems (``/proc``, ``/sys``) whose refusal to create a file would otherwise read
as nonsense (:func:`file_creation_failure`).
"""

from __future__ import annotations

import os
import sys

MEMORY_FILE_SYSTEMS = frozenset({"tmpfs", "ramfs", "devtmpfs", "hugetlbfs"})
"""File system types whose files are held in memory."""

PSEUDO_FILE_SYSTEMS = frozenset({"proc", "sysfs", "cgroup", "cgroup2", "devpts", "debugfs", "tracefs", "securityfs",
                                 "configfs", "bpf", "pstore", "fusectl", "mqueue", "efivarfs", "binfmt_misc"})
"""File system types through which the kernel shows its own state; they hold no files of ours."""

MOUNTINFO = "/proc/self/mountinfo"


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash in paths as octal escapes (``\\040``)."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field


def filesystem_type(path: str | os.PathLike, mountinfo: str = MOUNTINFO) -> str | None:
    """The type (``ext4``, ``tmpfs``, ...) of the file system holding ``path``; None if unknown."""
    real = os.fsdecode(os.path.realpath(os.fspath(path)))
    best, best_type = "", None
    try:
        # Note: [A mount point need not be UTF-8]
        # Mount points are bytes: one not valid in UTF-8 anywhere on the machine (another user's
        # ``/tmp/r\xff``) made reading the table raise UnicodeDecodeError, and every offloader on any
        # directory failed to open. Decoded as Python decodes file names (surrogate escapes), each
        # line compares with the path's real name decoded the same way, bytes paths included.
        with open(mountinfo, encoding=sys.getfilesystemencoding(), errors="surrogateescape") as stream:
            lines = stream.read().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if "-" not in fields:
            continue
        mount_point = _unescape(fields[4])
        fs_type = fields[fields.index("-") + 1]
        inside = real == mount_point or real.startswith(mount_point.rstrip("/") + "/")
        if inside and len(mount_point) >= len(best):
            best, best_type = mount_point, fs_type
    return best_type


def memory_backed(path: str | os.PathLike) -> str | None:
    """The file system type when ``path`` is on one held in RAM (tmpfs, ramfs), else None."""
    fs_type = filesystem_type(path)
    return fs_type if fs_type in MEMORY_FILE_SYSTEMS else None


def file_creation_failure(directory: str, err: OSError, what: str = "a file") -> str:
    """What went wrong when ``what`` could not be created in ``directory`` (for a missing one, in its nearest
    existing parent): the try, the OS's error and, where it explains the error, the file system: ``/proc``
    answers "No such file or directory" for a directory that plainly exists, which said nothing true on its own."""
    while not os.path.isdir(directory) and os.path.dirname(directory) != directory:
        directory = os.path.dirname(directory)
    why = f"creating {what} in {directory} failed ({err.strerror or err})"
    fs_type = filesystem_type(directory)
    if fs_type in PSEUDO_FILE_SYSTEMS:
        why += f": it is on {fs_type}, a kernel pseudo file system that holds no files"
    return why
