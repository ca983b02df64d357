"""The NVTX ``read`` range around each read's queueing, present only when ``nvtx`` is (tba/runtime/_reads.py; Note [No
range without nvtx] in tba/_trace.py)."""

from __future__ import annotations

import contextlib

import torch

import tba
from tba import _trace
from tba.runtime import _reads


def test_each_read_is_queued_inside_a_read_range_when_nvtx_is_installed(tmp_path, monkeypatch):
    ranges: list[str] = []
    sent: list[int] = []
    send = _reads.StoreReads._send_read

    @contextlib.contextmanager
    def record(name: str, domain: str):
        assert domain == "tba"
        ranges.append(name)
        yield
        ranges.append(f"/{name}")

    def send_and_count(self, entry, on_done):
        sent.append(len(ranges))
        return send(self, entry, on_done)

    monkeypatch.setattr(_trace, "_annotate", lambda: record)  # as if nvtx were installed
    monkeypatch.setattr(_reads.StoreReads, "_send_read", send_and_count)
    leaves = [torch.randn(16384, requires_grad=True) for _ in range(32)]
    offloader = tba.Offloader(str(tmp_path), prefetch_budget_bytes=1 << 17)
    with offloader:
        losses = [torch.tanh(leaf).sum() for leaf in leaves]
    offloader.flush()  # every write done: backward reads back what the window does not hold, on a loaded machine too
    torch.autograd.backward(losses)
    offloader.close()
    alone = [leaf.detach().requires_grad_() for leaf in leaves]
    torch.autograd.backward([torch.tanh(leaf).sum() for leaf in alone])
    assert all(torch.equal(leaf.grad, reference.grad) for leaf, reference in zip(leaves, alone))
    assert sent, "nothing was read back"
    assert ranges.count("read") == ranges.count("/read") == len(sent)
    assert all(ranges[at - 1] == "read" for at in sent), "a read was queued outside its range"
