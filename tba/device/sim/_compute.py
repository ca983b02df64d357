"""The model's own operators as accesses of the simulated compute stream, for the race checker.

A dispatch mode on the thread that entered :func:`~tba.device.sim.simulate` sees every operator:
its tensor inputs are reads, its outputs and the inputs its schema marks as written are writes,
each over the bytes the tensor's elements span, on the current stream. View and allocation
operators touch no data and are skipped.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def _range(tensor: torch.Tensor) -> tuple[int, int]:
    """``(address, nbytes)`` spanned by ``tensor``'s elements."""
    if tensor.numel() == 0:
        return tensor.data_ptr(), 0
    span = 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    return tensor.data_ptr(), span * tensor.element_size()


_NOT_ACCESSES = {"aten::empty", "aten::empty_strided", "aten::set_", "aten::detach", "aten::alias",
                 "aten::lift_fresh", "aten::resize_", "aten::empty_like"}


class ComputeAccesses(TorchDispatchMode):
    """Every operator of the entering thread: reads of its tensor inputs, writes of its outputs and mutated inputs."""

    def __init__(self, sim: Any) -> None:
        super().__init__()
        self.sim = sim

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        schema = func._schema
        touches_data = not (func.is_view or schema.name in _NOT_ACCESSES)
        # Note: [A kernel on a side stream runs after that stream's queue]
        # The model's operators run on the host at once. On the compute stream that is the device
        # keeping up with the host; on an asynchronous stream (``with torch.cuda.stream(s):`` around
        # forward or backward) the operator must first wait for what is queued there before it (a
        # ``wait_event`` on a read's copy, say), or it reads bytes no copy has written yet. Views
        # and allocations touch no data and do not wait (the simulated allocator slices its arena).
        if touches_data:
            self.sim.check_alive()  # a kernel launched in a broken context: Note [A broken context] in tba/device/sim/_faults.py
            self.sim.scheduler.catch_up(self.sim.current_stream())
        out = func(*args, **kwargs)
        if not self.sim.checking_compute or not touches_data:
            return out
        written = set()
        for argument, value in zip(schema.arguments, args):
            if argument.alias_info is not None and argument.alias_info.is_write and isinstance(value, torch.Tensor):
                written.add(id(value))
        for name, value in kwargs.items():
            argument = next((a for a in schema.arguments if a.name == name), None)
            if argument is not None and argument.alias_info is not None and argument.alias_info.is_write:
                written.add(id(value))
        stream = self.sim.current_stream()
        checker = self.sim.checker
        checker.launch(stream.name)
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        for tensor in inputs:
            if tensor.device.type == "cpu":
                checker.access(stream.name, *_range(tensor), id(tensor) in written, schema.name)
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu" and not any(tensor is t for t in inputs):
                checker.access(stream.name, *_range(tensor), True, schema.name)
        return out
