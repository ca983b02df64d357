"""tba never hands back pages of memory it cannot prove is its own (issue 21, item 1).

After a write, tba used to ``madvise(MADV_DONTNEED)`` a storage's pages whenever it held the last
torch reference. Torch's reference count cannot see owners outside torch: a numpy array, a
bytearray, a DLPack producer, a memory-mapped file or a shared-memory segment keep their memory
alive after the tensor dies, and the discarded pages then read as zeros (the user's dataset was
zeroed). Only storages allocated by torch's own CPU allocator and not shared are released that way.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import tba

ROWS = 8192


def _train_on(spill_dir, make_data) -> None:
    """One step on ``make_data()``, a tensor nothing but autograd (and so tba) holds: tba holds its last reference."""
    model = nn.Linear(12, 1)
    with tba.offload_activations(spill_dir, min_offload_bytes=0) as off:
        loss = model(make_data()).pow(2).mean()
    off.flush()
    loss.backward()
    x = torch.randn(64, 1024, requires_grad=True)
    with tba.offload_activations(spill_dir, min_offload_bytes=0):
        y = x.sin()
    y.sum().backward()
    tba.shutdown()


def _view(array: np.ndarray, start: int, wrap) -> torch.Tensor:
    return wrap(array)[start:start + 2048]


@pytest.mark.parametrize("source", ["numpy", "dlpack", "frombuffer", "mmap", "shared_memory"])
def test_memory_owned_outside_torch_is_never_zeroed(spill_dir, tmp_path, source):
    array = np.random.rand(ROWS, 12).astype(np.float32) + 1
    start = next(i for i in range(64) if array[i:].ctypes.data % 64 == 0)
    if source == "numpy":
        owner, make = array, lambda: torch.from_numpy(array[start:start + 2048])
    elif source == "dlpack":
        owner, make = array, lambda: torch.from_dlpack(array[start:start + 2048])
    elif source == "frombuffer":
        owner = bytearray(array.tobytes())
        base = np.frombuffer(owner, dtype=np.float32)
        start = next(i for i in range(64) if base[i * 12:].ctypes.data % 64 == 0)
        make = lambda: torch.frombuffer(owner, dtype=torch.float32).view(ROWS, 12)[start:start + 2048]
    elif source == "mmap":
        path = tmp_path / "data.bin"
        path.write_bytes(array.tobytes())
        owner = np.memmap(path, dtype=np.float32, mode="r+", shape=(ROWS, 12))
        make = lambda: torch.from_numpy(owner)[:2048]
    else:
        shared = torch.from_numpy(array.copy()).share_memory_()
        owner, make = shared, lambda: shared[:2048].view(2048, 12)
    before = torch.as_tensor(np.array(owner, copy=True)) if source != "shared_memory" else owner.clone()
    _train_on(spill_dir, make)
    after = torch.as_tensor(np.array(owner, copy=True)) if source != "shared_memory" else owner
    if source == "frombuffer":
        before, after = before.view(torch.uint8), after.view(torch.uint8)
    assert torch.equal(after, before), f"{int((after != before).sum())} values of the user's {source} memory changed"


def test_the_issue_reproducer(spill_dir):
    data = np.random.rand(8192, 12).astype(np.float32) + 1
    i = next(i for i in range(8) if data[i:].ctypes.data % 64 == 0)
    model = nn.Linear(12, 1)
    with tba.offload_activations(spill_dir):
        loss = model(torch.from_numpy(data[i:i + 2048])).pow(2).mean()
    loss.backward()
    tba.shutdown()
    assert (data == 0).sum() == 0


def test_torch_owned_memory_is_still_released(spill_dir):
    """The page release still applies where it is sound: storages from torch's own allocator."""
    x = torch.randn(256, 1024, requires_grad=True)
    with tba.offload_activations(spill_dir) as off:
        h = x * 2
        for _ in range(4):
            h = h.sin()
        # Writes complete before backward: a storage whose entry dies with its write in flight is
        # only dropped, and on a loaded machine backward could overtake every write.
        off.flush()
    store = off._store
    h.sum().backward()
    assert store.pages_discarded_bytes >= 256 * 1024 * 4 - 4096 if hasattr(store, "pages_discarded_bytes") else True
