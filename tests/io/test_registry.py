"""The engine registry is the one list of backends: unknown names fail, registered ones are built."""

from __future__ import annotations

import pytest
import torch

import tba
from tba import TbaConfigError
from tba.io import ThreadEngine, backend_names, engine_names, make_engine, register_engine


def test_unknown_backend_is_refused_instead_of_running_threads():
    with pytest.raises(TbaConfigError, match=r"unknown backend 'spdk'.*register_engine"):
        make_engine("spdk")
    with pytest.raises(TbaConfigError, match="unknown backend 'spdk'"):
        tba.offload_activations(backend="spdk")


def test_backend_names_come_from_the_registry():
    assert engine_names()[:2] == ("io_uring", "threads")
    assert backend_names() == ("auto", *engine_names(), "kvikio")
    assert tba.backend_names() == backend_names()


def test_a_registered_engine_runs_the_offloader(spill_dir, monkeypatch):
    built = []

    class CountingEngine(ThreadEngine):
        def submit_many(self, requests):
            built.append(len(requests))
            return super().submit_many(requests)

    monkeypatch.setattr("tba.io._ENGINES", dict(__import__("tba.io", fromlist=["_ENGINES"])._ENGINES))
    register_engine("counting", lambda depth: CountingEngine(workers=2))
    assert "counting" in backend_names()
    x = torch.randn(256, 1024, requires_grad=True)
    torch.tanh(x * 2).sum().backward()
    expected, x.grad = x.grad, None
    with tba.offload_activations(spill_dir, backend="counting", layers=[]) as off:
        y = torch.tanh(x * 2)
    off.flush()
    assert built and off.stats.bytes_written == x.numel() * 4
    y.sum().backward()
    assert torch.equal(x.grad, expected)


def test_an_unavailable_engine_says_why(monkeypatch):
    monkeypatch.setattr("tba.io._ENGINES", dict(__import__("tba.io", fromlist=["_ENGINES"])._ENGINES))
    register_engine("broken", lambda depth: ThreadEngine(), lambda: "needs a device this machine lacks")
    with pytest.raises(TbaConfigError, match="not available: needs a device this machine lacks"):
        make_engine("broken")


@pytest.mark.parametrize("name", ["auto", "kvikio", ""])
def test_reserved_names_cannot_be_registered(name):
    with pytest.raises(TbaConfigError):
        register_engine(name, lambda depth: ThreadEngine())


def test_an_engine_that_is_not_a_factory_is_refused_when_registered():
    with pytest.raises(TbaConfigError, match=r"factory called as factory\(queue_depth\).*got int 5"):
        register_engine("five", 5)
    assert "five" not in engine_names()


@pytest.mark.parametrize("name", [5, None, b"mine", ("a",)], ids=["int", "None", "bytes", "tuple"])
def test_a_name_that_is_not_a_string_is_refused_when_registered(name, monkeypatch):
    """``register_engine(5, factory)`` was accepted, and every later unknown-backend error then failed to be written
    (``AttributeError: 'int' object has no attribute 'lower'``) instead of naming the backends (helper-168)."""
    monkeypatch.setattr("tba.io._ENGINES", dict(__import__("tba.io", fromlist=["_ENGINES"])._ENGINES))
    with pytest.raises(TbaConfigError, match=r"register_engine takes the engine's name as a non-empty str"):
        register_engine(name, lambda depth: ThreadEngine())
    assert engine_names()[:2] == ("io_uring", "threads") and all(isinstance(n, str) for n in engine_names())
    with pytest.raises(TbaConfigError, match="unknown backend 'spdk'"):
        make_engine("spdk")


@pytest.mark.parametrize("backend", ["io_uring", "threads"])
@pytest.mark.parametrize("depth, match", [(5000, r"queue_depth must be in 1\.\.4096, got 5000"),
                                          (0, r"queue_depth must be in 1\.\.4096, got 0"),
                                          (2.5, r"queue_depth must be a whole number in 1\.\.4096, got float 2\.5"),
                                          ("8", r"queue_depth must be a whole number in 1\.\.4096, got str '8'"),
                                          (True, r"queue_depth must be a whole number in 1\.\.4096, got bool True")],
                         ids=["above", "zero", "float", "str", "bool"])
def test_make_engine_refuses_a_queue_depth_the_options_refuse(backend, depth, match):
    """``tba.make_engine("io_uring", queue_depth=5000)`` raised the ring's bare ValueError, ``queue_depth="8"`` a
    TypeError and ``queue_depth=True`` built a ring of one, where ``queue_depth=`` as an option is a TbaConfigError
    (its docstring promises one too; helper-168)."""
    if backend not in tba.available_backends() or tba.available_backends()[backend] is not None:
        pytest.skip(f"{backend} is not usable here")
    with pytest.raises(TbaConfigError, match=match):
        make_engine(backend, queue_depth=depth)
