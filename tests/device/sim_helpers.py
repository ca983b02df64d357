"""Helpers of the simulated-device tests: an engine whose memory accesses the race checker sees."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from concurrent.futures import Future

from tba.device.sim._checker import HOST
from tba.io import Engine, Op, Request, ThreadEngine


class CheckedEngine(Engine):
    """A thread engine that reports each request's memory access to the simulator's race checker.

    Each request is a participant of its own, from its submission (where the host is then) to its
    completion, which the host learns when the future's callbacks run: a staging block handed to
    the next copy while the file still reads or writes it is a race, as a pinned block reused
    before its ``pwrite`` finished would be on a GPU. (Stamping the access on the host at
    submission, as before, ordered such a copy after it.)
    """

    name = "checked"

    def __init__(self, sim, workers: int = 4) -> None:
        self.sim = sim
        self.inner = ThreadEngine(workers=workers)

    def submit_many(self, requests: Sequence[Request]) -> list[Future]:
        checker = self.sim.checker
        names = []
        for request in requests:
            who = checker.spawn("file")
            checker.access(who, request.address, request.nbytes, request.op is Op.READ, f"file {request.op.name}")
            names.append(who)
        futures = self.inner.submit_many(requests)
        for future, who in zip(futures, names):
            # Registered before tba's own callbacks: the host knows the request completed when they run.
            future.add_done_callback(functools.partial(self._completed, who))
        return futures

    def _completed(self, who: str, future: Future) -> None:
        checker = self.sim.checker
        checker.merge(HOST, checker.retire(who))

    def close(self) -> None:
        self.inner.close()
