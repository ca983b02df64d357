"""tba in one thread while another thread compiles: torch's ``is_compiling()`` is one flag for the whole process."""

from __future__ import annotations

import threading

import torch
from model_cases import WIDTH, Block
from torch import nn

import tba
from tba.errors import TbaError


def _step(model: nn.Module, context) -> tuple[torch.Tensor, list[torch.Tensor]]:
    x = torch.randn(256, WIDTH, generator=torch.Generator().manual_seed(0))
    with context:
        loss = model(x).square().mean()
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def test_a_step_while_another_thread_compiles_is_exact_and_finds_its_blocks(spill_dir):
    """Note [Another thread's compile is not this thread's] in tba/runtime/_compiling.py: torch holds its
    ``is_compiling()`` flag True for the whole of a compile session, in every thread. A step of an eager model run while
    another thread compiled had its saved tensors' unpack hook raise tba's compiled-autograd TbaError in backward, and
    its layer discovery saw no module run (no repeated blocks)."""
    compiling, release = threading.Event(), threading.Event()

    def backend(graph: torch.fx.GraphModule, inputs: list) -> object:
        compiling.set()
        release.wait()
        return graph.forward

    torch._dynamo.reset()
    other = threading.Thread(target=torch.compile(lambda x: x * 2, backend=backend), args=(torch.ones(3),))
    torch.manual_seed(0)
    model = nn.Sequential(*(Block() for _ in range(3)))
    reference = _step(model, tba.keep_in_memory())
    other.start()
    try:
        assert compiling.wait(timeout=60)
        assert torch.compiler.is_compiling()  # in this thread too, while the other compiles
        offloader = tba.Offloader(spill_dir)
        try:
            loss, grads = _step(model, offloader)
        except TbaError as error:
            raise AssertionError(f"tba raised while another thread compiled: {error}") from error
        finally:
            offloader.close()
    finally:
        release.set()
        other.join()
        torch._dynamo.reset()
    assert offloader.discovered_layers == list(model), offloader.discovered_layers
    assert torch.equal(loss, reference[0])
    assert all(torch.equal(a, b) for a, b in zip(grads, reference[1]))
