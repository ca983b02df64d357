"""What happens to a saved storage's bytes in memory (tba/runtime/_release.py): released, pages discarded, kept."""

from __future__ import annotations

import threading
from concurrent.futures import Future

import pytest
import torch

import tba
from tba import _control
from tba.io import Engine, ThreadEngine
from tba.io._engine import Op
from tba.runtime import _release, _trim


def test_a_storage_resized_after_its_write_has_no_pages_discarded_past_its_memory(spill_dir, monkeypatch):
    """A written storage the program still held lingers until tba alone holds it, then its pages go back to the kernel.
    The program had shrunk it meanwhile (``untyped_storage().resize_``, which moves it to a new, smaller allocation):
    the pages went back from its new address over its old size, zeroing the heap after it (glibc aborted with
    "double free or corruption"; without tba, torch raises a clear error at backward instead)."""
    if not _trim.hands_back_pages():
        pytest.skip("a caching allocator: tba discards no pages")
    discarded: list[tuple[int, int]] = []
    monkeypatch.setattr(_release, "discard_pages", lambda address, nbytes: discarded.append((address, nbytes)) or 0)
    weight = torch.randn(1024, 64, requires_grad=True)
    with tba.offload_activations(spill_dir, backend="threads", min_offload_bytes=0) as off:
        hidden = torch.randn(1024, 1024) * 2  # 4 MiB that mm saves and the program still holds
        loss = (hidden @ weight).sum()
        off.flush()  # written: it lingers while the program holds it
        hidden.untyped_storage().resize_(8192)
        memory = (hidden.data_ptr(), hidden.untyped_storage().nbytes())
        del hidden
    # Leaving the block swept the lingering storage, now held by tba alone.
    outside = [(address, nbytes) for address, nbytes in discarded
               if not memory[0] <= address <= address + nbytes <= memory[0] + memory[1]]
    assert outside == [], f"pages discarded outside the storage's memory {memory}: {outside}"
    del loss



def test_forwards_before_one_backward_hold_one_window_not_one_each(spill_dir):
    """Note [A new forward lets go of what backward did not use]: the end of each forward held its last layer for a
    backward that did not come next; eight forwards of micro-batches summed into one loss held 3-4 MiB under a 2 MiB
    budget, one storage more every few."""
    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Tanh()) for _ in range(8)]
    budget = 2 << 20
    offloader = tba.Offloader(spill_dir, layers=blocks, policy="offload", min_offload_bytes=1,
                              prefetch_budget_bytes=budget)
    x = torch.randn(512, 512)  # 1 MiB activations
    losses, held = [], []
    try:
        for step in range(8):
            with offloader:
                h = x + step
                for block in blocks:
                    h = block(h)
                losses.append(h.square().sum())
            offloader.flush()
            held.append(offloader.stats.resident_bytes)
        sum(losses).backward()
    finally:
        offloader.close()
    assert max(held) <= budget, f"bytes held for backward after each forward: {held}"


class _GatedWrites(Engine):
    """Reads through a thread engine; each write reports success, without touching memory, once :attr:`gate` opens
    (the write of a storage the program changes before the engine gets to it, with the old memory still mapped)."""

    name = "gated"

    def __init__(self) -> None:
        self.inner = ThreadEngine(workers=1)
        self.gate = threading.Event()
        self.waiting: list[threading.Thread] = []

    def submit_many(self, requests):
        futures = []
        for request in requests:
            if request.op is not Op.WRITE:
                futures.extend(self.inner.submit_many([request]))
                continue
            future: Future = Future()
            thread = threading.Thread(target=lambda f=future, n=request.nbytes: self.gate.wait(30) and f.set_result(n))
            thread.start()
            self.waiting.append(thread)
            futures.append(future)
        return futures

    def close(self) -> None:
        self.gate.set()
        for thread in self.waiting:
            thread.join()
        self.inner.close()


def test_a_storage_resized_while_its_write_runs_is_not_read_back(spill_dir):
    """Note [A storage resized under its write is kept in memory]: the program shrank a saved storage
    (``untyped_storage().resize_``) after its save job had queued the write of its memory and before the engine
    wrote it: the write took whatever the old address held by then, and backward read that back as the saved tensor,
    giving a gradient of freed memory. Without tba, torch refuses the shrunken tensor at backward; so must tba."""
    weight = torch.randn(1024, 64, requires_grad=True)
    engine = _GatedWrites()
    try:
        with tba.offload_activations(spill_dir, backend=engine, min_offload_bytes=0) as off:
            hidden = torch.randn(1024, 1024) * 2  # 4 MiB that mm saves and the program still holds
            loss = (hidden @ weight).sum()
            _control.settle()  # the save job has run: the write waits at the gate
            hidden.untyped_storage().resize_(8192)
            engine.gate.set()
            off.flush()
        with pytest.raises(tba.TbaError, match="resized below it after it was saved"):
            loss.backward()
        assert off.stats.tensors_kept_on_error == 1
    finally:
        engine.close()


def test_a_storage_shrunk_after_its_write_is_refused_when_served_from_memory(spill_dir):
    """Note [A storage shrunk after its save is refused at unpack] in tba/runtime/_views.py: the end of forward holds
    the last storage for backward, so backward is served from the program's memory, written or not; shrunk after its
    write, ``set_`` grew it back to fit the saved view and backward read the new allocation's bytes past the first
    8 KiB, with no error."""
    weight = torch.randn(1024, 64, requires_grad=True)
    engine = _GatedWrites()
    try:
        with tba.offload_activations(spill_dir, backend=engine, min_offload_bytes=0) as off:
            hidden = torch.randn(1024, 1024) * 2
            loss = (hidden @ weight).sum()
            _control.settle()  # the save job has run: the write waits at the gate
        engine.gate.set()  # forward's end held the storage for backward; now it is written too
        off.flush()
        assert off.stats.tensors_kept_on_error == 0
        hidden.untyped_storage().resize_(8192)
        with pytest.raises(tba.TbaError, match="resized below it after it was saved"):
            loss.backward()
    finally:
        engine.close()
