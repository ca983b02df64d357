"""LayerTimer: wall-clock and training-thread CPU time per layer (tba/runtime/_timer.py)."""

from __future__ import annotations

import time

import torch
from torch import nn

from tba.runtime._timer import LayerTimer


class Sleepy(nn.Module):
    """A layer whose thread is off the CPU for most of its forward, as when tba's I/O threads preempt it."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.05)
        return torch.tanh(self.linear(x))


def test_cpu_time_leaves_out_time_off_the_cpu_and_the_span_covers_the_layers():
    layers = nn.Sequential(Sleepy(), Sleepy())
    timer = LayerTimer(list(layers))
    timer.attach()
    x = torch.randn(4, 8, requires_grad=True)
    layers(x).sum().backward()
    timer.detach()
    assert all(wall >= 0.05 for wall in timer.forward_s)
    assert all(cpu < 0.02 for cpu in timer.forward_cpu_s)  # the sleep is not compute
    assert all(b is not None and b >= 0 for b in timer.backward_s()) and all(b is not None for b in timer.backward_s(cpu=True))
    span = timer.span_s()
    assert span is not None and 0.1 <= span < 0.1 + 1.0


def test_span_is_none_when_backward_did_not_reach_the_first_layer():
    layers = nn.Sequential(Sleepy(), Sleepy())
    timer = LayerTimer(list(layers))
    timer.attach()
    layers(torch.randn(4, 8)).sum()  # no backward
    timer.detach()
    assert timer.span_s() is None
