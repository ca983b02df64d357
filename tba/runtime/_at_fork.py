"""What a forked child does with the offloaders it inherited from its parent.

After ``fork()`` the child holds copies of every descriptor of the parent: the same spill file
(one inode, one file description) and, for the io_uring engine, the same ring. Its copy of each
offloader also believes it owns the same extents of that file. Were the child to go on offloading
through them, parent and child would write one inode at the same offsets and read each other's
bytes: wrong gradients, silently. The threads of the parent's engines do not exist in the child,
and locks they held at the instant of the fork stay held forever.

So :func:`os.register_at_fork` runs :func:`_after_fork_in_child` in every child: each live
:class:`tba.Offloader` drops (without any I/O) the file, engine and entries it inherited. Its next
entry opens a file and engine of the child's own. A tensor saved before the fork cannot be read
back in the child and raises :class:`tba.TbaError` when backward asks for it; the parent is not
affected in any way. A fork inside a ``with`` block leaves the child inside a block whose file is
the parent's: every save there raises :class:`tba.TbaError` until the child leaves the block.
"""

from __future__ import annotations

import logging
import os
import weakref
from typing import Any

logger = logging.getLogger("tba")

_live: dict[int, weakref.ref] = {}
"""Offloaders by identity. Plain weak references, without callbacks: a ``WeakSet`` runs Python code
when an offloader dies, where an asynchronous exception would be swallowed (Note [Asynchronous
exceptions] in ``tba/_control.py``); dead ones are pruned on the next :func:`track`."""


def track(offloader: Any) -> None:
    """Remember ``offloader`` (weakly) so that a forked child can detach it from the parent's file."""
    for key, ref in list(_live.items()):
        if ref() is None:
            del _live[key]
    _live[id(offloader)] = weakref.ref(offloader)


def _after_fork_in_child() -> None:
    for ref in list(_live.values()):
        offloader = ref()
        if offloader is not None:
            offloader._after_fork_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)
