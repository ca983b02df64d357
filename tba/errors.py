"""Exceptions raised by tba.

Every error names what went wrong and, where there is one, the fix. Reads that fail are never
papered over: a saved tensor that cannot be read back raises :class:`TbaReadError` rather than
returning zeros or stale bytes.
"""

from __future__ import annotations

import difflib
import errno
from collections.abc import Iterable, Iterator


class TbaError(RuntimeError):
    """Base class of all tba errors."""


class TbaConfigError(TbaError, ValueError):
    """Bad arguments or an unusable environment, raised before any forward work."""


class EngineClosedError(TbaError):
    """Work was submitted to an I/O engine after it was closed (an offloader closed while still in use)."""


class TbaReadError(TbaError):
    """A saved tensor could not be read back from its file."""


class ShortTransferError(OSError):
    """A read or write moved fewer bytes than asked for and could not be completed.

    Engines raise it for a read that hits end of file early; it is an ``OSError`` with
    ``errno.EIO`` so callers can treat it like any other I/O failure.
    """

    def __init__(self, op: str, done_bytes: int, want_bytes: int, offset: int) -> None:
        super().__init__(
            errno.EIO,
            f"short {op}: {done_bytes} of {want_bytes} bytes at file offset {offset}",
        )
        self.done_bytes = done_bytes
        self.want_bytes = want_bytes
        self.offset = offset


def did_you_mean(given: object, choices: Iterable[str]) -> str:
    """``"did you mean 'keep'? "`` for the choice closest to ``given`` (case ignored), else ``""``.

    The one helper behind every did-you-mean of tba: misspelt option names, policies, backends, placements.
    """
    if not isinstance(given, str):
        return ""
    choices = list(choices)
    by_lower = {choice.lower(): choice for choice in choices}
    close = difflib.get_close_matches(given.lower(), list(by_lower), n=1)
    return f"did you mean {by_lower[close[0]]!r}? " if close else ""


def error_text(error: BaseException | None) -> str:
    """``str(error)``, or "" for an error whose text cannot be made (its ``__str__`` raised): where tba settles a
    failure and then says so, the saying must not raise instead (Note [A failed write's warning never raises] in
    ``tba/runtime/_release.py``)."""
    try:
        return str(error)
    except Exception:  # noqa: BLE001 - no text: the caller names the error by its type, or reads no cause from it
        return ""


def names_cuda_error(error: BaseException | None) -> bool:
    """Whether ``error``'s text is a CUDA error's (torch's and kvikio's say "CUDA error"): the GPU failed, not a disk."""
    return "CUDA error" in error_text(error)


def error_summary(error: BaseException) -> str:
    """``error``'s text, or its type's name when it has none, for a log line about a failure tba settled.

    Note: [A log record holds no failed save's frames]
    A log record keeps its arguments until it is formatted, and handlers that keep records (``MemoryHandler``,
    pytest's ``caplog``, a queue to a listener thread) keep them for long after. Passed the error itself, a failed
    save's record kept the error's traceback, whose frames held the saved tensor and, through its ``grad_fn``, the
    step's graph: memory the program had freed, alive for as long as the handler kept the record. A record gets this
    string instead.
    """
    return error_text(error) or type(error).__name__


def linked_errors(err: BaseException) -> Iterator[BaseException]:
    """``err`` and every error linked to it, each once: causes, contexts, and the per-rank ``failures`` (an
    error and its stack) in which DCP's ``CheckpointException`` raises again what a save raised."""
    seen: set[int] = set()
    todo: list[BaseException] = [err]
    while todo:
        current = todo.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        failures = getattr(current, "failures", None)
        if isinstance(failures, dict):
            todo += [failure[0] for failure in failures.values()
                     if isinstance(failure, tuple) and failure and isinstance(failure[0], BaseException)]
        todo += [linked for linked in (current.__cause__, current.__context__) if linked is not None]

