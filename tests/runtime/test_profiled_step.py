"""The profiled step's peak stops where backward ends (Note [The peak stops where backward ends] in
``tba/runtime/_profiled_step.py``)."""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn

from tba.runtime._profiled_step import ProfiledStep

MIB = 1 << 20


def _started(step: ProfiledStep) -> None:
    counters = lambda: types.SimpleNamespace(pool_idle_bytes=0)  # noqa: E731
    step.start(counters, None, None, first=True, synchronize=None, cuda=False, release=False)


@pytest.mark.parametrize("input_needs_grad", [True, False])
def test_the_peak_is_read_when_backward_ends_whether_or_not_the_first_input_needs_grad(input_needs_grad):
    layer, head = nn.Linear(256, 1024), nn.Linear(1024, 1)
    x = torch.randn(1024, 256, requires_grad=input_needs_grad)
    step = ProfiledStep()
    _started(step)
    step.note_shape(("shape",), layer, (x,), {})
    loss = head(torch.relu(layer(x))).sum()
    assert step.peak.peak_bytes is None
    loss.backward()
    # Read at the end of backward, not at the next entry: a measurement of the user's that resets the
    # kernel's peak counter before then (rok's, around every step) no longer erases the step's peak.
    assert step.peak.peak_bytes is not None
    step.end_forward(False, lambda: False, lambda: 0, 0, None)
    assert not layer._forward_hooks


def test_the_output_hook_leaves_the_layer_when_its_forward_fails_or_is_skipped():
    layer = nn.Linear(8, 8)
    step = ProfiledStep()
    _started(step)
    step.note_shape(("shape",), layer, (torch.randn(2, 8),), {})
    assert len(layer._forward_hooks) == 1
    step.end_forward(True, lambda: False, lambda: 0, 0, None)  # forward failed before the layer ran
    assert not layer._forward_hooks
    _started(step)
    step.note_shape(("shape",), layer, (torch.randn(2, 8),), {})
    step.cancel()
    assert not layer._forward_hooks


def test_a_first_layer_without_grad_anywhere_still_stops_at_the_next_entry():
    layer = nn.Linear(8, 8).requires_grad_(False)
    step = ProfiledStep()
    _started(step)
    step.note_shape(("shape",), layer, (torch.randn(2, 8),), {})
    layer(torch.randn(2, 8))
    assert not layer._forward_hooks and step.peak.peak_bytes is None
    step.end_forward(False, lambda: False, lambda: 0, 0, None)  # the step's exit: its timer's global hook comes off


class _DictLayer(nn.Module):
    """A first layer given its tensors in a dict, returning a dict."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(256, 1024)

    def forward(self, state):
        return {"hidden": self.linear(state["hidden"]), "mask": state["mask"]}


@pytest.mark.parametrize("input_needs_grad", [True, False])
@pytest.mark.parametrize("container", ["tuple", "dict"])
def test_the_peak_is_read_when_backward_ends_for_tensors_in_a_container(container, input_needs_grad):
    """Only the first layer's top-level arguments (and a tuple or list output) were searched for a tensor that
    requires grad: a layer given ``(hidden, mask)`` or a dict, or returning a dict, had the peak read at the
    next step's entry, after whatever ran between (Note [The peak stops where backward ends])."""
    layer, head = _DictLayer(), nn.Linear(1024, 1)
    x = torch.randn(1024, 256, requires_grad=input_needs_grad)
    state = {"hidden": x, "mask": torch.ones(1024, 1)}
    args = ((x, state["mask"]),) if container == "tuple" else (state,)
    step = ProfiledStep()
    _started(step)
    step.note_shape(("shape",), layer, args, {})
    loss = head(torch.relu(layer(state)["hidden"])).sum()
    assert step.peak.peak_bytes is None
    loss.backward()
    assert step.peak.peak_bytes is not None
    step.end_forward(False, lambda: False, lambda: 0, 0, None)
    assert not layer._forward_hooks
