"""One :func:`tba.keep_in_memory` object entered more than once at a time (nested, or by two threads) ends its
region when the last entry exits: Note [A region object entered twice at once] in tba/runtime/_keep.py."""

from __future__ import annotations

import threading

import torch

import tba
from tba.runtime._keep import in_keep_region


def test_one_region_object_entered_twice_ends_with_its_last_exit():
    keep = tba.keep_in_memory()
    with keep:
        with keep:
            assert in_keep_region()
        assert in_keep_region()
    assert not in_keep_region(), "the thread stayed inside keep_in_memory() after both exits"


def test_one_region_object_shared_by_two_threads_ends_on_each(spill_dir):
    keep, entered, leave = tba.keep_in_memory(), threading.Event(), threading.Event()
    after: list[bool] = []

    def other() -> None:
        with keep:
            entered.set()
            leave.wait(10)
        after.append(in_keep_region())

    thread = threading.Thread(target=other)
    with keep:
        thread.start()
        entered.wait(10)
    leave.set()
    thread.join(10)
    assert after == [False] and not in_keep_region()
    x = torch.randn(256, 256, requires_grad=True)
    with tba.offload_activations(spill_dir, policy="offload", min_offload_bytes=0) as ctx:
        loss = x.sin().sum()
    loss.backward()
    assert ctx.stats.kept_by_reason.get("inside tba.keep_in_memory()", 0) == 0


def test_the_decorator_without_parentheses_names_the_fix():
    """``@tba.keep_in_memory`` (no parentheses) raised ``TypeError: keep_in_memory.__init__() takes 1 positional argument
    but 2 were given`` at the decorated function, naming neither tba's API nor the fix."""
    import pytest

    from tba import TbaError

    with pytest.raises(TbaError, match=r"@tba\.keep_in_memory\(\)"):
        @tba.keep_in_memory
        def head(h: torch.Tensor) -> torch.Tensor:
            return h.sin()
    with pytest.raises(TbaError, match=r"takes no arguments.*with tba\.keep_in_memory\(\):"):
        tba.keep_in_memory(True)
    assert not in_keep_region()

    @tba.keep_in_memory()
    def inside() -> bool:
        return in_keep_region()

    assert inside() and not in_keep_region()
