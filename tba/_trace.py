"""NVTX ranges around tba's work, so that a profile (Nsight Systems) shows the overlap.

Ranges, in domain ``tba``: ``pack``, ``unpack``, ``write`` (queueing a storage's write), ``read``
(queueing a read), ``prefetch`` (moving the window), ``wait_read`` (backward blocked on a read).
They use the ``nvtx`` package when it is installed (``pip install 'tba-offload[nvtx]'``; it is a no-op
without a profiler attached) and cost nothing measurable otherwise.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, TypeVar

T = TypeVar("T")


@functools.cache
def _annotate():
    try:
        import nvtx
    except ImportError:
        return None
    return nvtx.annotate


_NO_RANGE = contextlib.nullcontext()
"""What :func:`nvtx_range` returns without ``nvtx``: one reusable no-op, not a fresh object per saved tensor."""


def nvtx_enabled() -> bool:
    """Whether ``nvtx`` is installed: the hooks, called per saved tensor, skip even the no-op range without it."""
    return _annotate() is not None


def traced(name: str, function: Callable[..., T], *args: Any) -> T:
    """``function(*args)``, inside the range ``name`` where ``nvtx`` is installed.

    Note: [No range without nvtx]
    The hooks and the store's queueing of each write and read run once per saved storage. Without
    ``nvtx``, ``with nvtx_range(...)`` cost three Python calls there (:func:`nvtx_range` and the no-op's
    ``__enter__`` and ``__exit__``, ``contextlib.nullcontext``'s); this costs one, the same as asking
    :func:`nvtx_enabled` first (docs/host-cost.md, twenty-ninth pass). The pack hook and a host storage's write
    ask ``_trace._annotate()`` themselves (a C call, the cache's) and call no Python for the range at all without
    ``nvtx`` (thirty-second pass; read through the module, so that a test's stand-in is seen).
    ``tests/runtime/test_nvtx_ranges.py`` runs the branch taken with ``nvtx`` installed.
    """
    annotate = _annotate()
    if annotate is None:
        return function(*args)
    with annotate(name, domain="tba"):
        return function(*args)


def nvtx_range(name: str) -> AbstractContextManager[None]:
    """A context manager that marks ``name`` in the ``tba`` NVTX domain (or does nothing)."""
    annotate = _annotate()
    if annotate is None:
        return _NO_RANGE
    return annotate(name, domain="tba")
