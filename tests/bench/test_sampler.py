"""tba.bench.sampler: where a parked thread stands, per thread name, and nothing left running after the block."""

from __future__ import annotations

import threading
import time

from tba.bench.sampler import StackSampler

WAIT_S = 30.0
"""How long the test waits for 20 samples (about 10 ms of sampling) before it fails: a sampler that
never samples must fail with a message, not hang until CI's timeout."""


def parked(release: threading.Event) -> None:
    release.wait(10)


def test_a_parked_thread_is_seen_in_its_function_and_the_sampler_stops():
    release = threading.Event()
    worker = threading.Thread(target=parked, args=(release,), name="parked-worker")
    worker.start()
    try:
        with StackSampler(interval_s=0.0005) as sampler:
            deadline = time.monotonic() + WAIT_S
            while sampler.samples["parked-worker"] < 20:
                assert time.monotonic() < deadline, f"no 20 samples of a parked thread in {WAIT_S} s: {dict(sampler.samples)}"
                threading.Event().wait(0.005)
    finally:
        release.set()
        worker.join()
    total = sampler.samples["parked-worker"]
    assert sampler.inclusive["parked-worker", "test_sampler.py:parked"] == total
    assert sum(n for (name, where), n in sampler.leaf.items() if name == "parked-worker") == total
    assert "tba-sampler" not in sampler.samples
    assert not any(thread.name == "tba-sampler" for thread in threading.enumerate())
    report = sampler.report(top=3)
    assert "thread parked-worker:" in report and "100.0% test_sampler.py:parked" in report
    assert "StackSampler(" in repr(sampler)
