"""I/O engines and backend selection.

``make_engine("auto")`` returns the best engine this machine supports: the native io_uring engine
when it was built and the kernel allows it, else the portable thread pool, logging once why the
better one was not used. Probes run once per process (``functools.cache``).
"""

from __future__ import annotations

import functools
import logging

from tba.engine.base import ALIGN_BYTES, Engine, Op, Request
from tba.engine.threads import ThreadEngine
from tba.errors import TbaConfigError

logger = logging.getLogger("tba")

MAX_THREADS = 8
"""More threads than this only add context switches: each one waits in the kernel for its request."""

BACKENDS = ("auto", "io_uring", "threads", "kvikio")
"""Names accepted by ``backend=``. An :class:`Engine` instance is accepted too. ``"kvikio"`` sends
CUDA storages through ``kvikio.CuFile`` and uses the ``"auto"`` host engine for everything else."""


@functools.cache
def io_uring_unavailable_reason() -> str | None:
    """Why the io_uring engine cannot be used here, or None when it can."""
    try:
        from tba.engine import io_uring
    except ImportError as err:
        return f"the io_uring engine is not importable ({err})"
    return io_uring.probe()


def available_backends() -> dict[str, str | None]:
    """Each concrete backend mapped to None when usable, else the reason it is not."""
    return {"io_uring": io_uring_unavailable_reason(), "threads": None}


@functools.cache
def _log_auto_fallback(reason: str) -> None:
    logger.info("tba: backend 'auto' uses threads: %s", reason)


def resolve_backend(backend: str) -> str:
    """Map a backend name to the concrete one that will run, raising a clear error if unusable."""
    if not isinstance(backend, str):
        raise TbaConfigError(f"backend must be a string or an Engine, got {type(backend).__name__}")
    if backend not in BACKENDS:
        raise TbaConfigError(
            f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)} "
            "or pass an Engine instance"
        )
    if backend == "auto":
        reason = io_uring_unavailable_reason()
        if reason is None:
            return "io_uring"
        _log_auto_fallback(reason)
        return "threads"
    if backend == "kvikio":
        from tba.routes import kvikio_unavailable_reason

        reason = kvikio_unavailable_reason()
        if reason is not None:
            raise TbaConfigError(f"backend 'kvikio' is not available: {reason}; use backend='auto'")
        return resolve_backend("auto")
    if backend == "io_uring":
        reason = io_uring_unavailable_reason()
        if reason is not None:
            raise TbaConfigError(
                f"backend 'io_uring' is not available: {reason}; use backend='threads' or 'auto'"
            )
    return backend


def make_engine(backend: str | Engine = "auto", *, queue_depth: int = 32) -> Engine:
    """Build the engine named by ``backend`` (or return an :class:`Engine` instance as is).

    Args:
        backend: ``"auto"``, ``"io_uring"``, ``"threads"`` or an engine instance.
        queue_depth: Requests in flight at once (ring entries, or threads for ``"threads"``,
            capped at :data:`MAX_THREADS`). Default 32.
    """
    if isinstance(backend, Engine):
        return backend
    if queue_depth < 1:
        raise TbaConfigError(f"queue_depth must be >= 1, got {queue_depth}")
    name = resolve_backend(backend)
    if name == "io_uring":
        from tba.engine.io_uring import IoUringEngine

        return IoUringEngine(queue_depth=queue_depth)
    return ThreadEngine(workers=min(queue_depth, MAX_THREADS))


__all__ = [
    "ALIGN_BYTES",
    "BACKENDS",
    "Engine",
    "Op",
    "Request",
    "ThreadEngine",
    "available_backends",
    "make_engine",
    "resolve_backend",
]
