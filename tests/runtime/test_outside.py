"""The adaptive default never recomputes a layer whose recomputation would run something again that tba does not put
back: a module outside the layer whose state its forward changes, or a forward hook of its submodules (Note [A
recomputed forward reaches beyond its layer] in tba/runtime/_outside.py; helper-93 found ``RRRRRK`` planned for the
first, silently wrong)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn
from utils import RecomputeWherePossible

import tba

WIDTH = 32


class Block(nn.Module):
    """Calls ``shared`` (a module the blocks share, outside each block's ``modules()``) before its own layers."""

    def __init__(self, shared: nn.Module | None) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.own_norm = nn.BatchNorm1d(WIDTH)  # its own: put back before a recomputation
        self.refs = [shared]  # a list hides it from modules()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = self.refs[0]
        if isinstance(shared, nn.BatchNorm1d) and shared.momentum is None:  # changed without being called
            with torch.no_grad():
                shared.running_mean.mul_(0.9).add_(x.mean(0), alpha=0.1)
            x = x - shared.running_mean
        elif shared is not None:
            x = shared(x)
        return x + torch.tanh(self.own_norm(self.linear(x)))


class Model(nn.Module):
    def __init__(self, shared: nn.Module | None) -> None:
        super().__init__()
        self.shared = shared
        self.blocks = nn.ModuleList([Block(shared) for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


def train(make_shared, directory: str | None, hook: bool = False) -> tuple[list[torch.Tensor], list[bool] | None]:
    """Four steps; the model's gradients, buffers and the hook's sum, and what the policy was told."""
    torch.manual_seed(0)
    model = Model(make_shared())
    total = torch.zeros(())
    if hook:
        model.blocks[1].linear.register_forward_hook(lambda module, args, out: total.add_(out.detach().abs().sum()) and None)
    policy = RecomputeWherePossible()
    offloader = None if directory is None else tba.Offloader(directory, layers=list(model.blocks), policy=policy,
                                                               profile_steps=1, min_offload_bytes=0)
    generator = torch.Generator().manual_seed(1)
    for _ in range(4):
        x = torch.randn(16, WIDTH, generator=generator)
        if offloader is None:
            loss = model(x)
        else:
            with offloader:
                loss = model(x)
        loss.backward()
    if offloader is not None:
        offloader.close()
    state = [p.grad for p in model.parameters() if p.grad is not None] + list(model.buffers()) + [total]
    return state, (policy.recomputable if offloader is not None else None)


@pytest.mark.parametrize("make_shared, recomputable", [
    (lambda: nn.BatchNorm1d(WIDTH), False),  # its running statistics would be updated twice
    (lambda: nn.BatchNorm1d(WIDTH, momentum=None), False),  # the same, by the block itself, without a call
    (lambda: nn.Linear(WIDTH, WIDTH), True),  # called, never changed
    (lambda: None, True),
], ids=["shared-batchnorm", "changed-without-a-call", "shared-linear", "nothing-shared"])
def test_a_module_outside_the_layer_whose_state_changes(spill_dir, make_shared, recomputable):
    want, _ = train(make_shared, None)
    got, told = train(make_shared, spill_dir)
    assert told == [recomputable] * 3
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_a_forward_hook_on_a_submodule(spill_dir):
    want, _ = train(lambda: None, None, hook=True)
    got, told = train(lambda: None, spill_dir, hook=True)
    assert told == [True, False, True]
    assert all(torch.equal(a, b) for a, b in zip(got, want))  # the hook's sum too


def test_a_global_module_hook_marks_every_layer():
    from tba.runtime._outside import hooks_run_again

    block = Block(None)
    assert not hooks_run_again(block)
    handle = torch.nn.modules.module.register_module_forward_hook(lambda module, args, out: None)
    try:
        assert hooks_run_again(block)
    finally:
        handle.remove()
    assert not hooks_run_again(block)


def test_a_framework_hook_leaves_the_layer_recomputable():
    """DeepSpeed ZeRO-3 hooks every submodule (helper-98: no layer was recomputable under it, though a pinned recompute
    plan is exact there); its hooks, FSDP's and torch's run again under the frameworks' own checkpointing."""
    from tba.runtime._outside import hooks_run_again

    def framework_hook(module, args):
        return None

    framework_hook.__module__ = "deepspeed.runtime.zero.parameter_offload"
    block = Block(None)
    block.linear.register_forward_pre_hook(framework_hook)
    assert not hooks_run_again(block)
    block.linear.register_forward_pre_hook(lambda module, args: None)  # the program's own
    assert hooks_run_again(block)


def test_modules_another_thread_runs_meanwhile_are_not_the_layers(spill_dir):
    """A model another thread runs during the profiled steps (an evaluation, an EMA copy) called modules the layers'
    watch counted as theirs, and one thread's leave failed while the other added to what it read (helper-98)."""
    import threading

    stop = threading.Event()
    other = nn.Sequential(*[nn.BatchNorm1d(WIDTH) for _ in range(8)])

    def run_other():
        generator = torch.Generator().manual_seed(2)  # not torch's global one, which the model's init uses
        while not stop.is_set():
            other(torch.randn(4, WIDTH, generator=generator))

    thread = threading.Thread(target=run_other)
    thread.start()
    try:
        got, told = train(lambda: nn.Linear(WIDTH, WIDTH), spill_dir)
    finally:
        stop.set()
        thread.join()
    want, _ = train(lambda: nn.Linear(WIDTH, WIDTH), None)
    assert told == [True] * 3
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_a_block_holding_the_model_it_belongs_to_stays_recomputable(spill_dir):
    """The model a block holds contains the block: its own BatchNorm's statistics, which tba puts back itself, are not
    a change of a module outside it."""
    states = []
    for directory in (None, spill_dir):
        torch.manual_seed(0)
        model = Model(None)
        for block in model.blocks:
            block.refs = [None, model]  # held, never called (refs[0] is what Block calls)
        policy = RecomputeWherePossible()
        offloader = None if directory is None else tba.Offloader(directory, layers=list(model.blocks), policy=policy,
                                                                   profile_steps=1, min_offload_bytes=0)
        generator = torch.Generator().manual_seed(1)
        for _ in range(4):
            with offloader if offloader is not None else contextlib.nullcontext():
                loss = model(torch.randn(16, WIDTH, generator=generator))
            loss.backward()
        if offloader is not None:
            offloader.close()
            assert policy.recomputable == [True] * 3
        states.append([p.grad for p in model.parameters()] + list(model.buffers()))
    assert all(torch.equal(a, b) for a, b in zip(*states))
