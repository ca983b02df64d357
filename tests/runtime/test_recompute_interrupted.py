"""An exception (a signal handler's KeyboardInterrupt) at any line of a recomputation's set-up leaves the model as
forward left it: Note [A recomputation interrupted while it sets up leaves the state it found] in
tba/runtime/_first_call.py.

Without tba an interrupted backward changes no buffer and draws nothing from the random generators; the next step
then trains from there. A recomputation loads the state its layer's first call started from (BatchNorm's running
statistics, the generators' states) before it runs the forward, and puts the present state back afterwards.
"""

from __future__ import annotations

import sys

import torch
from injection import Injected, raise_at_line
from torch import nn

import tba
from tba.runtime import _recompute


def _model() -> nn.Module:
    torch.manual_seed(0)
    block = lambda: nn.Sequential(nn.Linear(32, 32), nn.BatchNorm1d(32), nn.GELU(), nn.Dropout(0.25))  # noqa: E731
    return nn.Sequential(block(), block())


def _raise_at_line(k: int):
    """A trace function that raises :class:`Injected` at the k-th line run by a recomputation's ``again``."""
    return raise_at_line(k, lambda code: code.co_name == "again" and code.co_filename == _recompute.__file__)


def test_an_exception_at_any_line_of_a_recomputations_set_up_leaves_the_state_forward_left(spill_dir):
    model, x = _model(), torch.randn(16, 32)
    plan = tba.Plan(("recompute", "offload"), window_bytes=0)

    def forward() -> torch.Tensor:
        with tba.offload_activations(spill_dir, backend="threads", layers=list(model), policy=plan, min_offload_bytes=0):
            return model(x).square().mean()

    forward().backward()
    for k in range(1, 200):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(k)
        loss = forward()
        buffers, generator = [b.clone() for b in model.buffers()], torch.get_rng_state()
        trace, seen = _raise_at_line(k)
        caught = False
        try:
            sys.settrace(trace)
            loss.backward()
        except Injected:
            caught = True
        finally:
            sys.settrace(None)
        del loss
        if not caught:
            break
        changed = [i for i, (b, then) in enumerate(zip(model.buffers(), buffers)) if not torch.equal(b, then)]
        assert not changed, f"line {k} of the recomputation: buffers {changed} are not as forward left them"
        assert torch.equal(torch.get_rng_state(), generator), f"line {k}: the generator is not as forward left it"
    assert k > 10, f"only {k} lines of the recomputation were run"
    reference = _model()
    reference.load_state_dict(model.state_dict())
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    forward().backward()
    torch.manual_seed(0)
    reference(x).square().mean().backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), reference.parameters()))
    assert all(torch.equal(b, c) for b, c in zip(model.buffers(), reference.buffers()))
