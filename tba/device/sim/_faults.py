"""Faults of the simulated CUDA device: one failed call, a sticky error, or a context broken for good.

Note: [Injected CUDA faults]
:meth:`SimulatedCuda.inject_fault` makes one kind of CUDA call raise, as a broken context does (a
sticky error: every later call of that kind raises too, until :meth:`SimulatedCuda.clear_faults`)
or as one failed call does (``cudaErrorMemoryAllocation`` creating an event or page-locking
memory). The kinds are ``"copy"`` (:meth:`copy_`), ``"record"`` (an event's record),
``"synchronize"`` (an event's or a stream's synchronize), ``"pin"`` and ``"host_empty"``. Only the
call raises: work queued before it still runs, as on a GPU whose call failed at launch. A sticky
fault is therefore less than a broken context (below): a race reported after one (a block given
back while a copy queued before the fault is still pending) is one a GPU would show only if that
copy still ran. This is the only seam: production code is unchanged, and tests count calls with
``after`` to fail in the middle of a group of copies.

Note: [A broken context]
After an error such as an illegal memory access, a CUDA context is broken for good: every later
call returns the same error, and the work queued on its streams never runs, so events recorded
there never complete. :meth:`SimulatedCuda.break_context` (or a fault injected with
``breaks_context=True``, at the moment it fires) does the same here: the queues are emptied, every
call of :class:`tba.device.CudaApi` raises the error (creating streams and events, records, waits,
queries and synchronizes, copies, allocations, page-locking and unlocking), a host thread already
waiting for an event raises it instead of waiting for ever, and so do the model's own operators
and the fake kvikio's transfers, those already under way included (kvikio's compatibility mode
copies through the device, and cuFile's DMA fails with the context). As nothing on the device
runs again, every later access of the host is ordered after all device work
(``HappensBefore.quiesce``): reusing a staging block whose copy never ran is no race. What tba
must still do then is end: raise, close its file, stop its threads and leave no waiter hanging.
:meth:`clear_faults` does not mend a broken context.
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable
from typing import Any

from tba.device.sim._checker import HappensBefore
from tba.device.sim._streams import HANG_TIMEOUT_S, Scheduler, SimStream, Token


class FaultInjection:
    """The fault seam of :class:`~tba.device.sim.SimulatedCuda` (Notes [Injected CUDA faults], [A broken context])."""

    _lock: threading.Lock
    _faults: dict[str, list[Any]]
    scheduler: Scheduler
    checker: HappensBefore
    default_stream: SimStream
    broken: BaseException | None
    faults_raised: int
    fail: Callable[[str], None]

    FAULT_KINDS = ("copy", "record", "synchronize", "pin", "host_empty")

    def inject_fault(self, kind: str, error: BaseException | None = None, *, after: int = 0,
                     times: int | None = 1, breaks_context: bool = False) -> None:
        """Make ``kind`` calls raise ``error`` after ``after`` more succeed, ``times`` times (None: until cleared);
        with ``breaks_context``, the first failure breaks the context (Note [A broken context]).

        Note [Injected CUDA faults]."""
        if kind not in self.FAULT_KINDS:
            raise ValueError(f"unknown fault kind {kind!r}; one of {self.FAULT_KINDS}")
        error = error or RuntimeError(f"CUDA error: an illegal memory access was encountered (injected into {kind})")
        with self._lock:
            self._faults[kind] = [after, times, error, breaks_context]

    def break_context(self, error: BaseException | None = None) -> None:
        """Break the context for good: queued work is dropped and every later call raises ``error``
        (Note [A broken context])."""
        error = error or RuntimeError("CUDA error: an illegal memory access was encountered (the simulated context is "
                                      "broken)")
        with self._lock:
            if self.broken is None:
                self.broken = error
        streams = self.scheduler.discard()
        self.checker.quiesce([stream.name for stream in streams] + [self.default_stream.name])

    def check_alive(self) -> None:
        """Raise the error of a broken context (Note [A broken context]); nothing while the device works."""
        if self.broken is not None:
            with self._lock:
                self.faults_raised += 1
            raise copy.copy(self.broken)

    def wait_token(self, token: Token, what: str) -> None:
        """Block the host until ``token`` fires; raise if the context breaks meanwhile, or after
        :data:`HANG_TIMEOUT_S` (a hang, reported)."""
        deadline = time.monotonic() + HANG_TIMEOUT_S
        while not token.fired.wait(0.01):
            self.check_alive()
            if time.monotonic() > deadline:
                self.fail(f"{what} waited more than {HANG_TIMEOUT_S} s: the simulated device hung")
                raise RuntimeError("simulated device hung")

    def clear_faults(self) -> None:
        """The device recovered: no injected fault raises any more."""
        with self._lock:
            self._faults.clear()

    def maybe_fail(self, kind: str) -> None:
        """Raise the fault injected into ``kind`` calls, when one is due, or the error of a broken context."""
        self.check_alive()
        if not self._faults:
            return
        with self._lock:
            fault = self._faults.get(kind)
            if fault is None:
                return
            if fault[0] > 0:
                fault[0] -= 1
                return
            if fault[1] is not None:
                fault[1] -= 1
                if fault[1] <= 0:
                    del self._faults[kind]
            self.faults_raised += 1
            error = copy.copy(fault[2])  # a fresh exception each time: no traceback shared between threads, none kept
        if fault[3]:
            self.break_context(fault[2])
        raise error
