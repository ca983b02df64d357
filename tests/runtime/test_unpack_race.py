"""An unpack served from memory while the storage's write is in flight never sees discarded pages.

Found by the differential fuzzer under CPU load (case 2722: wrong gradients about once in a few
hundred runs). ``start_load`` handed the storage's own tensor to the training thread; when the
write completed before ``rebuild`` had made its view, tba found itself the storage's only owner
(the training thread's reference was that same tensor), handed the pages to the kernel, and
backward read zeros. The prefetch window usually holds such a storage in memory, which hid the
race; the test turns holding off and completes each write exactly between the two steps.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future

import pytest
import torch
from utils import call_skipped_writes_written

import tba
from tba.io import Engine, ThreadEngine
from tba.runtime._store import StorageStore
from tba.runtime._views import SavedView


class HeldWrites(Engine):
    """Runs requests at once but reports each completion only when :meth:`complete_newest` says so."""

    name = "held"

    def __init__(self) -> None:
        self.inner = ThreadEngine(workers=2)
        self.pending: list[tuple[Future, Future]] = []
        self.lock = threading.Lock()

    def submit_many(self, requests):
        futures = []
        for request in requests:
            outer: Future = Future()
            done = self.inner.submit_many([request])[0]
            done.result()
            with self.lock:
                self.pending.append((done, outer))
            futures.append(outer)
        return futures

    def complete_newest(self) -> None:
        with self.lock:
            done, outer = self.pending.pop() if self.pending else (None, None)
        if outer is not None:
            outer.set_result(done.result())

    def close(self) -> None:
        while self.pending:
            self.complete_newest()
        self.inner.close()


def _exp_chain(rows: int = 256, backwards: int = 2) -> tuple[torch.Tensor, Callable[[], torch.Tensor], torch.Tensor]:
    """A leaf, a forward of four ``exp`` through it, and its gradient without tba over ``backwards`` backwards of one
    retained graph."""
    x = torch.randn(rows, 1024, requires_grad=True)

    def forward() -> torch.Tensor:
        h = x
        for _ in range(4):
            h = (h * 0.5).exp()
        return h.sum()

    loss = forward()
    for index in range(backwards):
        loss.backward(retain_graph=index + 1 < backwards)
    want, x.grad = x.grad, None
    return x, forward, want


def test_a_write_completing_between_start_load_and_rebuild_keeps_the_bytes(spill_dir, monkeypatch):
    engine = HeldWrites()
    original = SavedView.rebuild
    raced = []

    def rebuild(self, data):
        if self.entry.state.name == "WRITING":
            engine.complete_newest()
            tba._control.settle()
            raced.append(self.entry.state.name)
        return original(self, data)

    monkeypatch.setattr(SavedView, "rebuild", rebuild)
    monkeypatch.setattr(StorageStore, "prefetch", lambda self, entry, layer=None: None)
    x, forward, want = _exp_chain(rows=512, backwards=1)
    offloader = tba.Offloader(spill_dir, backend=engine, layers=[], min_offload_bytes=0)
    with offloader:
        loss = forward()
    loss.backward()
    offloader.close()
    assert raced and set(raced) == {"ON_DISK"}, "the interleaving under test did not happen"
    assert torch.equal(x.grad, want), "backward read discarded (zeroed) pages"


class HeldUntilReleased(HeldWrites):
    """:class:`HeldWrites` while ``holding``; then an ordinary engine."""

    holding = True

    def submit_many(self, requests):
        return super().submit_many(requests) if self.holding else self.inner.submit_many(requests)


def _forward_one_write_at_a_time(spill_dir, monkeypatch) -> tuple[HeldUntilReleased, torch.Tensor, torch.Tensor,
                                                                   tba.Offloader, torch.Tensor]:
    """The exp chain's forward under an offloader whose engine holds its writes' completions and takes one write
    at a time (the others wait in tba's queue); returns the engine, the leaf, its gradient without tba, the
    offloader and the loss."""
    monkeypatch.setattr(tba.runtime._host_io, "HOST_WRITE_AHEAD_BYTES", 1)
    engine = HeldUntilReleased()
    x, forward, want = _exp_chain()
    offloader = tba.Offloader(spill_dir, backend=engine, layers=[], min_offload_bytes=0)
    with offloader:
        loss = forward()
    tba._control.settle()
    return engine, x, want, offloader, loss


def _complete_held_writes(engine: HeldUntilReleased) -> None:
    """Complete each held write in turn, letting the control thread act on each, until none is in the engine."""
    while engine.pending:
        engine.complete_newest()
        tba._control.settle()


def test_a_storage_unpacked_while_its_write_waits_stays_for_a_retained_graph(spill_dir, monkeypatch):
    """Mutant: ``note_unpacked`` released an entry whose write had not completed (WRITING, not ON_DISK).

    The first backward of a retained graph unpacks storages whose writes still wait in tba's queue (one
    write at a time in the engine, and its completion held back). Their writes are then not needed (the
    storages are fully unpacked) and they stay in memory, KEPT: a release at the first unpack left a KEPT
    entry with no bytes and no file extent, which the second backward read back from offset -1.
    """
    monkeypatch.setattr(StorageStore, "prefetch", lambda self, entry, layer=None: None)
    engine, x, want, offloader, loss = _forward_one_write_at_a_time(spill_dir, monkeypatch)
    assert engine.pending and offloader._store._host.waiting_writes, "no write waited behind the held one"
    loss.backward(retain_graph=True)
    tba._control.settle()
    _complete_held_writes(engine)  # the waiting ones are found unneeded
    engine.holding = False  # the second backward's reads complete at once
    loss.backward()
    del loss
    offloader.close()
    assert torch.equal(x.grad, want)


def _backward_twice_after_skipped_writes(spill_dir, monkeypatch) -> tuple[torch.Tensor, torch.Tensor]:
    """The prefetch window holds the last storages at the end of forward while their writes wait in tba's queue,
    so those writes are skipped (the storages have no file extent); then two backwards of the retained graph.
    Returns the gradient with tba and the one without."""
    engine, x, want, offloader, loss = _forward_one_write_at_a_time(spill_dir, monkeypatch)
    _complete_held_writes(engine)  # the waiting ones the window holds are skipped
    engine.holding = False
    assert offloader.stats.writes_skipped, "no write was skipped"
    try:
        loss.backward(retain_graph=True)
        # The first backward's releases run on the control thread: under load the second backward could start before
        # them and find every storage still in memory, so a mutant that frees too much went unseen (CI, 3 runs in 15
        # beside two busy loops here).
        tba._control.settle()
        loss.backward()
    finally:
        del loss
        offloader.close()
    return x.grad, want


def test_a_held_storage_whose_write_was_skipped_stays_for_a_retained_graph(spill_dir, monkeypatch):
    """Mutant: a write skipped as not needed (``WRITE_NOT_NEEDED``) marked its storage ON_DISK, not KEPT.

    Marked ON_DISK, the first backward released its bytes after unpacking it, and the second backward of
    the retained graph read it back from a freed extent.
    """
    got, want = _backward_twice_after_skipped_writes(spill_dir, monkeypatch)
    assert torch.equal(got, want)


def test_a_storage_with_no_extent_left_is_never_read_back(spill_dir, monkeypatch):
    """Should bookkeeping ever take a storage whose extent was freed for one on disk (the mutant above, applied
    here), the read of offset -1 gave wrong gradients, silently; it raises instead (helper-58)."""
    call_skipped_writes_written(monkeypatch)
    with pytest.raises(tba.TbaError, match="neither memory nor the spill file"):
        _backward_twice_after_skipped_writes(spill_dir, monkeypatch)
