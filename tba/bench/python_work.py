"""How much Python each thread runs per saved storage: lines, calls and C calls, counted, not timed.

On this project's benchmark machines two runs of one timing differ by about 20 µs per storage
(``docs/host-cost.md``), more than most changes to the per-storage path move it. What those changes move is
the Python that tba's threads run, one at a time under the GIL, per storage. :class:`PythonWork` counts it:
every line executed (``sys.settrace``), every Python call, and every call of a C function
(``sys.setprofile``), per thread and per phase (``"forward"``, ``"backward"``, or whatever the caller names).
Counts move by a few percent from run to run, with how many jobs each wake-up of tba's control thread finds
queued, where times move by a quarter; they grow only when the code does more.

Note: [Counting the threads tba already runs]
``sys.settrace`` and ``sys.setprofile`` hook only the calling thread, and ``threading.settrace`` only the
threads started afterwards. tba's control thread is long-lived: the hooks are set there by a job that it runs
(``tba._control.call``). The threads of an I/O engine live as long as a shared runtime: :func:`count_step`
closes the idle runtimes (``tba.shutdown()``) before hooking, so that the next offloader's engine starts hooked,
runs one step uncounted (the runtime's first, which allocates its buffers), counts the next, and closes the
runtimes again after unhooking, so that no hooked thread outlives the count and slows what is measured next.

``python -m tba bench-hooks --python-work`` prints the counts of each row with tba less those without.
"""

from __future__ import annotations

import collections
import re
import sys
import threading
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any

from tba import _control

_POOL_SUFFIX = re.compile(r"[-_]\d+$")

KINDS = ("lines", "calls", "c_calls")
"""What is counted: lines executed, Python calls, calls of C functions (builtins and methods of C types)."""


class PythonWork:
    """Counts Python lines, calls and C calls per (phase, thread name) while :attr:`phase` is set.

    ``with PythonWork() as work:`` hooks the calling thread, the threads started inside the block and
    tba's control thread (Note [Counting the threads tba already runs]); nothing is counted until
    :attr:`phase` names one. Counts are per thread name, a pool's threads together (a trailing
    ``-digits`` is dropped, as in ``tba/bench/thread_cpu.py``).
    """

    def __init__(self) -> None:
        self.phase: str | None = None
        """What the counts made now are filed under; None: nothing is counted."""
        self.counts: dict[str, collections.Counter[tuple[str, str]]] = {kind: collections.Counter() for kind in KINDS}
        """Per kind (:data:`KINDS`): (phase, thread name) -> count."""
        self.functions: collections.Counter[tuple[str, str, str]] = collections.Counter()
        """(phase, thread name, ``file:function``) -> Python calls."""
        self._names: dict[int, str] = {}
        self._previous: tuple[Any, ...] = (None,) * 6
        """The trace and profile functions this block replaced (a debugger's, coverage's), put back at its end."""

    def __repr__(self) -> str:
        totals = {kind: sum(counter.values()) for kind, counter in self.counts.items()}
        return f"PythonWork(phase={self.phase!r}, {', '.join(f'{k}={v}' for k, v in totals.items())})"

    def _thread(self) -> str:
        ident = threading.get_ident()
        name = self._names.get(ident)
        if name is None:
            name = self._names[ident] = _POOL_SUFFIX.sub("", threading.current_thread().name)
        return name

    def _on_call(self, frame: FrameType, event: str, arg: Any) -> Callable | None:
        phase = self.phase
        if phase is None:
            return None
        thread = self._thread()
        self.counts["calls"][phase, thread] += 1
        code = frame.f_code
        self.functions[phase, thread, f"{_short(code.co_filename)}:{code.co_name}"] += 1
        return self._on_line

    def _on_line(self, frame: FrameType, event: str, arg: Any) -> Callable | None:
        phase = self.phase
        if event == "line" and phase is not None:
            self.counts["lines"][phase, self._thread()] += 1
        return self._on_line

    def _on_profile(self, frame: FrameType, event: str, arg: Any) -> None:
        phase = self.phase
        if event == "c_call" and phase is not None:
            self.counts["c_calls"][phase, self._thread()] += 1

    def _hook(self) -> tuple[Any, Any]:
        previous = sys.gettrace(), sys.getprofile()
        sys.settrace(self._on_call)
        sys.setprofile(self._on_profile)
        return previous

    def __enter__(self) -> PythonWork:
        threading_hooks = threading.gettrace(), threading.getprofile()
        self._previous = (*threading_hooks, sys.gettrace(), sys.getprofile(), None, None)
        threading.settrace(self._on_call)
        threading.setprofile(self._on_profile)
        try:
            self._previous = (*threading_hooks, *self._hook(), *_control.call(self._hook))
        except BaseException:
            self.__exit__(None, None, None)  # no hook is left behind by a failed start
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.phase = None
        threading_trace, threading_profile, trace, profile, control_trace, control_profile = self._previous
        sys.settrace(trace)
        sys.setprofile(profile)
        threading.settrace(threading_trace)  # type: ignore[arg-type]
        threading.setprofile(threading_profile)  # type: ignore[arg-type]
        _control.call(_put_back, control_trace, control_profile)

    def per_storage(self, phase: str, count: int, kind: str = "lines") -> dict[str, float]:
        """``kind`` per storage in ``phase`` for each thread, most first."""
        mine = {thread: n / count for (p, thread), n in self.counts[kind].items() if p == phase}
        return dict(sorted(mine.items(), key=lambda item: -item[1]))

    def top_functions(self, phase: str, thread: str, count: int, top: int = 10) -> list[tuple[str, float]]:
        """The ``top`` functions ``thread`` called most in ``phase``, with calls per storage."""
        mine = [(where, n / count) for (p, t, where), n in self.functions.items() if p == phase and t == thread]
        return sorted(mine, key=lambda item: -item[1])[:top]


def _put_back(trace: Any, profile: Any) -> None:
    sys.settrace(trace)
    sys.setprofile(profile)


def _short(filename: str) -> str:
    """``tba/runtime/_reads.py`` for tba's files, the base name for others."""
    marker = filename.rfind("/tba/")
    return filename[marker + 1:] if marker >= 0 else filename.rsplit("/", 1)[-1]


def count_step(step: Callable[[Callable[[str], None]], None]) -> PythonWork:
    """Count one call of ``step(mark)`` after one uncounted call (Note [Counting the threads tba already runs]).

    ``step`` runs a forward and a backward, and calls ``mark(phase)`` as each begins; counting stops when it returns
    and tba's queued jobs have run (``tba._control.settle``).
    """
    import tba

    tba.shutdown()
    work = PythonWork()
    try:
        with work:
            step(lambda phase: None)
            _control.settle()
            step(lambda phase: setattr(work, "phase", phase))
            _control.settle()
    finally:
        tba.shutdown()
    return work
