"""The unpack skips a route's ``consume`` only where it is :class:`~tba.device.Route`'s no-op (the host route's):
a host route that overrides it is still called."""

from __future__ import annotations

import torch

import tba
from tba.device._host import HostRoute


def test_a_host_route_that_overrides_consume_is_called(spill_dir, monkeypatch):
    consumed: list[int] = []

    def consume(self, event, tensor) -> None:
        consumed.append(tensor.numel())

    monkeypatch.setattr(HostRoute, "consume", consume)
    x = torch.randn(64, 256, requires_grad=True)
    with tba.offload_activations(directory=spill_dir, backend="threads", policy="offload"):
        y = (x * 2).tanh().sum()
    y.backward()
    assert consumed, "the overriding consume was never called"


def test_the_host_routes_consume_is_skipped_as_a_no_op(spill_dir):
    off = tba.Offloader(spill_dir, backend="threads", layers=[])
    with off:
        pass
    assert off._store.route_without_consume is off._store.routes.host
    off.close()
