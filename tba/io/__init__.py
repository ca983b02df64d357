"""File and engine I/O: asynchronous block transfers between memory and an unnamed spill file.

The engine interface is in ``_engine.py`` (requests in, futures out), with two engines: the native
io_uring engine (``_io_uring.py`` over ``native/``) and the portable thread pool (``_threads.py``).
``_spill.py`` opens the spill file (no name, ``O_DIRECT`` when the file system takes it) and
``_extents.py`` hands out aligned ranges of it; ``_memory.py`` makes aligned host memory and
``_read_pool.py`` reuses it for reads; ``_bandwidth.py`` is the disk-bandwidth probe.

``make_engine("auto")`` returns the best engine this machine supports: the native io_uring engine
when it was built and the kernel allows it, else the portable thread pool, logging once why the
better one was not used. Probes run once per process (``functools.cache``).
"""

from __future__ import annotations

import functools
import logging

from tba.defaults import BACKENDS, MAX_ENGINE_THREADS, QUEUE_DEPTH
from tba.errors import TbaConfigError
from tba.io._engine import Engine, Op, Request
from tba.io._threads import ThreadEngine

logger = logging.getLogger("tba")

ENGINE_BACKENDS = ("auto", "io_uring", "threads")
"""Engine names; ``backend="kvikio"`` names a device route (``tba.device``), whose host engine is ``"auto"``."""


@functools.cache
def io_uring_unavailable_reason() -> str | None:
    """Why the io_uring engine cannot be used here, or None when it can."""
    try:
        from tba.io import _io_uring
    except ImportError as err:
        return f"the io_uring engine is not importable ({err})"
    return _io_uring.probe()


def available_backends() -> dict[str, str | None]:
    """Each concrete backend mapped to None when usable, else the reason it is not."""
    return {"io_uring": io_uring_unavailable_reason(), "threads": None}


@functools.cache
def _log_auto_fallback(reason: str) -> None:
    logger.info("tba: backend 'auto' uses threads: %s", reason)


def resolve_backend(backend: str) -> str:
    """Map an engine backend name to the concrete engine that will run, raising a clear error if unusable."""
    if not isinstance(backend, str):
        raise TbaConfigError(f"backend must be a string or an Engine, got {type(backend).__name__}")
    if backend not in ENGINE_BACKENDS:
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
    if backend == "io_uring":
        reason = io_uring_unavailable_reason()
        if reason is not None:
            raise TbaConfigError(
                f"backend 'io_uring' is not available: {reason}; use backend='threads' or 'auto'"
            )
    return backend


def make_engine(backend: str | Engine = "auto", *, queue_depth: int = QUEUE_DEPTH) -> Engine:
    """Build the engine named by ``backend`` (or return an :class:`Engine` instance as is).

    Args:
        backend: ``"auto"``, ``"io_uring"``, ``"threads"`` or an engine instance.
        queue_depth: Requests in flight at once (ring entries, or threads for ``"threads"``,
            capped at :data:`tba.defaults.MAX_ENGINE_THREADS`). Default :data:`tba.defaults.QUEUE_DEPTH`.
    """
    if isinstance(backend, Engine):
        return backend
    if queue_depth < 1:
        raise TbaConfigError(f"queue_depth must be >= 1, got {queue_depth}")
    name = resolve_backend(backend)
    if name == "io_uring":
        from tba.io._io_uring import IoUringEngine

        return IoUringEngine(queue_depth=queue_depth)
    return ThreadEngine(workers=min(queue_depth, MAX_ENGINE_THREADS))


__all__ = [
    "BACKENDS",
    "ENGINE_BACKENDS",
    "Engine",
    "Op",
    "Request",
    "ThreadEngine",
    "available_backends",
    "make_engine",
    "resolve_backend",
]
