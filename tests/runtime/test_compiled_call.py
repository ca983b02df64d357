"""tba's hooks on a layer compiled in place (``block.compile()``) run around its compiled call, eagerly
(tba/runtime/_compiled_call.py); these cases put such a layer where a graph that encloses it traces that call."""

from __future__ import annotations

import contextlib
import sys

import pytest
import torch
from model_cases import WIDTH, Block
from torch import nn
from torch._dynamo.utils import counters
from torch.nn.modules import module as module_hooks
from utils import train_counting_graphs

import tba


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _train(contexts, steps: int) -> tuple[list, list, int]:
    """``steps`` SGD steps of a model compiled whole over blocks compiled in place (both ``fullgraph=True``), each
    forward in ``contexts(model)``: the losses, the final parameters and how many graphs Dynamo compiled."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = Model()
    for block in model.blocks:
        block.compile(backend="aot_eager", fullgraph=True)
    model.compile(backend="aot_eager", fullgraph=True)
    return train_counting_graphs(
        model, lambda model, step: model(torch.randn(256, WIDTH, generator=torch.Generator().manual_seed(step))),
        contexts, steps)


@pytest.mark.parametrize("how", ["layers", "memory_budget"])
def test_blocks_compiled_in_place_inside_a_whole_model_compile_train_exactly(spill_dir, how):
    """Note [A graph that encloses a block compiled in place traces none of tba's hooks] in
    tba/runtime/_compiled_call.py: the model's graph traced the blocks' CompiledCall and tba's hooks in it, and the
    first profiled step failed (``Unsupported: ... method nbytes of class UntypedStorage``)."""
    reference, final, graphs = _train(lambda model: contextlib.nullcontext(), steps=3)
    made = {}

    def context(model):
        if how == "layers":
            return tba.offload_activations(spill_dir, layers=model.blocks)
        if "offloader" not in made:
            made["offloader"] = tba.Offloader(spill_dir, layers=model.blocks, memory_budget="64MiB")
        return made["offloader"]

    losses, params, tba_graphs = _train(context, steps=3)
    if made:
        made["offloader"].close()
    assert tba_graphs == graphs, (graphs, tba_graphs)
    assert all(torch.equal(a, b) for a, b in zip(reference, losses))
    assert all(torch.equal(a, b) for a, b in zip(final, params))


def test_an_exception_at_any_line_of_discovery_leaves_each_block_its_own_compiled_call(spill_dir):
    """Note [Discovery takes off whatever it put on a block] in tba/runtime/_discover.py: discovery hooks each block
    compiled in place from its global pre-hook, in the training thread, where a signal handler's exception can land. One
    landing between the block's two hooks (or inside :func:`add_layer_hook`, after it put the CompiledCall in place)
    left the block a CompiledCall holding the discovery's pre-hook for good, after the context had ended."""
    from injection import Injected, raise_at_line

    from tba import _control

    torch.manual_seed(0)
    model = Model()
    for block in model.blocks:
        block.compile(backend="aot_eager")
    own = [vars(block)["_compiled_call_impl"] for block in model.blocks]
    x = torch.randn(256, WIDTH)
    model(x).backward()  # compiled before any trace function is set
    hooked = ("tba/runtime/_discover.py", "tba/runtime/_compiled_call.py")
    k = 0
    while True:
        k += 1
        trace, seen = raise_at_line(k, lambda code: code.co_filename.endswith(hooked))
        loss = None
        try:
            sys.settrace(trace)
            with tba.offload_activations(spill_dir):
                loss = model(x)
        except Injected:
            pass
        finally:
            sys.settrace(None)
        if loss is not None:
            loss.backward()
        loss = None
        _control.settle()
        left = [type(vars(block)["_compiled_call_impl"]).__name__ for block, mine in zip(model.blocks, own)
                if vars(block)["_compiled_call_impl"] is not mine]
        assert left == [], f"line {k}: {left}"
        assert not module_hooks._global_forward_pre_hooks and not module_hooks._global_forward_hooks, f"line {k}"
        if seen[0] < k:
            break
    assert k > 20  # the trace reached the discovery's lines


@pytest.mark.parametrize("second", [False, True], ids=["first-hook", "second-hook"])
def test_a_hook_interrupted_at_any_line_is_on_with_its_handle_or_not_on(second):
    """Note [A hook goes on with its handle] in tba/runtime/_compiled_call.py: the profiled step hooks its first layer
    from a hook in the training thread; an exception landing in :func:`add_layer_hook` after it had put the hook (and the
    CompiledCall) in place, before the handle was made, left the hook on the block for good."""
    from injection import Injected, raise_at_line

    from tba.runtime._compiled_call import add_layer_hook

    block = Block()
    block.compile(backend="aot_eager")
    own = vars(block)["_compiled_call_impl"]
    first = add_layer_hook(block, lambda module, args: None, pre=True) if second else None
    k = 0
    while True:
        k += 1
        trace, seen = raise_at_line(k, lambda code: code.co_filename.endswith("tba/runtime/_compiled_call.py"))
        handle = None
        try:
            sys.settrace(trace)
            handle = add_layer_hook(block, lambda module, args, output: None, pre=False)
        except Injected:
            pass
        finally:
            sys.settrace(None)
        if handle is not None:
            handle.remove()
        call = vars(block)["_compiled_call_impl"]
        if second:
            assert not call.post and len(call.pre) == 1, f"line {k}: {call.post}"
        else:
            assert call is own, f"line {k}: {type(call).__name__} left"
        if seen[0] < k:
            break
    if first is not None:
        first.remove()
    assert vars(block)["_compiled_call_impl"] is own and k > 5
