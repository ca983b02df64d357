"""tba's per-storage objects stay out of the cycle collector, and still die by reference count alone.

Note [Objects the cycle collector need not see] in tba/_untrack.py: a view, its watch, its finalizer,
the root's weak reference, the store's byte alias and a kept tensor's record are untracked. What makes
that safe is that no reference cycle passes through them; the second half of each test checks the
consequence with the collector off: after backward every one of them is gone.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

import tba
from tba import _control, _untrack
from tba._control import settle
from tba.io._read_pool import _Returned
from tba.runtime import _hooks, _reads
from tba.runtime._views import Kept, SavedView

needs_extension = pytest.mark.skipif(not _untrack.NATIVE, reason="the native extension tba._gc is not built")


class _Slotted:
    __slots__ = ("value",)


@pytest.fixture
def packed(monkeypatch) -> list:
    """Every object tba's pack hook returns, in order."""
    found: list = []
    pack = _hooks.SavedTensorHooks.pack

    def recording(self, tensor):
        result = pack(self, tensor)
        found.append(result)
        return result

    monkeypatch.setattr(_hooks.SavedTensorHooks, "pack", recording)
    return found


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(128, 128), nn.GELU()) for _ in range(3)))


@needs_extension
def test_untrack_takes_only_tracked_objects_out():
    obj = _Slotted()
    obj.value = [1]
    assert gc.is_tracked(obj)
    _untrack.untrack(obj, 3, "text", None)
    assert not gc.is_tracked(obj)
    _untrack.untrack(obj)  # twice is harmless
    assert not gc.is_tracked(obj)


def test_without_the_extension_everything_stays_tracked():
    obj = _Slotted()
    _untrack._track_all(obj)
    assert gc.is_tracked(obj)


def _check_untracked(packed: list) -> list[weakref.ref]:
    """Assert that every offloaded view and the objects kept with it are untracked; weak references to the views."""
    views = [p for p in packed if isinstance(p, SavedView)]
    assert views, "nothing was offloaded"
    entries = {id(view.entry): view.entry for view in views if view.entry is not None}
    assert entries
    died = [f for f in _control._control.finalizers.values() if isinstance(f, _hooks._ViewDied)]
    assert died
    for view in views:
        assert not gc.is_tracked(view) and not gc.is_tracked(view.watch)
    for entry in entries.values():
        assert not gc.is_tracked(entry.root)
        assert entry.data is None or not gc.is_tracked(entry.data)
    assert not any(gc.is_tracked(f) for f in died)
    return [weakref.ref(view) for view in views]


@needs_extension
def test_offloaded_views_are_untracked_and_die_by_reference_count(spill_dir, packed, no_gc):
    model = _model()
    x = torch.randn(256, 128)
    with tba.Offloader(spill_dir, min_offload_bytes=0) as off:
        loss = model(x).square().sum()
    settle()
    refs = _check_untracked(packed)
    packed.clear()
    loss.backward()
    del loss
    off.flush()
    settle()
    assert all(ref() is None for ref in refs), "a view outlived backward with the collector off"
    assert off._store.live_entries == 0
    off.close()


@needs_extension
def test_bytes_read_back_are_untracked(spill_dir, monkeypatch, no_gc):
    """A storage read back holds its bytes through a tensor over a read buffer: untracked too, as is the
    finalizer that returns the buffer to its pool.

    The prefetch window may read a storage back before backward, so ``entry.data`` may be such a tensor
    when the test above checks it: that test failed in CI (about 1 run in 60 of it alone) until reads
    untracked it."""
    read_back: list[bool] = []
    on_read_done = _reads.StoreReads._on_read_done

    def recording(self, entry, error, data, event):
        on_read_done(self, entry, error, data, event)
        if error is None and data is not None:
            table = list(_control._control.finalizers.values())
            # Note [Objects the cycle collector need not see]: an untracked finalizer's referent is untracked.
            assert not any(not gc.is_tracked(f) and gc.is_tracked(f()) for f in table)
            calls = [f for f in table if isinstance(f, _Returned)]
            assert calls
            tracked = [gc.is_tracked(obj) for f in calls for obj in (f, f())]
            read_back.append(gc.is_tracked(data) or any(tracked))

    monkeypatch.setattr(_reads.StoreReads, "_on_read_done", recording)
    model = _model()
    x = torch.randn(256, 128)
    with tba.Offloader(spill_dir, min_offload_bytes=0, prefetch_budget_bytes=0) as off:
        loss = model(x).square().sum()
    off.flush()  # every write done and its memory dropped: backward reads each storage back
    loss.backward()
    settle()
    assert read_back, "nothing was read back"
    assert not any(read_back)
    off.close()


@needs_extension
def test_kept_tensors_are_untracked_and_die_by_reference_count(spill_dir, packed, no_gc):
    model = _model()
    x = torch.randn(256, 128)
    with tba.Offloader(spill_dir) as off, tba.keep_in_memory():
        loss = model(x).square().sum()
    assert any(isinstance(p, Kept) for p in packed)
    assert not any(gc.is_tracked(p) for p in packed if isinstance(p, Kept))
    refs = [weakref.ref(p.tensor) for p in packed if isinstance(p, Kept)]
    packed.clear()
    loss.backward()
    del loss
    settle()
    # Parameters are kept as themselves and live on; every activation kept must be gone.
    params = {id(p) for p in model.parameters()}
    assert all(ref() is None or id(ref()) in params or ref() is x for ref in refs)
    off.close()


@needs_extension
def test_a_recomputed_layers_kept_inputs_are_untracked_and_die_by_reference_count(spill_dir, monkeypatch, no_gc):
    """The pair of a ``recompute`` layer keeps its inputs as they are, ``grad_fn`` included (Note [Objects the
    cycle collector need not see]): its records are untracked too, and die with the graph, letting go of them."""
    from tba.runtime import _recompute, _recompute_inputs

    kept: list[tuple[weakref.ref, bool]] = []
    keep = _recompute_inputs.Kept

    def recording(tensor, version):
        record = keep(tensor, version)
        assert not gc.is_tracked(record)
        kept.append((weakref.ref(tensor), tensor.grad_fn is not None))
        return record

    monkeypatch.setattr(_recompute_inputs, "Kept", recording)  # the record a recompute layer's input pair makes
    model = _model()
    x = torch.randn(256, 128)
    with tba.Offloader(spill_dir, min_offload_bytes=0) as off, _recompute.RecomputeLayers([model[1]]):
        loss = model(x).square().sum()
    assert any(has_grad_fn for _, has_grad_fn in kept), "no kept input with a grad_fn"
    loss.backward()
    del loss
    settle()
    # torch's non-reentrant checkpoint leaves its input in a reference cycle of its own (plain torch too): the
    # collector frees it, which it could not while an untracked record still held it.
    gc.collect()
    assert all(ref() is None for ref, _ in kept), "a recomputed layer's kept input outlived backward and a collection"
    off.close()
