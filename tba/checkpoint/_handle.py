"""The handle of one lazy checkpoint (:class:`LazyCheckpoint`): when its tensors may change again (the
*snapshot*), when it is durable and published, what it cost, and how it ended. The save itself, and the
thread that sets the handle's events, are in ``tba/checkpoint/_lazy.py``."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

from tba import _sched
from tba.checkpoint._io import TbaCheckpointError
from tba.checkpoint._pending import end_save

logger = logging.getLogger("tba")


class LazyCheckpoint:
    """Handle of one lazy checkpoint; returned by :meth:`LazyCheckpointer.save`."""

    def __init__(self, path: str, on_done: Callable[[LazyCheckpoint], None] | None) -> None:
        self.path = path
        self.error: BaseException | None = None
        self.snapshot_s = 0.0
        """Seconds from :meth:`LazyCheckpointer.save` until every tensor was copied."""
        self.total_s = 0.0
        """Seconds from :meth:`LazyCheckpointer.save` until the checkpoint was published."""
        self.bytes_written = 0
        """Bytes of the checkpoint's data file."""
        self.write_s = 0.0
        """Seconds from opening the data file until it was fsync'd (copy overlapped with writes)."""
        self._on_done = on_done
        self._snapshot = threading.Event()
        self._done = threading.Event()
        self._start = time.perf_counter()
        self._pid = os.getpid()

    def __repr__(self) -> str:
        if not self._done.is_set():
            state = "writing" if self._snapshot.is_set() else "copying"
        elif self.error is not None:
            state = f"failed: {type(self.error).__name__}: {self.error}"
        else:
            state = f"published: {self.bytes_written} bytes in {self.total_s:.3f} s"
        return f"LazyCheckpoint({self.path!r}, {state})"

    def snapshot_taken(self) -> bool:
        """True once the saved tensors may be modified again."""
        return self._snapshot.is_set()

    def done(self) -> bool:
        """True once the checkpoint is durable and published, or has failed."""
        return self._done.is_set()

    def wait_snapshot(self, timeout_s: float | None = None) -> float:
        """Block until every tensor has been copied; returns the seconds waited."""
        start = time.perf_counter()
        if self._forked_away():  # the child's tensors are its own copies: changing them cannot reach the save
            return 0.0
        if not self._snapshot.wait(timeout_s):
            raise TimeoutError(f"checkpoint {self.path}: snapshot not taken within {timeout_s} s")
        return time.perf_counter() - start

    def wait(self, timeout_s: float | None = None) -> None:
        """Block until the checkpoint is durable and published.

        Raises:
            TbaCheckpointError: The save failed; the earlier checkpoint at the path is unchanged.
        """
        if self._forked_away():
            raise TbaCheckpointError(f"checkpoint {self.path} is written by process {self._pid}, from which this one was "
                                     "forked, and only that process can wait for it; wait there (or load the path once "
                                     "it is published)")
        if not self._done.wait(timeout_s):
            raise TimeoutError(f"checkpoint {self.path} not finished within {timeout_s} s")
        if self.error is not None:
            if isinstance(self.error, TbaCheckpointError):
                raise self.error
            raise TbaCheckpointError(f"checkpoint {self.path} failed: {self.error}") from self.error

    def _forked_away(self) -> bool:
        """Whether this is a forked child of the saving process, whose save thread it does not have.

        Note: [A forked child cannot wait for its parent's save]
        A child holding the parent's handle (forked while the save ran) waited in ``wait()`` for ever:
        its events are set by a thread that stays in the parent (helper-91). Its ``wait()`` raises
        instead; its ``wait_snapshot()`` returns at once, since the child's tensors are copies.
        """
        return os.getpid() != self._pid and not self._done.is_set()

    def _mark_snapshot(self) -> None:
        if not self._snapshot.is_set():
            self.snapshot_s = time.perf_counter() - self._start
            self._snapshot.set()

    def _finish(self, error: BaseException | None) -> None:
        self.error = error
        self.total_s = time.perf_counter() - self._start
        self._mark_snapshot()
        self._done.set()
        end_save(self._done)
        if self._on_done is not None:
            try:
                with _sched.ordinary():  # what the user's callback starts must not inherit SCHED_BATCH
                    self._on_done(self)
            except Exception:  # noqa: BLE001 - a user callback must not kill the writer thread
                logger.exception("tba: on_done callback of checkpoint %s failed", self.path)
