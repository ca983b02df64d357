"""The one place where tba.checkpoint touches the rest of tba, torch's private DCP names and the OS.

Everything the checkpoint package needs from tba's engine (``make_engine``, ``Request``, ``Op``,
``ALIGN_BYTES``), from ``tba.errors``, from ``tba.io.resolve_directory`` and from the private
names of ``torch.distributed.checkpoint`` (``filesystem._StorageInfo``, which DCP's own
``FileSystemReader`` expects in the metadata, ``filesystem.CURRENT_DCP_VERSION``, the
``Metadata.version`` its writer stamps, and ``_nested_dict.flatten_state_dict``, which names each
item) is imported here and only here, so that a move of those modules changes one file.

Host buffers (:func:`tba.io.host_buffer`, in huge-page multiples here), data files
(:func:`tba.io.create_preallocated`: ``O_DIRECT`` where possible, preallocated so that a full disk
fails before any byte is written), alignment, queue depth and request size are io's. This module
adds the sizes of checkpoint host buffers; staging directories and atomic publication are in
``_publish.py``.
"""

from __future__ import annotations

import os
import threading

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION as DCP_VERSION
from torch.distributed.checkpoint.filesystem import _StorageInfo as StorageInfo

from tba._units import SizeError, parse_size
from tba.defaults import ALIGN_BYTES, BLOCK_SIZE_BYTES, HUGE_PAGE_BYTES, QUEUE_DEPTH
from tba.errors import TbaConfigError, TbaError
from tba.io import (
    Engine,
    Op,
    Request,
    create_preallocated,
    dangling_link,
    make_engine,
    resolve_backend,
    resolve_directory,
    round_up,
)
from tba.io import host_buffer as io_host_buffer

DEFAULT_QUEUE_DEPTH = QUEUE_DEPTH
"""Requests in flight per checkpoint engine: the offloader's default (:data:`tba.defaults.QUEUE_DEPTH`)."""

DEFAULT_CHUNK_BYTES = BLOCK_SIZE_BYTES
"""Bytes per write or read request: the offloader's block size (:data:`tba.defaults.BLOCK_SIZE_BYTES`)."""


__all__ = [
    "ALIGN_BYTES", "DCP_VERSION", "DEFAULT_CHUNK_BYTES", "DEFAULT_QUEUE_DEPTH", "Engine", "EngineSettingsRepr", "ImagePool",
    "Op", "Request",
    "StorageInfo", "TbaCheckpointError", "TbaConfigError", "TbaError", "align_up", "check_engine_settings", "create_preallocated",
    "dangling_link", "flatten_state_dict", "interrupt_in", "is_working_directory", "size_bytes",
    "host_buffer", "make_engine", "resolve_directory",
]


class TbaCheckpointError(TbaError):
    """A checkpoint could not be written or read; any earlier checkpoint is left untouched."""


class EngineSettingsRepr:
    """``repr`` of a DCP storage class of tba: its path, backend and queue depth (``self.path``, ``self._backend``,
    ``self._queue_depth``), not ``<... object at 0x...>``."""

    def __repr__(self) -> str:
        backend = getattr(self, "_backend", None)
        name = backend.name if isinstance(backend, Engine) else backend
        return (f"{type(self).__name__}({getattr(self, 'path', None)!r}, backend={name!r}, "
                f"queue_depth={getattr(self, '_queue_depth', None)})")


def check_engine_settings(backend: str | Engine, queue_depth: int) -> None:
    """Refuse an unknown or unusable backend and a bad queue depth where they are given.

    Note: [Engine settings are checked at construction]
    The checkpoint classes made their engine only inside ``dcp.save`` / ``dcp.load``, or in a lazy
    save's thread: ``TbaStorageWriter(backend="nope")`` or ``LazyCheckpointer(queue_depth=0)`` was
    accepted and every save then failed with DCP's ``CheckpointException`` (a ``BaseException``
    that ``except Exception`` does not catch), a lazy one only at ``wait()`` (helper-55). The
    constructors call this, so the ``TbaConfigError`` comes from the line that chose the value.
    """
    if isinstance(backend, Engine):
        return
    if isinstance(queue_depth, bool) or not isinstance(queue_depth, int) or queue_depth < 1:
        raise TbaConfigError(f"queue_depth must be a whole number >= 1, got {queue_depth!r}")
    resolve_backend(backend)


