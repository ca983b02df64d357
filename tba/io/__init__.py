"""File and engine I/O: asynchronous block transfers between memory and an unnamed spill file.

The engine interface is in ``_engine.py`` (requests in, futures out), with two engines: the native
io_uring engine (``_io_uring.py`` over ``native/``) and the portable thread pool (``_threads.py``).
``_directory.py`` opens files with no name in the offload directory (``O_DIRECT`` when the file
system takes it), ``_spill.py`` makes the spill file of one and holds its disk space, and
``_extents.py`` hands out aligned ranges of it; ``_memory.py`` makes aligned host memory and
``_read_pool.py`` reuses it for reads; ``_bandwidth.py`` is the disk-bandwidth probe.

Engines are registered by name (:func:`register_engine`: the one list of backends).
``make_engine("auto")`` returns the best engine this machine supports: the native io_uring engine
when it was built and the kernel allows it, else the portable thread pool, logging once why the
better one was not used. Probes run once per process (``functools.cache``).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import numbers
from collections.abc import Callable

from tba.defaults import MAX_ENGINE_THREADS, MAX_QUEUE_DEPTH, QUEUE_DEPTH
from tba.errors import TbaConfigError, did_you_mean
from tba.io._bandwidth import directory_bandwidth, filled_buffer, open_scratch, timed_pass
from tba.io._checksum import checksum, load_crc32c
from tba.io._directory import (
    FULL_DISK_ERRNOS,
    OutOfDescriptorsError,
    dangling_link,
    lacks_descriptors,
    out_of_descriptors,
    probe_direct_io,
    resolve_directory,
)
from tba.io._engine import Engine, Op, Request
from tba.io._fs import file_creation_failure, filesystem_type, memory_backed
from tba.io._memory import aligned_empty, host_buffer, memory_view, round_up, storage_view
from tba.io._read_pool import BufferPool
from tba.io._spill import SpillFile, create_preallocated, release_idle_space
from tba.io._threads import ThreadEngine

logger = logging.getLogger("tba")

EngineFactory = Callable[[int], Engine]
"""Builds an engine for a queue depth."""


@dataclasses.dataclass(frozen=True)
class _Registered:
    factory: EngineFactory
    unavailable_reason: Callable[[], str | None]


_ENGINES: dict[str, _Registered] = {}


def register_engine(name: str, factory: EngineFactory, unavailable_reason: Callable[[], str | None] = lambda: None,
                    ) -> None:
    """Make ``backend=name`` build ``factory(queue_depth)``; ``unavailable_reason()`` says why it cannot run here.

    The one list of engine backends: ``backend_names()``, ``available_backends()``, ``doctor`` and the
    parametrized engine tests all read it. ``"auto"`` and ``"kvikio"`` (a device route) are not engines.
    """
    if not isinstance(name, str) or not name:  # an int name broke every later unknown-backend message
        raise TbaConfigError(f"register_engine takes the engine's name as a non-empty str, such as 'spdk'; got "
                             f"{type(name).__name__} {name!r}")
    if name in ("auto", "kvikio"):
        raise TbaConfigError(f"cannot register an engine named {name!r}")
    if not callable(factory) or not callable(unavailable_reason):
        raise TbaConfigError(f"register_engine({name!r}, ...) takes a factory called as factory(queue_depth) and "
                             f"returning an engine, and a callable unavailable_reason; got {type(factory).__name__} "
                             f"{factory!r} and {type(unavailable_reason).__name__}")
    _ENGINES[name] = _Registered(factory, unavailable_reason)


def engine_names() -> tuple[str, ...]:
    """The registered engines, in registration order (``io_uring``, ``threads``, then any added)."""
    return tuple(_ENGINES)


def backend_names() -> tuple[str, ...]:
    """Every name ``backend=`` accepts: ``auto``, each registered engine, and ``kvikio`` (CUDA route)."""
    return ("auto", *engine_names(), "kvikio")


@functools.cache
def io_uring_unavailable_reason() -> str | None:
    """Why the io_uring engine cannot be used here, or None when it can."""
    try:
        from tba.io import _io_uring
    except (ImportError, OSError) as err:  # OSError: reading the module's source or bytecode failed
        if lacks_descriptors(err):  # Note [A process out of descriptors says nothing about io_uring]
            raise out_of_descriptors("the io_uring engine's module", err) from err
        if not isinstance(err, ImportError):
            raise
        return f"the io_uring engine is not importable ({err})"
    return _io_uring.probe()


def available_backends() -> dict[str, str | None]:
    """Each registered engine mapped to None when usable, else the reason it is not."""
    return {name: registered.unavailable_reason() for name, registered in _ENGINES.items()}


@functools.cache
def _log_auto_fallback(reason: str) -> None:
    logger.info("tba: backend 'auto' uses threads: %s", reason)


def _unknown_backend(backend: str) -> TbaConfigError:
    return TbaConfigError(f"unknown backend {backend!r}; {did_you_mean(backend, backend_names())}"
                          f"choose one of {', '.join(backend_names())}, "
                          "pass an Engine instance, or register one with tba.io.register_engine")


def check_backend_name(backend: object) -> None:
    """Raise :class:`TbaConfigError` for a name that is none of :func:`backend_names` (an option read from
    ``$TBA_BACKEND`` is checked when the config is made, so that the error can name the variable)."""
    if isinstance(backend, str) and backend not in backend_names():
        raise _unknown_backend(backend)


def resolve_backend(backend: str) -> str:
    """Map an engine backend name to the concrete engine that will run, raising a clear error if unusable."""
    if not isinstance(backend, str):
        raise TbaConfigError(f"backend must be a string or an Engine, got {type(backend).__name__}")
    if backend == "auto":
        reason = io_uring_unavailable_reason()
        if reason is None:
            logger.debug("tba: backend 'auto' uses io_uring (native engine built, kernel allows io_uring)")
            return "io_uring"
        _log_auto_fallback(reason)
        return "threads"
    if backend not in _ENGINES:
        raise _unknown_backend(backend)
    reason = _ENGINES[backend].unavailable_reason()
    if reason is not None:
        raise TbaConfigError(f"backend {backend!r} is not available: {reason}; use backend='auto'")
    return backend


def make_engine(backend: str | Engine = "auto", *, queue_depth: int = QUEUE_DEPTH) -> Engine:
    """Build the engine named by ``backend`` (or return an :class:`Engine` instance as is).

    Args:
        backend: ``"auto"``, a registered engine name (``"io_uring"``, ``"threads"``), or an engine instance.
        queue_depth: Requests in flight at once (ring entries, or threads for ``"threads"``,
            capped at :data:`tba.defaults.MAX_ENGINE_THREADS`). Default :data:`tba.defaults.QUEUE_DEPTH`.

    Raises:
        TbaConfigError: an unknown name, an engine that cannot run here, or a queue depth that is not a whole
            number in 1..4096 (:data:`tba.defaults.MAX_QUEUE_DEPTH`).
    """
    if isinstance(backend, Engine):
        return backend
    if isinstance(queue_depth, bool) or not isinstance(queue_depth, numbers.Integral):
        raise TbaConfigError(f"queue_depth must be a whole number in 1..{MAX_QUEUE_DEPTH}, got "
                             f"{type(queue_depth).__name__} {queue_depth!r}")
    if not 1 <= queue_depth <= MAX_QUEUE_DEPTH:  # the options' range; the ring's own check raised a bare ValueError
        raise TbaConfigError(f"queue_depth must be in 1..{MAX_QUEUE_DEPTH}, got {queue_depth}")
    queue_depth = int(queue_depth)
    name = resolve_backend(backend)
    try:
        return _ENGINES[name].factory(queue_depth)
    except TbaConfigError as err:  # Note [A ring the kernel refuses] in tba/io/_io_uring.py
        if backend != "auto" or name == "threads":
            raise
        _log_auto_fallback(str(err))
        return _ENGINES["threads"].factory(queue_depth)


def _io_uring_engine(queue_depth: int) -> Engine:
    from tba.io._io_uring import IoUringEngine

    return IoUringEngine(queue_depth=queue_depth)


register_engine("io_uring", _io_uring_engine, io_uring_unavailable_reason)
register_engine("threads", lambda queue_depth: ThreadEngine(workers=min(queue_depth, MAX_ENGINE_THREADS)))

__all__ = [
    "FULL_DISK_ERRNOS",
    "BufferPool",
    "Engine",
    "EngineFactory",
    "Op",
    "OutOfDescriptorsError",
    "Request",
    "SpillFile",
    "ThreadEngine",
    "aligned_empty",
    "available_backends",
    "backend_names",
    "check_backend_name",
    "checksum",
    "create_preallocated",
    "dangling_link",
    "engine_names",
    "directory_bandwidth",
    "filled_buffer",
    "file_creation_failure",
    "filesystem_type",
    "host_buffer",
    "load_crc32c",
    "make_engine",
    "memory_backed",
    "memory_view",
    "open_scratch",
    "probe_direct_io",
    "register_engine",
    "release_idle_space",
    "resolve_backend",
    "resolve_directory",
    "round_up",
    "storage_view",
    "timed_pass",
]
