"""Two steps of contexts that share one runner, at once: the second leaves the first's per-step state alone (Note
[A runner shared by contexts at once] in tba/runtime/_one_step.py)."""

from __future__ import annotations

import threading

import torch
from torch import nn

import tba

WIDTH = 64


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x)) + x


def _hooks(model: nn.Module) -> list[tuple[int, int, int]]:
    return [(len(m._forward_pre_hooks), len(m._forward_hooks), len(m._forward_pre_hooks_with_kwargs)) for m in model]


def _grads(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(x).sum().backward()
    return [p.grad.clone() for p in model.parameters()]


def test_a_step_in_another_thread_during_a_profiled_step_leaves_its_hooks_alone(spill_dir):
    """Thread A's one-shot context profiles its model; thread B's, on the same directory with another model, is
    entered and left in the middle of A's forward. B's entry used to start the profiled step's timer and shape hook
    again on A's blocks and its exit took them off there mid-forward: with both forwards running, A's module
    called a hook registered with keyword arguments without them (a TypeError out of A's forward)."""
    torch.manual_seed(0)
    model_a = nn.Sequential(*(Block() for _ in range(3)))
    model_b = nn.Sequential(*(Block() for _ in range(3)))
    x_a, x_b = torch.randn(16, WIDTH), torch.randn(16, WIDTH)
    want_a, want_b = _grads(model_a, x_a), _grads(model_b, x_b)
    in_a, b_done = threading.Event(), threading.Event()
    seen: dict[str, object] = {}

    def step_a() -> None:
        try:
            for _ in range(2):  # the shared runner learns model A's blocks, then profiles
                with tba.offload_activations(spill_dir, min_offload_bytes=0):
                    loss = model_a(x_a).sum()
                loss.backward()
            model_a.zero_grad(set_to_none=True)
            with tba.offload_activations(spill_dir, min_offload_bytes=0):
                h = model_a[0](x_a)
                seen["a inside"] = _hooks(model_a)
                in_a.set()
                b_done.wait(30)
                seen["a resumed"] = _hooks(model_a)
                loss = model_a[2](model_a[1](h)).sum()
            loss.backward()
            seen["a exact"] = all(torch.equal(p.grad, w) for p, w in zip(model_a.parameters(), want_a))
        except Exception as err:  # noqa: BLE001 - reported below
            seen["a"] = err
            in_a.set()

    def step_b() -> None:
        try:
            in_a.wait(30)
            model_b.zero_grad(set_to_none=True)
            with tba.offload_activations(spill_dir, min_offload_bytes=0):
                loss = model_b(x_b).sum()
                seen["a during b"] = _hooks(model_a)
            loss.backward()
            seen["b exact"] = all(torch.equal(p.grad, w) for p, w in zip(model_b.parameters(), want_b))
        except Exception as err:  # noqa: BLE001 - reported below
            seen["b"] = err
        finally:
            b_done.set()

    threads = [threading.Thread(target=step_a), threading.Thread(target=step_b)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert "a" not in seen and "b" not in seen, seen
    assert seen["a exact"] and seen["b exact"]
    assert seen["a inside"] != [(0, 0, 0)] * 3, "A's step was not profiled"
    assert seen["a during b"] == seen["a inside"], "the step in the other thread hooked model A's blocks"
    assert seen["a resumed"] == seen["a inside"], "the step in the other thread took A's profiling hooks off"
    assert _hooks(model_a) == _hooks(model_b) == [(0, 0, 0)] * 3
    tba.shutdown()


def test_two_threads_training_two_models_on_one_directory_are_exact(spill_dir):
    """Each thread trains its own model with bare one-shot contexts on one directory, at once."""
    def train(which: int, offload: bool) -> list[torch.Tensor]:
        generator = torch.Generator().manual_seed(which)
        model = nn.Sequential(*(Block() for _ in range(3 + which)))
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
        out = []
        for step in range(6):
            x = torch.randn(32 + 16 * (step % 3 == 2), WIDTH, generator=generator)
            model.zero_grad(set_to_none=True)
            if offload:
                with tba.offload_activations(spill_dir, min_offload_bytes=0, profile_steps=1):
                    loss = model(x).pow(2).mean()
            else:
                loss = model(x).pow(2).mean()
            loss.backward()
            out += [loss.detach(), *(p.grad.clone() for p in model.parameters())]
        return out

    want = [train(0, False), train(1, False)]
    got: list[object] = [None, None]

    def run(which: int) -> None:
        try:
            got[which] = train(which, True)
        except Exception as err:  # noqa: BLE001 - reported below
            got[which] = err

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    for which in range(2):
        assert isinstance(got[which], list), got[which]
        assert all(torch.equal(a, b) for a, b in zip(want[which], got[which]))
    tba.shutdown()


def test_a_model_whose_training_moved_to_another_thread_is_still_planned(spill_dir):
    """The layers found in a thread that has ended are the next thread's to plan (``_learned_elsewhere``)."""
    torch.manual_seed(0)
    model = nn.Sequential(*(Block() for _ in range(3)))
    x = torch.randn(16, WIDTH)

    def steps(count: int) -> tba.Offloader:
        for _ in range(count):
            with tba.offload_activations(spill_dir, min_offload_bytes=0, profile_steps=1) as off:
                loss = model(x).sum()
            loss.backward()
        return off

    first = threading.Thread(target=steps, args=(1,))  # finds the layers, then ends
    first.start()
    first.join(60)
    assert steps(4).plan is not None
    tba.shutdown()