def interrupt_in(err: BaseException) -> BaseException | None:
    """The ``KeyboardInterrupt`` (or other exception that is not an ``Exception``) DCP wrapped in ``err``, if any.

    Note: [A Ctrl-C inside DCP stays a Ctrl-C]
    DCP runs each step of a save or load under ``except BaseException`` and reports what it caught in
    its ``CheckpointException``: a Ctrl-C landing in ``tba.checkpoint.load`` came out as a
    ``TbaCheckpointError`` ("loading ... failed: KeyboardInterrupt"), which ``except Exception`` catches
    (a loop retrying failed loads ran on), and one landing in the first lazy save's warm-up, which runs
    in the caller's thread, was logged as a failed warm-up and the save went on. tba re-raises it.
    """
    failures = err.failures.values() if isinstance(err, CheckpointException) else ()
    return next((failure[0] for failure in failures if not isinstance(failure[0], Exception)), None)


def size_bytes(name: str, value: int | str) -> int:
    """``value`` as bytes: an int >= 0, or a size string such as ``"2G"`` (as the offloader's options take)."""
    if isinstance(value, str):
        try:
            return parse_size(value)
        except SizeError as err:
            raise TbaConfigError(f"{name}: {err}") from None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TbaConfigError(f"{name} must be bytes >= 0 (an int, or a size such as '2G'), got {value!r}")
    return value


def checkpoint_path(path: object) -> str | None:
    """``path`` as a str (None stays None); anything but a str or ``os.PathLike`` is a :class:`TbaConfigError`."""
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise TbaConfigError(f"path must be the checkpoint's directory (a str or os.PathLike), got {path!r}")
    return None if path is None else os.fspath(path)


def is_working_directory(path: str) -> bool:
    """Whether ``path`` is the process's working directory (not through a symlink), which a save must not replace."""
    try:
        return not os.path.islink(path) and os.path.isdir(path) and os.path.samefile(path, os.getcwd())
    except OSError:
        return False


def align_up(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of :data:`ALIGN_BYTES` (``O_DIRECT``'s boundary)."""
    return round_up(nbytes, ALIGN_BYTES)


def host_buffer(nbytes: int) -> torch.Tensor:
    """:func:`tba.io.host_buffer` of at least ``nbytes``, rounded up to :data:`HUGE_PAGE_BYTES`."""
    return io_host_buffer(round_up(max(nbytes, 1), HUGE_PAGE_BYTES))


class ImagePool:
    """One reusable page-aligned host buffer for file images, grown on demand.

    Reusing it matters: fresh memory is first touched at ~1 GB/s here, ten times slower than a
    copy into memory touched before.
    """

    def __init__(self, reserve_bytes: int = 0) -> None:
        self._lock = threading.Lock()
        self._buffer: torch.Tensor | None = None
        if reserve_bytes:
            try:
                self._buffer = host_buffer(reserve_bytes)
            except (OSError, MemoryError, RuntimeError) as err:
                raise TbaConfigError(f"reserve_bytes={reserve_bytes}: cannot allocate that much host memory ({err}); "
                                     "pass about the checkpoint's size, or 0 to grow the buffer at the first save") from None

    def release(self) -> None:
        """Drop the buffer: its pages go back to the kernel once no save holds it; the next :meth:`get` allocates."""
        with self._lock:
            self._buffer = None

    def get(self, nbytes: int) -> torch.Tensor:
        """A buffer of at least ``nbytes``; callers must not use it from two saves at once."""
        with self._lock:
            if self._buffer is None or self._buffer.numel() < nbytes:
                self._buffer = None
                self._buffer = host_buffer(nbytes + nbytes // 8)
            return self._buffer
