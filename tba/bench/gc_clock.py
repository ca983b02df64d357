"""The cycle collector's share of a block of code: seconds spent collecting, and full collections.

CPython's collector runs in whichever thread allocates when a generation's count is reached,
holding the GIL, so a collection stops every Python thread of the process for its length: its wall
time is the cost. A full collection (generation 2) walks every tracked object of the process and
lands in one step out of several, where a best-of figure rarely shows it; a user's average step
does (docs/host-cost.md, tenth and sixteenth passes). :class:`CollectorClock` times every
collection through ``gc.callbacks`` while it is entered.
"""

from __future__ import annotations

import gc
import threading
import time
from typing import Any


class CollectorClock:
    """While entered: seconds the cycle collector ran (:attr:`seconds`) and its full collections (:attr:`full`).

    Entering resets both. Collections in any thread count; one that began before the block is not.
    """

    def __init__(self) -> None:
        self.seconds = 0.0
        self.full = 0
        self.collections = 0
        self._started: dict[int, float] = {}
        self._lock = threading.Lock()

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        now = time.perf_counter()
        ident = threading.get_ident()
        with self._lock:
            if phase == "start":
                self._started[ident] = now
                return
            began = self._started.pop(ident, None)
            if began is None:
                return
            self.seconds += now - began
            self.collections += 1
            self.full += info.get("generation") == 2

    def __enter__(self) -> CollectorClock:
        self.seconds, self.full, self.collections = 0.0, 0, 0
        self._started.clear()
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)

    def __repr__(self) -> str:
        return f"CollectorClock(seconds={self.seconds:.4f}, full={self.full}, collections={self.collections})"
