"""A StorageEntry owns its storage's weak reference: taken once, freed once, never leaked.

The entry holds the handle itself (``StorageEntry.cdata``) instead of a separate weak-reference
object, one object less per saved storage for the cycle collector (docs/host-cost.md). Found by an
adversarial review of that change: a handle taken before something that raised was never freed,
and the free failed at interpreter shutdown.
"""

from __future__ import annotations

import copy

import pytest
import torch

import tba
from tba.runtime import _entry, _writes
from tba.runtime._entry import PyStorageEntry, StorageEntry

RECORDS = [PyStorageEntry] + ([StorageEntry] if _entry.NATIVE else [])
"""The Python record, and the C one where tba._record is built (Note [One record, two builds] in tba/runtime/_entry.py)."""


@pytest.fixture(params=RECORDS, ids=lambda record: record.__module__)
def record(request, monkeypatch):
    """Each record in turn, as the one the store makes."""
    monkeypatch.setattr(_writes, "StorageEntry", request.param)
    return request.param


def _count_weak_refs(monkeypatch, request) -> dict[str, int]:
    counts = {"taken": 0, "freed": 0}
    take, free = torch.UntypedStorage._weak_ref, torch.UntypedStorage._free_weak_ref

    def taken(self, *args):
        counts["taken"] += 1
        return take(self, *args)

    def freed(cdata):
        counts["freed"] += 1
        return free(cdata)

    monkeypatch.setattr(torch.UntypedStorage, "_weak_ref", taken)
    monkeypatch.setattr(torch.UntypedStorage, "_free_weak_ref", staticmethod(freed))
    monkeypatch.setattr(PyStorageEntry.__del__, "__defaults__", (freed,))
    if _entry.NATIVE:
        _entry._configure(freed)
        request.addfinalizer(_entry._configure)
    return counts


def test_a_save_that_fails_while_its_entry_is_built_leaks_no_weak_reference(tmp_path, monkeypatch, request, record):
    counts = _count_weak_refs(monkeypatch, request)
    monkeypatch.setattr(_writes, "hands_back_pages", lambda: True)

    def fails(data):
        raise ValueError("owns_its_memory failed")

    monkeypatch.setattr(_writes, "owns_its_memory", fails)
    x = torch.randn(4096, requires_grad=True)
    with tba.offload_activations(tmp_path, min_offload_bytes=0):
        y = torch.tanh(x)
    y.sum().backward()
    del y
    tba.shutdown()
    assert counts["taken"] == counts["freed"], counts


def test_an_entry_frees_its_weak_reference_once(tmp_path, monkeypatch, request, record):
    counts = _count_weak_refs(monkeypatch, request)
    x = torch.randn(4096, requires_grad=True)
    with tba.offload_activations(tmp_path, min_offload_bytes=0):
        y = torch.tanh(x) * 2
    y.sum().backward()
    del y
    tba.shutdown()
    assert counts["taken"] == counts["freed"] > 0, counts


@pytest.mark.parametrize("StorageEntry", RECORDS, ids=lambda record: record.__module__)
def test_an_entry_cannot_be_copied_and_a_half_built_one_dies_quietly(StorageEntry):
    storage = torch.UntypedStorage(16)
    entry = StorageEntry(seq=0, layer=None, nbytes=16, phase_bytes=0, version=0, cdata=storage._weak_ref(), data=None)
    with pytest.raises(TypeError, match="cannot be copied"):
        copy.copy(entry)
    with pytest.raises(TypeError, match="cannot be copied"):
        copy.deepcopy(entry)
    with pytest.raises(TypeError):
        StorageEntry(seq=0, layer=None, nbytes=16, phase_bytes=0, version=0, ref=None, data=None)

