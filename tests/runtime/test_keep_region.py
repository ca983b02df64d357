"""One :func:`tba.keep_in_memory` object entered more than once at a time (nested, or by two threads) ends its
region when the last entry exits: Note [A region object entered twice at once] in tba/runtime/_keep.py. A function
decorated with it, with or without parentheses, runs inside a region of its own."""

from __future__ import annotations

import pathlib
import sys
import threading

import pytest
import torch
from utils import SaveSum

import tba
from tba.errors import TbaConfigError
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


@pytest.mark.parametrize("parentheses", [False, True], ids=["bare", "called"])
def test_a_function_decorated_with_the_region_keeps_what_it_saves(spill_dir, parentheses):
    """``@tba.keep_in_memory`` without parentheses, as ``@torch.no_grad`` is written: it raised 'keep_in_memory.__init__()
    takes 1 positional argument but 2 were given' at the decorated function's definition (helper-159)."""
    def head(x, h):
        assert in_keep_region()
        return SaveSum.apply(x, h)

    head = tba.keep_in_memory(head) if not parentheses else tba.keep_in_memory()(head)
    x, h = torch.ones(4, requires_grad=True), torch.ones(1 << 14)
    with tba.offload_activations(spill_dir, policy="offload", min_offload_bytes=0) as ctx:
        y = head(x, h)
        assert not in_keep_region()
    y.sum().backward()
    assert ctx.stats.kept_by_reason == {"inside tba.keep_in_memory()": 1}
    assert torch.equal(x.grad, torch.full((4,), float(1 << 14)))


def test_anything_but_a_function_given_to_the_region_names_the_fix():
    with pytest.raises(TbaConfigError, match=r"with tba\.keep_in_memory\(\):.*@tba\.keep_in_memory.*got int"):
        tba.keep_in_memory(3)


_DECORATED = '''
import torch
import tba


@tba.keep_in_memory
def head(x: torch.Tensor) -> torch.Tensor:
    return x.sin()


@tba.keep_in_memory()
def tail(x: torch.Tensor) -> torch.Tensor:
    return x.cos()


y: torch.Tensor = head(torch.ones(2)) + tail(torch.ones(2))
with tba.keep_in_memory():
    pass
'''


def test_a_type_checker_takes_the_decorator_without_parentheses(tmp_path, monkeypatch):
    """``@tba.keep_in_memory`` (documented, without parentheses) failed mypy in a user's program: "Too many arguments
    for keep_in_memory", then every call of the function "Value of type variable _F of __call__ of ContextDecorator
    cannot be Tensor" (helper-168). mypy types a class call by ``__init__`` where the class defines both it and
    ``__new__``, and ``__init__`` took no function; the overloads of ``__new__`` say what the call returns, so the
    class defines no ``__init__`` of its own (Note [The region's constructor is its __new__] in tba/runtime/_keep.py)."""
    assert "__init__" not in vars(tba.keep_in_memory) and "__new__" in vars(tba.keep_in_memory)
    api = pytest.importorskip("mypy.api")
    program = tmp_path / "user.py"
    program.write_text(_DECORATED)
    monkeypatch.setenv("MYPYPATH", str(pathlib.Path(tba.__file__).resolve().parents[1]))  # this checkout's tba
    out, err, status = api.run(["--follow-imports=silent", "--python-executable", sys.executable,
                                "--cache-dir", str(tmp_path / "cache"), str(program)])
    assert status == 0, out + err
