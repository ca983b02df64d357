"""Helpers of the simulated-device tests: an engine whose memory accesses the race checker sees."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future

from tba.io import Engine, Op, Request, ThreadEngine


class CheckedEngine(Engine):
    """A thread engine that reports each request's memory access to the simulator's race checker (as the host)."""

    name = "checked"

    def __init__(self, sim, workers: int = 4) -> None:
        self.sim = sim
        self.inner = ThreadEngine(workers=workers)

    def submit_many(self, requests: Sequence[Request]) -> list[Future]:
        for request in requests:
            self.sim.host_access(request.address, request.nbytes, request.op is Op.READ, f"file {request.op.name}")
        return self.inner.submit_many(requests)

    def close(self) -> None:
        self.inner.close()
