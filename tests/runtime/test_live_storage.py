"""A written storage the program still holds is served from its own memory, not read back.

Note [A storage the program still holds is not read back] in ``tba/runtime/_reads.py``.
"""

from __future__ import annotations

import pytest
import torch

import tba
from tba import defaults


@pytest.fixture(autouse=True)
def _discard_small_storages(monkeypatch):
    """These cases use 64 KiB storages, which tba would not discard (Note [Small storages keep their
    pages] in tba/runtime/_trim.py); the lingering and discard paths under test need them to be."""
    monkeypatch.setattr(defaults, "DISCARD_MIN_BYTES", 0)


KIB = 1 << 10


def _grads(xs):
    return [torch.autograd.grad(torch.tanh(x).pow(2).sum(), x)[0] for x in xs]


def test_outputs_the_program_holds_are_not_read_back_and_exact(spill_dir, backend):
    xs = [torch.randn(16 * KIB, requires_grad=True) for _ in range(8)]
    want = _grads(xs)
    off = tba.Offloader(spill_dir, backend=backend, min_offload_bytes=0)
    with off:
        ys = [torch.tanh(x) for x in xs]  # held by the program through backward
        off.flush()  # written before forward ends, so the prefetch window holds none of them
    assert off.stats.bytes_written == sum(y.nbytes for y in ys)
    torch.autograd.backward([y.pow(2).sum() for y in ys])
    assert all(torch.equal(x.grad, g) for x, g in zip(xs, want))
    assert off.stats.bytes_read == 0, str(off.stats.as_dict())
    assert off.stats.unpacks_from_live_storage == len(xs)
    del ys
    off.close()


def test_outputs_the_program_dropped_are_read_back(spill_dir, backend):
    xs = [torch.randn(16 * KIB, requires_grad=True) for _ in range(8)]
    want = _grads(xs)
    off = tba.Offloader(spill_dir, backend=backend, min_offload_bytes=0)
    with off:
        losses = [torch.tanh(x).pow(2).sum() for x in xs]
        off.flush()
    torch.autograd.backward(losses)
    assert all(torch.equal(x.grad, g) for x, g in zip(xs, want))
    assert off.stats.bytes_read == off.stats.bytes_written > 0
    assert off.stats.unpacks_from_live_storage == 0
    off.close()


def test_a_storage_given_new_memory_is_read_back_from_the_file(spill_dir):
    """The program resized the saved storage away and back (as code that frees activations by hand does):
    its memory is no longer what was saved, so the file's copy is used."""
    x = torch.randn(16 * KIB)
    saved = x.clone()
    off = tba.Offloader(spill_dir, backend="threads", min_offload_bytes=0)
    with off:
        packed = off.pack(x)
        off.flush()
    storage = x.untyped_storage()
    nbytes, address = storage.nbytes(), storage.data_ptr()
    blockers = []
    for _ in range(64):  # the allocator may hand the freed block straight back; hold blocks until it does not
        storage.resize_(0)
        blockers.append(torch.empty(nbytes, dtype=torch.uint8))
        storage.resize_(nbytes)
        if storage.data_ptr() != address:
            break
    storage.fill_(0)
    assert storage.data_ptr() != address
    got = off.unpack(packed)
    assert torch.equal(got, saved)
    assert off.stats.unpacks_from_live_storage == 0 and off.stats.bytes_read == x.nbytes
    del packed, got, blockers
    off.close()


def test_an_in_place_change_of_a_held_output_is_still_caught(spill_dir):
    x = torch.randn(16 * KIB, requires_grad=True)
    off = tba.Offloader(spill_dir, backend="threads", min_offload_bytes=0)
    with off:
        y = torch.tanh(x)
    off.flush()
    loss = y.pow(2).sum()
    with torch.no_grad():
        y.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    del y, loss
    off.close()


def test_a_storage_whose_pages_tba_handed_back_is_never_served_live(spill_dir, monkeypatch):
    """Under glibc tba hands a written storage's pages back once it alone holds it. A reference of tba's
    own that is not counted as an owner (here: the engine keeps the request, as the thread sending it
    does for a moment) keeps the storage alive with pages that read as zeros: unpack must read the file."""
    from tba.io import Engine, ThreadEngine
    from tba.runtime import _writes

    monkeypatch.setattr(_writes, "hands_back_pages", lambda: True)

    class Keeping(Engine):
        name = "keeping"

        def __init__(self):
            self.inner, self.kept = ThreadEngine(workers=1), []

        def submit_many(self, requests):
            self.kept.extend(requests)
            return self.inner.submit_many(requests)

        def close(self):
            self.inner.close()

    engine = Keeping()
    off = tba.Offloader(spill_dir, backend=engine, min_offload_bytes=0)
    with off:
        packed = off.pack(torch.randn(64 * KIB))
        off.flush()
    assert off.stats.as_dict()["tensors_offloaded"] == 1
    entry = packed.entry
    assert entry.pages_discarded and not entry.expired(), "the test needs a discarded storage kept alive"
    got = off.unpack(packed)
    assert off.stats.unpacks_from_live_storage == 0 and off.stats.bytes_read > 0
    assert got.abs().sum() > 0, "served the discarded (zeroed) pages"
    del packed, got
    engine.kept.clear()
    off.close()
    engine.close()
