"""CollectorClock: the cycle collector's time and full collections inside a block, nothing outside it."""

from __future__ import annotations

import gc

from tba.bench.gc_clock import CollectorClock


def test_counts_collections_inside_the_block_only():
    clock = CollectorClock()
    gc.collect()  # before: not counted
    with clock:
        gc.collect()
        gc.collect(0)
    assert clock.full == 1 and clock.collections == 2 and clock.seconds > 0
    assert clock._callback not in gc.callbacks
    gc.collect()  # after: not counted
    assert clock.full == 1 and clock.collections == 2


def test_entering_again_starts_from_zero():
    clock = CollectorClock()
    with clock:
        gc.collect()
    with clock:
        pass
    assert (clock.seconds, clock.full, clock.collections) == (0.0, 0, 0)
    assert "full=0" in repr(clock)
