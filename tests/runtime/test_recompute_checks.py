"""What the checks around a recomputed layer catch: weights its own forward changes in place, before or after using
them (Note [A recomputed layer that changes its own parameters] in tba/runtime/_first_call.py), a layer frozen between
forward and backward, and two active contexts recomputing the same layers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tba
from tba import TbaError

RECOMPUTED = ("recompute", "offloaded_recompute")


class MaxNorm(nn.Module):
    """Divides its weight by its row norms (times 1.01) before using it: not idempotent."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.linear.weight.div_(self.linear.weight.norm(dim=1, keepdim=True).clamp(min=1.0) * 1.01)
        return h + torch.tanh(self.linear(h))


class Clamped(nn.Module):
    """Clamps its weight in place, before or after using it (after: legal without tba where the product saved no
    weight, the first layer's, whose input needs no gradient)."""

    def __init__(self, after_use: bool = False) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)
        self.after_use = after_use

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if not self.after_use:
            with torch.no_grad():
                self.linear.weight.clamp_(-0.5, 0.5)
        out = h + torch.tanh(self.linear(h))
        if self.after_use:
            with torch.no_grad():
                self.linear.weight.clamp_(-0.5, 0.5)
        return out


class ClampedAfterUse(Clamped):
    def __init__(self) -> None:
        super().__init__(after_use=True)


def _grads(block: type[nn.Module], directory: str | None, decision: str) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.ModuleList(block() for _ in range(2))
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3)
    h = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    options = {"layers": list(model), "policy": tba.Plan((decision,) * 2, 1 << 20), "min_offload_bytes": 0}
    with tba.offload_activations(directory, **options) if directory else torch.enable_grad():
        for layer in model:
            h = layer(h)
        loss = h.sum()
    loss.backward()
    return [p.grad for p in model.parameters()]


@pytest.mark.parametrize("decision", RECOMPUTED)
@pytest.mark.parametrize("block", [MaxNorm, Clamped, ClampedAfterUse])
def test_a_forward_changing_its_own_weight_raises_at_once(spill_dir, decision, block):
    """A recomputation starts from the changed weight; after torch's early stop nothing could tell whether it
    computed what the first call did (a clamp after use, the weight divided once more): wrong gradients before."""
    with pytest.raises(TbaError, match="changed its parameter 'linear.weight' in place"):
        _grads(block, spill_dir, decision)


def test_such_a_layer_kept_or_offloaded_is_exact(spill_dir):
    for block in (MaxNorm, Clamped):
        for decision in ("keep", "offload"):
            assert all(torch.equal(a, b) for a, b in zip(_grads(block, spill_dir, decision), _grads(block, None, decision)))


@pytest.mark.parametrize("decision", RECOMPUTED)
def test_a_layer_frozen_between_forward_and_backward_raises(spill_dir, decision):
    """Its recomputation would save fewer tensors than its first forward: torch's CheckpointError, which named no
    cause, before this check."""
    torch.manual_seed(0)
    model = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16)) for _ in range(2))
    h = torch.randn(8, 16)
    with tba.offload_activations(spill_dir, layers=list(model), policy=tba.Plan((decision, "keep"), 1 << 20)):
        for layer in model:
            h = h + layer(h)
    model[0].requires_grad_(False)
    with pytest.raises(TbaError, match=r"parameter '0.weight' of a recomputed layer \(Sequential\) was frozen"):
        h.sum().backward()


def test_nested_contexts_recomputing_the_same_layers_say_so(spill_dir):
    model = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
    plan = tba.Plan(("recompute", "recompute"), 1 << 20)
    with tba.offload_activations(spill_dir, layers=list(model), policy=plan):
        with pytest.raises(tba.TbaConfigError, match="recomputed by another tba context that is active"):
            with tba.offload_activations(spill_dir, layers=list(model), policy=plan):
                pass
    assert all("forward" not in vars(layer) for layer in model)


def test_a_context_in_another_thread_recomputing_the_same_layers_says_so(tmp_path):
    # Two threads, one model: the first thread's context wraps the layers; the second thread's, on its
    # own directory, used to hear that contexts "do not nest", which it had not done.
    import threading

    model = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
    plan = tba.Plan(("recompute", "recompute"), 1 << 20)
    entered, leave, errors = threading.Event(), threading.Event(), []

    def first():
        with tba.offload_activations(tmp_path / "a", layers=list(model), policy=plan):
            entered.set()
            leave.wait(30)

    thread = threading.Thread(target=first)
    thread.start()
    try:
        assert entered.wait(30)
        try:
            with tba.offload_activations(tmp_path / "b", layers=list(model), policy=plan):
                pass
        except tba.TbaConfigError as err:
            errors.append(str(err))
    finally:
        leave.set()
        thread.join(30)
    assert len(errors) == 1 and "active in another thread" in errors[0] and "its own copy of the model" in errors[0]
    assert all("forward" not in vars(layer) for layer in model)


def _gpt2(use_cache: bool):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=3, n_head=2, use_cache=use_cache)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).train()


def _gpt2_step(net, offloader=None):
    ids = torch.randint(64, (2, 8), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[0, 4:] = 0
    torch.manual_seed(5)
    if offloader is None:
        loss = net(input_ids=ids, attention_mask=mask, labels=ids).loss
    else:
        with offloader:
            loss = net(input_ids=ids, attention_mask=mask, labels=ids).loss
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in net.parameters()]


@pytest.mark.parametrize("decision", ["recompute", "offloaded_recompute"])
def test_a_layer_given_a_key_value_cache_is_not_recomputed(spill_dir, decision):
    # Note [A layer given a key/value cache is not recomputed]: GPT-2 trains with a DynamicCache by default,
    # and a recomputation appended to it a second time (a shape error in backward with a padding mask).
    plan = tba.Plan(("keep", decision, "offload"), window_bytes=1 << 20)
    net = _gpt2(use_cache=True)
    with pytest.raises(TbaError, match="key/value cache .*use_cache=False"):
        _gpt2_step(net, tba.Offloader(spill_dir, layers=list(net.transformer.h), policy=plan, min_offload_bytes=0))
    # Without the cache the same plan is exact.
    expected = _gpt2_step(_gpt2(use_cache=False))
    net = _gpt2(use_cache=False)
    loss, grads = _gpt2_step(net, tba.Offloader(spill_dir, layers=list(net.transformer.h), policy=plan, min_offload_bytes=0))
    assert torch.equal(loss, expected[0]) and all(torch.equal(a, b) for a, b in zip(grads, expected[1]))


def test_the_adaptive_profile_marks_a_layer_given_a_cache_not_recomputable(spill_dir):
    net = _gpt2(use_cache=True)
    offloader = tba.Offloader(spill_dir, layers=list(net.transformer.h), min_offload_bytes=0, overhead_bound=100.0)
    for _ in range(4):
        _gpt2_step(net, offloader)
    profile = offloader.policy_runner.profile
    assert profile is not None and not any(layer.recomputable for layer in profile.layers)
    assert not any(decision in ("recompute", "offloaded_recompute") for decision in offloader.plan.decisions)
