"""The lazy saves of this process that have not ended yet, by the path they publish at.

A load of a path waits for them (Note [A load waits for the saves to its path]), and a save waits
for those to its path started before it (Note [Lazy saves to one path publish in call order]).
``tba/checkpoint/_lazy.py`` registers each save, and its handle (``_handle.py``) ends it.
"""

from __future__ import annotations

import logging
import os
import threading

logger = logging.getLogger("tba")

# Note: [A load waits for the saves to its path]
# A lazy save returns before its checkpoint is published; a load of the same path in the same
# process meanwhile read the checkpoint before it, with no word (helper-36). Each lazy save is
# registered here under its path until it has published or failed, and a reader of that path
# waits for it first. Saves of other processes publish atomically (swap_into_place): a reader
# gets the old checkpoint or the new one, whole.
_saves_lock = threading.Lock()
_saves: dict[str, list[threading.Event]] = {}


def _forget_in_child() -> None:
    """A forked child has none of its parent's save threads: it waits for none of their saves (helper-41: its load
    of a path the parent was saving to waited for ever)."""
    global _saves_lock
    _saves_lock = threading.Lock()
    _saves.clear()


os.register_at_fork(after_in_child=_forget_in_child)


def canonical(path: str | os.PathLike) -> str:
    """``path`` with every link above its last name resolved: the name a save publishes at.

    Note: [One checkpoint, many spellings of its path]
    Saves were registered, and loads waited, under ``os.path.abspath`` of the path they were given: a
    load through a linked parent (``/scratch`` -> ``/mnt/nvme``) or a ``latest`` link to the checkpoint
    of a lazy save still running read the checkpoint before it, silently, and two checkpointers given
    two spellings published in any order (helper-153). A save is registered under its parent's
    real path and its own last name (a save to a link replaces the link, never what it names); a load
    waits for the saves of both that name and the one its path resolves to.
    """
    parent, name = os.path.split(os.path.abspath(path))
    return os.path.join(os.path.realpath(parent), name)


def begin_save(path: str, done: threading.Event) -> None:
    """Register a lazy save to ``path`` that sets ``done`` once published or failed."""
    with _saves_lock:
        _saves.setdefault(canonical(path), []).append(done)


def _pending_with(done: threading.Event) -> tuple[str | None, list[threading.Event]]:
    """The key and list of the saves registered with ``done``; call with ``_saves_lock`` held."""
    return next(((key, pending) for key, pending in _saves.items() if done in pending), (None, []))


def end_save(done: threading.Event) -> None:
    """The save registered with ``done`` has ended (found by ``done``: the links in its path may have changed)."""
    with _saves_lock:
        key, pending = _pending_with(done)
        if key is not None:
            pending.remove(done)
            if not pending:
                _saves.pop(key, None)


def wait_for_earlier_saves(done: threading.Event) -> None:
    """Wait for the lazy saves to the path of the one that sets ``done`` registered before it.

    Note: [Lazy saves to one path publish in call order]
    Two checkpointers saving to one path ran side by side, and whichever finished last was
    published: the earlier call's state could replace the later one's after the later handle's
    ``wait()`` had returned, silently (helper-41). A save publishes only once the saves to its path
    registered before it have ended, so the path ends with the state of the last ``save`` call.
    """
    with _saves_lock:
        _, pending = _pending_with(done)
        earlier = pending[: pending.index(done)] if done in pending else []
    for event in earlier:
        event.wait()


def wait_for_saves(path: str | os.PathLike) -> None:
    """Wait until every lazy save of this process to ``path`` has ended (Note [A load waits for the saves to its
    path], Note [One checkpoint, many spellings of its path])."""
    names = {canonical(path), canonical(os.path.realpath(path))}
    with _saves_lock:
        pending = [done for name in names for done in _saves.get(name, [])]
    if pending:
        logger.info("tba: reading %s waits for the lazy save to it to finish", path)
    for done in pending:
        done.wait()
