"""A one-line progress bar on stderr for long tool runs, with no dependency.

On a terminal the line is redrawn in place (``\\r``); otherwise (CI logs, pipes) each update is
printed on its own line so that the log still shows how far the run got.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

BAR_WIDTH_CHARS = 24


class Progress:
    """``Progress(total)``; call :meth:`update` before each unit of work and :meth:`done` at the end."""

    def __init__(self, total: int, stream: TextIO | None = None, enabled: bool = True) -> None:
        self.total = total
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.count = 0
        self._start = time.perf_counter()
        self._tty = self.stream.isatty()

    def update(self, label: str) -> None:
        """Show that unit ``count + 1`` (``label``) is starting."""
        self._draw(label)
        self.count += 1

    def _draw(self, label: str) -> None:
        if not self.enabled:
            return
        filled = BAR_WIDTH_CHARS * self.count // max(self.total, 1)
        bar = "#" * filled + "." * (BAR_WIDTH_CHARS - filled)
        elapsed = time.perf_counter() - self._start
        line = f"[{bar}] {self.count}/{self.total} {elapsed:6.1f} s  {label}"
        if self._tty:
            self.stream.write("\r" + line.ljust(100)[:100])
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def done(self) -> None:
        self._draw("done")
        if self.enabled and self._tty:
            self.stream.write("\n")
            self.stream.flush()
