"""The self-sizing prefetch window: a pure controller, grown on waits, shrunk after idle passes."""

from __future__ import annotations

import pytest

from tba.defaults import MIB
from tba.runtime._prefetch import PrefetchWindow
from tba.runtime._window import WindowController


def controller() -> WindowController:
    return WindowController(initial_bytes=64 * MIB, min_bytes=8 * MIB, max_fraction=0.25, grow_factor=1.5,
                            shrink_factor=0.5, tolerated_waits=0)


def test_starts_at_initial_and_is_capped_by_forward_bytes():
    c = controller()
    assert c.budget_bytes == 64 * MIB
    c.start_pass(forward_bytes=128 * MIB)
    assert c.budget_bytes == 32 * MIB
    c.start_pass(forward_bytes=1024 * MIB)
    assert c.budget_bytes == 64 * MIB


def test_grows_on_each_wait_after_reads_idled_up_to_the_fraction_of_forward():
    c = controller()
    c.start_pass(forward_bytes=1024 * MIB)
    c.note_reads_idle()
    c.note_wait()
    assert c.budget_bytes == 64 * MIB, "reads that idle before backward unpacked anything say nothing"
    c.note_reads_idle()
    c.note_wait()
    assert c.budget_bytes == 96 * MIB
    for _ in range(10):
        c.note_reads_idle()
        c.note_wait()
    assert c.budget_bytes == 256 * MIB
    assert c.waits == 12


def test_waits_while_the_disk_reads_all_along_do_not_grow():
    c = controller()
    c.start_pass(forward_bytes=1024 * MIB)
    for _ in range(10):
        c.note_wait()  # reads in flight throughout: the disk, not the window, is behind
    assert c.budget_bytes == 64 * MIB
    c.note_reads_idle()
    c.note_wait()
    assert c.budget_bytes == 96 * MIB


def test_disk_bound_steps_do_not_ratchet_the_window():
    c = WindowController()
    for _ in range(10):
        c.start_pass(7000 * MIB)
        for _ in range(10):
            c.note_wait()
        c.end_pass()
    assert c.budget_bytes == c.min_bytes


def test_shrinks_after_a_pass_whose_reads_sat_idle_and_never_below_min():
    c = controller()
    c.start_pass(forward_bytes=1024 * MIB)
    c.note_served_prefetched()
    c.end_pass()
    assert c.budget_bytes == 32 * MIB
    for _ in range(10):
        c.start_pass(forward_bytes=1024 * MIB)
        c.note_served_prefetched()
        c.end_pass()
    assert c.budget_bytes == 8 * MIB


def test_a_pass_with_a_wait_does_not_shrink():
    c = controller()
    c.start_pass(forward_bytes=1024 * MIB)
    c.note_served_prefetched()
    c.note_reads_idle()
    c.note_wait()
    c.end_pass()
    assert c.budget_bytes == 96 * MIB


def test_an_empty_pass_changes_nothing():
    c = controller()
    c.end_pass()
    c.start_pass(forward_bytes=0)
    c.end_pass()
    assert c.budget_bytes == 64 * MIB and c.passes == 0


def test_bad_factors_are_refused():
    with pytest.raises(ValueError):
        WindowController(shrink_factor=1.5)
    with pytest.raises(ValueError):
        WindowController(grow_factor=0.5)


def test_prefetch_window_uses_the_controller_unless_a_budget_was_given():
    c = controller()
    window = PrefetchWindow(1, None, c)
    assert window.budget_bytes == 64 * MIB
    c.note_served_prefetched()
    window.note_reads_idle()
    c.note_wait()
    assert window.budget_bytes == 64 * MIB, "reads idling in forward (unpacks inside the block) grow nothing"
    window.forward_bytes = 1024 * MIB
    window.end_forward()
    c.note_served_prefetched()
    window.note_reads_idle()
    c.note_wait()
    assert window.budget_bytes == 96 * MIB
    assert PrefetchWindow(1, 5 * MIB, c).budget_bytes == 5 * MIB


def test_prefetch_window_feeds_the_controller_one_pass_per_step():
    c = controller()
    window = PrefetchWindow(1, None, c)
    window.forward_bytes = 100 * MIB
    window.end_forward()
    assert c.forward_bytes == 100 * MIB
    window.note_served_from_memory()
    window.reset_cursor()
    assert c.passes == 1 and c.budget_bytes == int(12.5 * MIB)
    window.note_served_from_memory()
    assert c.served_prefetched == 0, "outside backward nothing counts"


def test_tolerated_waits_neither_grow_nor_prevent_shrinking():
    c = WindowController(initial_bytes=64 * MIB, min_bytes=8 * MIB, max_fraction=0.25, grow_factor=1.5,
                         shrink_factor=0.5, tolerated_waits=1)
    c.start_pass(forward_bytes=1024 * MIB)
    c.note_wait()
    assert c.budget_bytes == 64 * MIB
    c.note_served_prefetched()
    c.end_pass()
    assert c.budget_bytes == 32 * MIB
    c.start_pass(forward_bytes=1024 * MIB)
    c.note_wait()
    c.note_reads_idle()
    c.note_wait()
    assert c.budget_bytes == 48 * MIB
    c.note_wait()
    assert c.budget_bytes == 48 * MIB, "no read idled since the last grow"
