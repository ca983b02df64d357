"""tba's recomputations run each layer to its end (Note [Recomputation runs to the end] in
tba/runtime/_early_stop.py): no ``_StopRecomputationError`` is raised through an operator, torch's
setting is put back afterwards, and threads interleaving the switch leave it as they found it."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

import tba
from tba.runtime._early_stop import RUN_TO_END


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, 32))
                           for _ in range(2)))


@pytest.fixture
def stops(monkeypatch):
    """Counts the early-stop exceptions torch's checkpoint raises."""
    raised = []

    class Counted(torch_checkpoint._StopRecomputationError):
        def __init__(self, *args: object) -> None:
            raised.append(1)
            super().__init__(*args)

    monkeypatch.setattr(torch_checkpoint, "_StopRecomputationError", Counted)
    return raised


def test_plain_checkpoint_stops_early_so_the_counter_sees_it(stops):
    model = _model()
    x = torch.randn(4, 32)
    torch_checkpoint.checkpoint(model, x, use_reentrant=False).sum().backward()
    assert len(stops) == 1


@pytest.mark.parametrize("decision", ["recompute", "offloaded_recompute"])
def test_tba_recomputation_raises_no_early_stop_and_is_exact(spill_dir, stops, decision):
    def train(offloader):
        model = _model()
        torch.manual_seed(1)
        x = torch.randn(4, 32)
        context = offloader if offloader is not None else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
        with context:
            loss = model(x).pow(2).sum()
        loss.backward()
        return loss.detach(), [p.grad for p in model.parameters()], model

    want_loss, want_grads, _ = train(None)
    model = _model()
    offloader = tba.Offloader(spill_dir, layers=list(model), min_offload_bytes=0,
                              policy=tba.Plan((decision,) * 2, window_bytes=1 << 20))
    torch.manual_seed(1)
    x = torch.randn(4, 32)
    with offloader:
        loss = model(x).pow(2).sum()
    loss.backward()
    offloader.close()
    assert stops == [], "a tba recomputation stopped early through an operator"
    assert torch.equal(loss.detach(), want_loss)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), want_grads))
    assert torch_checkpoint._enable_checkpoint_early_stop is None, "torch's setting was not put back"


def test_a_user_setting_is_kept():
    with torch_checkpoint.set_checkpoint_early_stop(True):
        with RUN_TO_END:
            assert torch_checkpoint._enable_checkpoint_early_stop is False
        assert torch_checkpoint._enable_checkpoint_early_stop is True
    assert torch_checkpoint._enable_checkpoint_early_stop is None


def test_interleaved_threads_put_back_what_they_found():
    """A enters, B enters, A leaves, B leaves: torch's own context manager would leave early stop off."""
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen = []

    def a():
        with RUN_TO_END:
            a_in.set()
            b_in.wait(5)
        a_out.set()

    def b():
        a_in.wait(5)
        with RUN_TO_END:
            b_in.set()
            a_out.wait(5)
            seen.append(torch_checkpoint._enable_checkpoint_early_stop)

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert seen == [False], "early stop came back on while B's recomputation was being set up"
    assert torch_checkpoint._enable_checkpoint_early_stop is None
    assert "in_flight=0" in repr(RUN_TO_END)
