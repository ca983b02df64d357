"""``Stream.query()`` on the simulated device is False while the stream's last operation still runs, as in CUDA.

The scheduler pops an operation from its stream's queue before running it; ``query()`` read only the
queue, so a stream whose last copy was halfway through its bytes answered that all its work was done.
"""

from __future__ import annotations

import threading
import time

from tba.device.sim import simulate


def test_a_stream_running_its_last_operation_is_not_done():
    with simulate(seed=0) as sim:
        side = sim.Stream()
        started, release = threading.Event(), threading.Event()

        def operation() -> None:
            started.set()
            release.wait(10)

        sim.scheduler.launch(side, operation)
        assert started.wait(10)
        try:
            assert not side.query(), "query() said done while the stream's operation was still running"
        finally:
            release.set()
        deadline = time.monotonic() + 10
        while not side.query() and time.monotonic() < deadline:
            time.sleep(0.001)
        assert side.query()
