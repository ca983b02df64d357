"""Where each thread stands: a sampling profiler of every Python thread's stack.

``with StackSampler() as sampler:`` starts a thread that, every :data:`SAMPLE_INTERVAL_S`, reads every
other thread's current frame (``sys._current_frames()``) and counts, per thread name, the innermost
line (*leaf*) and each function on the stack once (*inclusive*). :meth:`StackSampler.report` prints the
most frequent of each per thread. ``python -m tba bench-hooks --sample-profile`` runs one step of each
row under it (the device path's profile in docs/gpu.md, "The fifth run", came from this).

Note: [Samples land where threads give up the GIL]
The sampling thread runs only while it holds the GIL, so each sample shows every other thread where
it stood when it last let the GIL go: blocked in a call that released it (a queue's wait, a file read,
``Event.synchronize``), or waiting to take it back right after such a call, or stopped between two
bytecodes when the interpreter switched threads (``sys.getswitchinterval()``). A line of pure Python
that keeps the GIL is seen only at those switches. The profile therefore shows where threads wait and
hand the GIL over, not where their CPU time goes; ``thread_cpu.py`` measures that, per thread.
"""

from __future__ import annotations

import collections
import os
import sys
import threading
import time
from types import FrameType, TracebackType

SAMPLE_INTERVAL_S = 0.0003
"""Sleep between two samples."""
TOP_LINES = 12
"""Lines of each kind (leaf, inclusive) :meth:`StackSampler.report` prints per thread."""


def _where(frame: FrameType) -> str:
    code = frame.f_code
    return f"{os.path.basename(code.co_filename)}:{code.co_name}"


class StackSampler:
    """Counts, per thread name, the lines and functions each thread stands in, sampled while the block runs.

    Args:
        interval_s: Sleep between two samples.
    """

    def __init__(self, interval_s: float = SAMPLE_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self.samples: collections.Counter[str] = collections.Counter()
        """Samples per thread name."""
        self.leaf: collections.Counter[tuple[str, str]] = collections.Counter()
        """(thread name, ``file:function:line`` of its innermost frame): samples."""
        self.inclusive: collections.Counter[tuple[str, str]] = collections.Counter()
        """(thread name, ``file:function``) anywhere on its stack: samples."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __repr__(self) -> str:
        return f"StackSampler(interval_s={self.interval_s}, samples={sum(self.samples.values())})"

    def __enter__(self) -> StackSampler:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="tba-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        me = threading.get_ident()
        while not self._stop.is_set():
            names = {thread.ident: thread.name for thread in threading.enumerate()}
            frames = sys._current_frames()
            for ident, frame in frames.items():
                if ident != me:
                    self._count(names.get(ident, f"thread {ident}"), frame)
            frames = frame = None  # a sampled frame must not outlive its sample
            time.sleep(self.interval_s)

    def _count(self, name: str, innermost: FrameType) -> None:
        self.samples[name] += 1
        self.leaf[name, f"{_where(innermost)}:{innermost.f_lineno}"] += 1
        seen = set()
        frame: FrameType | None = innermost
        while frame is not None:
            where = _where(frame)
            if where not in seen:
                seen.add(where)
                self.inclusive[name, where] += 1
            frame = frame.f_back

    def report(self, top: int = TOP_LINES) -> str:
        """Per thread, busiest first: its samples, then its ``top`` leaf lines and inclusive functions with shares."""
        lines = []
        for name, total in self.samples.most_common():
            lines.append(f"thread {name}: {total} samples")
            for label, counter in (("leaf", self.leaf), ("incl", self.inclusive)):
                mine = sorted(((where, n) for (thread, where), n in counter.items() if thread == name),
                              key=lambda item: -item[1])[:top]
                lines.extend(f"  {label} {100 * n / total:5.1f}% {where}" for where, n in mine)
        return "\n".join(lines)
