"""The NVTX ``read`` range around each read's queueing, present only when ``nvtx`` is (tba/runtime/_reads.py)."""

from __future__ import annotations

import contextlib

import torch

import tba
from tba.runtime import _reads


def test_each_read_is_queued_inside_a_read_range_when_nvtx_is_installed(tmp_path, monkeypatch):
    ranges: list[str] = []
    sent: list[int] = []
    send = _reads.StoreReads._send_read

    @contextlib.contextmanager
    def record(name: str):
        ranges.append(name)
        yield
        ranges.append(f"/{name}")

    def send_and_count(self, entry, on_done):
        sent.append(len(ranges))
        return send(self, entry, on_done)

    monkeypatch.setattr(_reads, "nvtx_enabled", lambda: True)
    monkeypatch.setattr(_reads, "nvtx_range", record)
    monkeypatch.setattr(_reads.StoreReads, "_send_read", send_and_count)
    leaves = [torch.randn(16384, requires_grad=True) for _ in range(32)]
    offloader = tba.Offloader(str(tmp_path), prefetch_budget_bytes=1 << 17)
    with offloader:
        losses = [torch.tanh(leaf).sum() for leaf in leaves]
    torch.autograd.backward(losses)
    offloader.close()
    alone = [leaf.detach().requires_grad_() for leaf in leaves]
    torch.autograd.backward([torch.tanh(leaf).sum() for leaf in alone])
    assert all(torch.equal(leaf.grad, reference.grad) for leaf, reference in zip(leaves, alone))
    assert sent, "nothing was read back"
    assert ranges.count("read") == ranges.count("/read") == len(sent)
    assert all(ranges[at - 1] == "read" for at in sent), "a read was queued outside its range"
