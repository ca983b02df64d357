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
from typing import Any

from tba._weak import WeakRegistry

logger = logging.getLogger("tba")

_live = WeakRegistry()
"""Live offloaders (:mod:`tba._weak`: no Python code runs when one dies)."""


def track(offloader: Any) -> None:
    """Remember ``offloader`` (weakly) so that a forked child can detach it from the parent's file."""
    _live.add(offloader)


def _after_fork_in_child() -> None:
    for offloader in _live.alive():
        offloader._after_fork_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)
