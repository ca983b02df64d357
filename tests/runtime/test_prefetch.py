"""PrefetchWindow decisions on synthetic entries, with exact expectations."""

from __future__ import annotations

from concurrent.futures import Future

import torch

from tba.runtime._entry import State, StorageEntry
from tba.runtime._prefetch import PrefetchWindow

MIB = 1 << 20


def entry(seq: int, layer: int | None, nbytes: int = MIB, state: State = State.ON_DISK) -> StorageEntry:
    e = StorageEntry(seq=seq, layer=layer, nbytes=nbytes, phase_bytes=0, version=0,
                     cdata=torch.UntypedStorage(0)._weak_ref(), data=None, state=state)
    e.live_views = 1
    return e


def window_of(entries, **kwargs) -> PrefetchWindow:
    window = PrefetchWindow(**kwargs)
    for e in entries:
        window.add(e)
    return window


def seqs(entries) -> list[int]:
    return [e.seq for e in entries]


def test_reads_the_layer_below_the_one_being_unpacked():
    entries = [entry(i, layer=i // 2) for i in range(8)]  # layers 0..3, two storages each
    window = window_of(entries, depth_layers=1, prefetch_budget_bytes=100 * MIB)
    to_read, to_hold = window.select(entries[7])
    assert seqs(to_read) == [6, 5, 4]
    assert to_hold == []


def test_depth_two_reads_two_layers():
    entries = [entry(i, layer=i // 2) for i in range(8)]
    window = window_of(entries, depth_layers=2, prefetch_budget_bytes=100 * MIB)
    to_read, _ = window.select(entries[6])
    assert seqs(to_read) == [5, 4, 3, 2]


def test_budget_bounds_bytes_but_always_allows_one():
    entries = [entry(i, layer=None, nbytes=3 * MIB) for i in range(6)]
    window = window_of(entries, prefetch_budget_bytes=7 * MIB)
    to_read, _ = window.select(entries[5])
    assert seqs(to_read) == [4, 3]
    huge = [entry(i, layer=None, nbytes=50 * MIB) for i in range(3)]
    to_read, _ = window_of(huge, prefetch_budget_bytes=7 * MIB).select(huge[2])
    assert seqs(to_read) == [1]


def test_in_flight_and_resident_entries_count_against_the_budget_and_are_not_reread():
    entries = [entry(i, layer=None) for i in range(6)]
    entries[4].data = torch.empty(0)
    entries[3].read_done = Future()
    window = window_of(entries, prefetch_budget_bytes=4 * MIB)
    to_read, _ = window.select(entries[5])
    assert seqs(to_read) == [2, 1]


def test_writing_entries_are_held_not_read_and_end_of_forward_holds_the_last_layer():
    entries = [entry(i, layer=i // 2) for i in range(6)]
    entries[5].state = State.WRITING
    entries[4].state = State.WRITING
    window = window_of(entries, depth_layers=1, prefetch_budget_bytes=100 * MIB)
    to_read, to_hold = window.select(None)
    assert seqs(to_hold) == [5, 4]
    assert to_read == []


def test_backward_through_kept_layers_reads_the_offloaded_layer_below_only_when_it_gets_there():
    """Note [Backward through kept layers]: plan OKKK holds layer 0's storages only."""
    entries = [entry(i, layer=0) for i in range(3)]
    window = window_of(entries, depth_layers=1, prefetch_budget_bytes=100 * MIB)
    assert window.select(None, layer=4) == ([], [])  # forward's last layer was 3: backward starts above it
    assert window.select(None, layer=3) == ([], [])
    assert window.select(None, layer=2) == ([], [])
    to_read, _ = window.select(None, layer=1)
    assert seqs(to_read) == [2, 1, 0]
    assert window.select(None, layer=0) == ([], [])  # already picked
    unknown = window_of([entry(i, layer=0) for i in range(3)], depth_layers=1, prefetch_budget_bytes=100 * MIB)
    assert seqs(unknown.select(None)[0]) == [2, 1, 0]  # no layer given: the last one the window holds, as before


def test_cursor_only_moves_down_and_skips_consumed_dead_and_kept():
    entries = [entry(i, layer=None) for i in range(6)]
    entries[3].fully_unpacked = True
    entries[2].state = State.DEAD
    entries[1].state = State.KEPT
    window = window_of(entries, prefetch_budget_bytes=100 * MIB)
    to_read, _ = window.select(entries[4])
    assert seqs(to_read) == [0]
    to_read, _ = window.select(entries[5])
    assert to_read == [], "the cursor moved up (storage 4 was picked), or storage 0 was picked twice"


def test_forget_compacts_without_changing_decisions():
    entries = [entry(i, layer=None) for i in range(10)]
    window = window_of(entries, prefetch_budget_bytes=2 * MIB)
    for e in entries[2:8]:
        e.state = State.DEAD
        window.forget(e)
    assert len(window) == 4
    to_read, _ = window.select(entries[9])
    assert seqs(to_read) == [8, 1]


def test_the_walk_resumes_and_counts_each_entry_once():
    """Note [The walk resumes where it stopped]: consumed entries free budget, nothing is picked twice."""
    entries = [entry(i, layer=None) for i in range(100)]
    window = window_of(entries, prefetch_budget_bytes=3 * MIB)
    picked = []
    for e in reversed(entries):
        to_read, _ = window.select(e)
        for r in to_read:
            r.read_done = Future()
        picked += seqs(to_read)
        e.fully_unpacked = True
        window.discount(e)
        assert window._held <= 3 * MIB
    assert picked == list(range(98, -1, -1))
    window.select(entries[50])  # the cursor never moves up
    assert window._cursor_seq == 0


def test_a_held_storage_whose_write_was_skipped_still_counts_against_the_budget():
    """Held for backward, its write skipped (KEPT), it is still in memory until unpacked: a new walk
    (here the start of backward) counts it, so it does not let another budget's worth be read."""
    entries = [entry(i, None) for i in range(4)]
    entries[3].state = State.KEPT
    entries[3].hold_for_backward = True
    window = window_of(entries, prefetch_budget_bytes=2 * MIB)
    to_read, _ = window.select(None)
    assert seqs(to_read) == [2]


def test_a_new_pass_walks_again_from_the_end_past_what_the_last_pass_used():
    """Note [Each backward pass reads ahead]: the cursor of a finished pass, at the bottom, read nothing for the next."""
    entries = [entry(i, layer=i // 2) for i in range(6)]
    window = window_of(entries, depth_layers=1, prefetch_budget_bytes=100 * MIB)
    window.select(entries[0])
    assert window.select(entries[5]) == ([], [])
    window.new_pass()
    to_read, _ = window.select(entries[5])
    assert seqs(to_read) == [4, 3, 2]
