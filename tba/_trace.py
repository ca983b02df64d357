"""NVTX ranges around tba's work, so that a profile (Nsight Systems) shows the overlap.

Ranges, in domain ``tba``: ``pack``, ``unpack``, ``write`` (queueing a storage's write), ``read``
(queueing a read), ``prefetch`` (moving the window), ``wait_read`` (backward blocked on a read).
They use the ``nvtx`` package when it is installed (``pip install 'tba-offload[nvtx]'``; it is a no-op
without a profiler attached) and cost nothing measurable otherwise.
"""

from __future__ import annotations

import contextlib
import functools
from contextlib import AbstractContextManager


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


def nvtx_range(name: str) -> AbstractContextManager[None]:
    """A context manager that marks ``name`` in the ``tba`` NVTX domain (or does nothing)."""
    annotate = _annotate()
    if annotate is None:
        return _NO_RANGE
    return annotate(name, domain="tba")
