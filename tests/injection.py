"""Exceptions raised where a signal handler's would land: a trace function that raises at the k-th line a chosen
function runs (tests/runtime/test_recompute_interrupted.py, test_exception_at_every_call.py)."""

from __future__ import annotations

from collections.abc import Callable
from types import CodeType
from typing import Any


class Injected(BaseException):
    """Raised by the trace function; a ``BaseException``, as a signal handler's ``KeyboardInterrupt`` is."""


def raise_at_line(k: int, traced: Callable[[CodeType], bool]) -> tuple[Callable[..., Any], list[int]]:
    """A trace function for ``sys.settrace`` that raises :class:`Injected` at the k-th line run in frames whose code
    ``traced`` accepts, and its count of those lines so far (fewer than ``k``: the function ended first)."""
    seen = [0]

    def trace(frame: Any, event: str, arg: object) -> Callable[..., Any] | None:
        if not traced(frame.f_code):
            return None
        if event == "line":
            seen[0] += 1
            if seen[0] == k:
                raise Injected
        return trace

    return trace, seen
