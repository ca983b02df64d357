"""A model copied inside the ``with`` block (``copy.deepcopy``, pickle) is a model of its own: its layers run their own
forward and weights, and carry none of tba's hooks (Note [A copy of a hooked layer holds none of tba's] in
``tba/runtime/_layer_hooks.py``).

Found by an adversarial review (helper-117), on a BYOL-style model whose target encoder is a deep copy of the online one
made lazily in the first forward: under a plan recomputing the online blocks, the copy's blocks held tba's recomputing
forward bound to the *online* blocks, so the target ran the online weights in every later step (losses silently other
than training without tba); with ``layers=`` and the adaptive default, the copy failed inside the first step with
``TypeError: cannot pickle '_thread.lock' object`` (a hook bound to tba's runner was copied with the runner).
"""

from __future__ import annotations

import contextlib
import copy
import pickle

import pytest
import torch
from torch import nn

import tba

WIDTH = 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x)) + x


class Byol(nn.Module):
    """The target is a deep copy of the online blocks, made in the first forward and moved towards them after each step."""

    def __init__(self) -> None:
        super().__init__()
        self.online = nn.Sequential(Block(), Block())
        self.target: nn.Module | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.target is None:
            self.target = copy.deepcopy(self.online).requires_grad_(False)
        with torch.no_grad():
            goal = self.target(x.flip(0))
        return (self.online(x) - goal).pow(2).mean()


def _train(spill_dir: str, policy: object) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = Byol()
    result = []
    for step in range(4):
        x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(step))
        with (tba.offload_activations(spill_dir, layers=list(model.online), policy=policy, min_offload_bytes=0)
              if policy is not None else contextlib.nullcontext()):
            loss = model(x)
        loss.backward()
        with torch.no_grad():
            for online in model.online.parameters():
                online.sub_(online.grad, alpha=0.1)
            for target, online in zip(model.target.parameters(), model.online.parameters(), strict=True):
                target.lerp_(online, 0.5)
        result += [loss.detach(), *(p.grad.clone() for p in model.online.parameters())]
        model.zero_grad()
    return result


@pytest.mark.parametrize("policy", ["recompute", "offloaded_recompute", "keep", "offload", "adaptive"])
def test_a_deep_copy_made_in_forward_runs_its_own_weights(spill_dir, policy):
    pinned = tba.Plan((policy,) * 2, window_bytes=1 << 20) if policy != "adaptive" else "adaptive"
    reference = _train(spill_dir, None)
    result = _train(spill_dir, pinned)
    assert all(torch.equal(a, b) for a, b in zip(reference, result, strict=True))


def test_a_model_pickled_inside_the_block_is_a_plain_model(spill_dir):
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block())
    x = torch.randn(4, WIDTH)
    with tba.offload_activations(spill_dir, layers=list(model), policy=tba.Plan(("recompute", "keep"), window_bytes=1 << 20)):
        model(x).sum().backward()
        loaded = pickle.loads(pickle.dumps(model))
        copied = copy.deepcopy(model)
    for other in (loaded, copied):
        with torch.no_grad():
            for p in other.parameters():
                p.zero_()
        assert torch.equal(other(x), x)  # its own zeroed weights, not the model's
        hooks = [hook for block in other for hook in [*block._forward_pre_hooks.values(), *block._forward_hooks.values()]]
        assert not any(getattr(hook, "__closure__", None) or hasattr(hook, "__self__") for hook in hooks)  # tba's: no-ops
        # A copy can itself be recomputed by tba later.
        with tba.offload_activations(spill_dir, layers=list(other), policy=tba.Plan(("recompute",) * 2, window_bytes=1 << 20)):
            out = other(x.requires_grad_())
        assert torch.equal(out, x)


def test_a_copy_of_a_recomputed_layer_keeps_its_forwards_signature_and_no_type_of_tbas(spill_dir):
    """A copy's forward was an object of tba's taking ``*args, **kwargs``: code reading the signature (Hugging Face's
    ``generate``, ``inspect.signature``) saw none, and its pickle named a class of tba's. It is the class's forward
    bound to the copy (Note [A copy of a hooked layer holds none of tba's] in tba/runtime/_layer_hooks.py)."""
    import inspect

    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block())
    with tba.offload_activations(spill_dir, layers=list(model), policy=tba.Plan(("recompute",) * 2, window_bytes=1 << 20)):
        out = model(torch.randn(4, WIDTH, requires_grad=True))
        copied = copy.deepcopy(model)
        pickled = pickle.dumps(model)
    out.sum().backward()
    assert list(inspect.signature(copied[0].forward).parameters) == ["x"]
    assert b"Recomputing" not in pickled and b"ClassForward" not in pickled
    assert list(inspect.signature(pickle.loads(pickled)[0].forward).parameters) == ["x"]
