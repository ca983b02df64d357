"""Under CUDA memory history or the CUDA sanitizer, tba's recomputations run each layer to its end
(Note [Recomputation runs to the end] in tba/runtime/_early_stop.py): no ``_StopRecomputationError`` is
raised through an operator and results stay exact. Otherwise early stop is kept, and torch's module
global is never touched."""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

import tba
from tba.runtime import _early_stop


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


def _train(directory: str | None, decision: str | None):
    model = _model()
    offloader = None
    if directory is not None:
        offloader = tba.Offloader(directory, layers=list(model), min_offload_bytes=0,
                                  policy=tba.Plan((decision,) * 2, window_bytes=1 << 20))
    torch.manual_seed(1)
    x = torch.randn(4, 32)
    if offloader is None:
        loss = model(x).pow(2).sum()
    else:
        with offloader:
            loss = model(x).pow(2).sum()
    loss.backward()
    if offloader is not None:
        offloader.close()
    return loss.detach(), [p.grad for p in model.parameters()]


@pytest.mark.skipif(not _early_stop.HAS_EARLY_STOP_KEYWORD, reason="this torch's checkpoint has no early_stop=")
@pytest.mark.parametrize("needed", [True, False], ids=["under-cuda-tools", "otherwise"])
@pytest.mark.parametrize("decision", ["recompute", "offloaded_recompute"])
def test_early_stop_only_where_it_breaks(spill_dir, stops, monkeypatch, decision, needed):
    want_loss, want_grads = _train(None, None)
    monkeypatch.setattr(_early_stop, "run_to_end_needed", lambda: needed)
    loss, grads = _train(spill_dir, decision)
    assert len(stops) == (0 if needed else 2), "early stop raised under the tools, or not kept otherwise"
    assert torch.equal(loss, want_loss)
    assert all(torch.equal(a, b) for a, b in zip(grads, want_grads))
    assert torch_checkpoint._enable_checkpoint_early_stop is None, "torch's module global was touched"


def test_a_user_setting_of_the_global_takes_precedence(spill_dir, stops, monkeypatch):
    monkeypatch.setattr(_early_stop, "run_to_end_needed", lambda: True)
    with torch_checkpoint.set_checkpoint_early_stop(True):
        _train(spill_dir, "recompute")
    assert len(stops) == 2


def test_needed_only_with_cuda_and_one_of_the_tools(monkeypatch):
    assert not _early_stop.run_to_end_needed()  # no CUDA initialised in this process
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch._C, "_cuda_isHistoryEnabled", lambda: False, raising=False)
    monkeypatch.setitem(sys.modules, "torch.cuda._sanitizer",
                        types.SimpleNamespace(cuda_sanitizer=types.SimpleNamespace(enabled=False)))
    assert not _early_stop.run_to_end_needed()
    monkeypatch.setattr(torch._C, "_cuda_isHistoryEnabled", lambda: True, raising=False)
    assert _early_stop.run_to_end_needed()
    monkeypatch.setattr(torch._C, "_cuda_isHistoryEnabled", lambda: False, raising=False)
    sys.modules["torch.cuda._sanitizer"].cuda_sanitizer.enabled = True
    assert _early_stop.run_to_end_needed()
    assert _early_stop.checkpoint_keywords() == ({"early_stop": False} if _early_stop.HAS_EARLY_STOP_KEYWORD else {})
