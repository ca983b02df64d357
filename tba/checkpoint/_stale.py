"""Staging directories of saves that died, found and removed by the next save or load in their directory.

A save's staging directory (``tba/checkpoint/_publish.py`` names it, holds its ``flock`` and publishes it)
outlives a process killed mid-save; :func:`remove_stale_partials` removes it once it is sure the save is
dead (Note [Whose partial directory is dead] in ``tba/checkpoint/_publish.py``), and puts back a checkpoint
that such a save had moved aside (Note [A checkpoint moved aside by a killed save is put back]).
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import shutil

from tba.checkpoint._publish import _PARTIAL, ACTIVE_STAGING, MACHINE, fsync_path, remove_replaced

logger = logging.getLogger("tba")


def _pid_gone(parent: str, entry: str, pid: int) -> bool:
    if pid == os.getpid():
        return os.path.join(parent, entry.removesuffix(".old")) not in ACTIVE_STAGING
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def _lock_free(path: str) -> bool | None:
    """Whether nobody holds ``path``'s flock (True), somebody does (False), or it cannot be told (None)."""
    if os.path.islink(path):
        return True  # a staging directory is never a link: a replaced symlink, owned by the pid alone
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError:
        return None
    finally:
        os.close(fd)


def remove_stale_partials(parent: str, name: str | None = None) -> None:
    """Remove the staging directories in ``parent`` whose save died (Note [Whose partial directory is dead]).

    ``name``: the checkpoint being saved, whose dead partials go even where ``flock`` is unsupported.
    """
    try:
        entries = os.listdir(parent)
    except OSError:
        return
    for entry in entries:
        match = _PARTIAL.match(entry)
        if not match or match.group("machine") not in (None, MACHINE):
            continue  # another machine's save: its pid means nothing here
        if not _pid_gone(parent, entry, int(match.group("pid"))):
            continue
        path = os.path.join(parent, entry)
        free = _lock_free(path)
        if free is False or (free is None and match.group("name") != name):
            continue
        if entry.endswith(".old") and _lock_free(path.removesuffix(".old")) is False:
            continue  # Note [A checkpoint moved aside by a killed save is put back]: its save is alive
        if entry.endswith(".old") and _put_back(parent, match.group("name"), path):
            continue
        logger.info("tba: removing %s left by a save that did not finish", entry)
        remove_replaced(path)


def _put_back(parent: str, name: str, path: str) -> bool:
    """Rename ``path``, a checkpoint a dead save moved aside, back to ``name`` if nothing is there; True if it did.

    Note: [A checkpoint moved aside by a killed save is put back]
    Where the file system cannot exchange two directories (NFS, many FUSE file systems), a save
    publishes in two renames: the old checkpoint to ``<staging>.old``, then the staging directory to
    the name (:func:`~tba.checkpoint._publish.swap_into_place`). A save killed between the two left
    the name empty, and the next save or load in the directory removed both as a dead save's partials:
    the last checkpoint was gone, the load said there was none. The old checkpoint goes back under its
    name instead, as if the save had been killed a moment earlier. The ``.old`` directory holds no lock
    (the save locks its staging directory): a live save of another PID namespace on this machine (its pid
    gone here, the boot id the same) between its two renames had its old checkpoint put back under the
    name, and its own second rename then failed (the name taken). So a ``.old`` whose staging directory is
    still locked is left to its save.
    """
    target = os.path.join(parent, name)
    if os.path.lexists(target):
        return False
    try:
        os.rename(path, target)
        fsync_path(parent)
    except OSError:
        return False
    logger.warning("tba: %s was moved aside by a save killed before it published the new one; put back", target)
    return True


_WARM_UP = re.compile(r"\.tba-warm-up-m(?P<machine>[0-9a-f]{8})-(?P<pid>\d+)-")


def warm_up_prefix() -> str:
    """The prefix of this process's warm-up directory (Note [A warm-up killed mid-way is removed by the next])."""
    return f".tba-warm-up-m{MACHINE}-{os.getpid()}-"


def remove_dead_warm_ups(parent: str) -> None:
    """Remove the warm-up directories in ``parent`` that processes killed during their first lazy save left.

    Note: [A warm-up killed mid-way is removed by the next]
    The first lazy save of a process takes a tiny checkpoint in a temporary directory first (Note [Fork while the
    save thread runs] in ``tba/checkpoint/_lazy.py``); a process killed meanwhile left ``.tba-warm-up-*`` in
    ``/tmp`` (or in the checkpoint's parent) for good (helper-116). Each warm-up now holds its directory's
    ``flock``, and removes, where it is about to make its own, those of this machine whose pid is gone and whose
    lock is free, the rule of the staging directories (Note [Whose partial directory is dead] in
    ``tba/checkpoint/_publish.py``): a live warm-up of another PID namespace keeps its lock.
    """
    try:
        entries = os.listdir(parent)
    except OSError:
        return
    for entry in entries:
        match = _WARM_UP.match(entry)
        if not match or match.group("machine") != MACHINE or int(match.group("pid")) == os.getpid():
            continue
        path = os.path.join(parent, entry)
        if _pid_gone(parent, entry, int(match.group("pid"))) and _lock_free(path) is True and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
