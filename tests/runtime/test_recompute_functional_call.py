"""A recomputed layer called through ``torch.func.functional_call`` (fast weights, as in MAML or a weight
ensemble): the call swaps the given tensors into the modules' ``_parameters`` for the forward and swaps the
model's own back when it returns, before backward. The recomputation must run with the tensors the first
call ran with (Note [A recomputation runs with the parameters its first call ran with] in
tba/runtime/_first_call.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call

import tba


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(32, 32)
        self.l2 = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.l2(torch.tanh(self.l1(x)))


def _grads(directory: str | None, decision: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block(), Block())
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1))
    fast = {name: p * 1.5 for name, p in model.named_parameters()}  # a function of the parameters
    options = {"layers": list(model), "policy": tba.Plan((decision,) * 3, 1 << 20), "min_offload_bytes": 0}
    with tba.offload_activations(directory, **options) if directory else torch.enable_grad():
        loss = functional_call(model, fast, (x,)).pow(2).mean()
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()]


@pytest.mark.parametrize("decision", ["keep", "offload", "recompute", "offloaded_recompute"])
def test_functional_call_fast_weights_are_exact(spill_dir, decision):
    want_loss, want = _grads(None, decision)
    got_loss, got = _grads(spill_dir, decision)
    assert torch.equal(want_loss, got_loss)
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))


def test_the_layers_own_parameters_are_back_after_the_recomputation(spill_dir):
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block())
    own = {name: p for name, p in model.named_parameters()}
    fast = {name: p * 0.5 for name, p in model.named_parameters()}
    with tba.offload_activations(spill_dir, layers=list(model), policy=tba.Plan(("recompute",) * 2, 1 << 20)):
        loss = functional_call(model, fast, (torch.randn(4, 32),)).sum()
    loss.backward()
    assert all(p is own[name] for name, p in model.named_parameters())
    assert all(own[name].grad is not None for name in own)


@pytest.mark.parametrize("mode", [torch.inference_mode, torch.no_grad])
def test_an_evaluation_under_inference_mode_with_fast_weights_runs(spill_dir, mode):
    """A forward without grad of a layer planned to recompute, with fast weights made in that mode (inference
    tensors under ``inference_mode``, whose version torch does not track): it runs as without tba, and the
    training step after it is exact. Found by the fuzzer (an evaluation forward mixed into a step):
    'Inference tensors do not track version counter' from tba's first-call bookkeeping."""
    def run(directory: str | None) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        torch.manual_seed(0)
        model = nn.Sequential(Block(), Block())
        x = torch.randn(4, 32, generator=torch.Generator().manual_seed(1))
        options = {"layers": list(model), "policy": tba.Plan(("recompute",) * 2, 1 << 20)}
        with tba.offload_activations(directory, **options) if directory else torch.enable_grad():
            with mode():
                evaluated = functional_call(model, {name: p * 0.5 for name, p in model.named_parameters()}, (x,))
            loss = model(x).pow(2).mean()
        loss.backward()
        return evaluated.clone(), loss.detach(), [p.grad for p in model.parameters()]

    want, got = run(None), run(spill_dir)
    assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
    assert all(torch.equal(a, b) for a, b in zip(want[2], got[2], strict=True))


def test_an_evaluation_under_inference_mode_with_fast_weights_runs_while_profiled(spill_dir):
    """The same evaluation in the steps the adaptive policy profiles: its layer timer read each parameter's version
    as the layer was called, and an inference tensor's raised 'Inference tensors do not track version counter'."""
    def run(directory: str | None) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(Block(), Block(), Block())
        results = []
        for step in range(4):
            x = torch.randn(4, 32, generator=torch.Generator().manual_seed(step))
            with tba.offload_activations(directory, layers=list(model)) if directory else torch.enable_grad():
                loss = model(x).pow(2).mean()
                with torch.inference_mode():
                    results.append(functional_call(model, {n: p * 0.5 for n, p in model.named_parameters()}, (x,)))
            loss.backward()
            results += [loss.detach(), *(p.grad.clone() for p in model.parameters())]
            model.zero_grad()
        return results

    want, got = run(None), run(spill_dir)
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
