"""LayerTimer: wall-clock and training-thread CPU time per layer (tba/runtime/_timer.py)."""

from __future__ import annotations

import threading
import time

import pytest
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


class WaitsInTba(nn.Module):
    """A layer that blocks in tba's ``wait`` for ``seconds`` (as an unpack waits for its read), forward and backward."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds
        self.linear = nn.Linear(8, 8)

    def _block(self) -> None:
        from tba._control import wait
        from tba._outcome import Outcome

        future = Outcome()
        threading.Timer(self.seconds, future.set_result, (None,)).start()
        wait(future)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._block()
        y = self.linear(x)
        if y.requires_grad:
            y.register_hook(lambda grad: self._block())
        return y


def test_seconds_blocked_in_tba_are_not_layer_time_but_are_in_the_span():
    layers = nn.Sequential(WaitsInTba(0.1), WaitsInTba(0.1))
    synced = []
    timer = LayerTimer(list(layers), synchronize=lambda: synced.append(1))
    timer.attach()
    layers(torch.randn(4, 8, requires_grad=True)).sum().backward()
    timer.detach()
    assert all(f is not None and 0 <= f < 0.05 for f in timer.forward_s)  # without the 0.1 s waits
    assert all(b is not None and 0 <= b < 0.05 for b in timer.backward_s())
    span = timer.span_s()
    assert span is not None and span >= 0.3  # two forward waits and at least one backward wait
    assert len(synced) == 8  # every stamp: two per layer forward, two per layer backward


def test_waited_s_counts_only_the_calling_thread():
    from tba._control import wait, waited_s
    from tba._outcome import Outcome

    before = waited_s()
    other: list[float] = []

    def block_elsewhere() -> None:
        future = Outcome()
        start = waited_s()
        threading.Timer(0.05, future.set_result, (None,)).start()
        wait(future)
        other.append(waited_s() - start)

    thread = threading.Thread(target=block_elsewhere)
    thread.start()
    thread.join()
    # Most of the 50 ms (the timer was started after the first reading; clocks differ by microseconds).
    assert other[0] >= 0.04 and waited_s() == before


class Chained(nn.Module):
    """A block given its ``hidden`` and ``mask`` tensors in one container, returning the same kind."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(64, 64)

    def forward(self, state):
        hidden, mask = (state["hidden"], state["mask"]) if isinstance(state, dict) else state
        hidden = torch.tanh(self.linear(hidden)) * mask
        return {"hidden": hidden, "mask": mask} if isinstance(state, dict) else (hidden, mask)


@pytest.mark.parametrize("container", ["tuple", "dict"])
def test_input_bytes_and_backward_times_of_layers_given_their_tensors_in_a_container(container):
    """Only a layer's top-level tensor arguments were counted as its input, and its first top-level tensor argument
    (or tuple or list output) timed its backward: blocks chained with ``(hidden, mask)`` or a dict had input 0
    bytes, so the planner took recomputing them for free of memory (a recomputed layer holds its input), past a
    memory budget, and their backward times were unmeasured (Note [An input shape is read inside containers])."""
    layers = nn.Sequential(Chained(), Chained())
    timer = LayerTimer(list(layers))
    timer.attach()
    hidden, mask = torch.randn(32, 64, requires_grad=True), torch.ones(32, 64)
    out = layers({"hidden": hidden, "mask": mask} if container == "dict" else (hidden, mask))
    (out["hidden"] if container == "dict" else out[0]).sum().backward()
    timer.detach()
    assert timer.input_bytes == [2 * 32 * 64 * 4] * 2  # hidden and mask
    assert all(b is not None for b in timer.backward_s())
