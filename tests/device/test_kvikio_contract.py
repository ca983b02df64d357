"""The kvikio package tba runs against has every attribute tba calls (and so does the fake of the simulator)."""

from __future__ import annotations

import importlib
import inspect
import operator

import pytest

from tba.device._kvikio import KVIKIO_API
from tba.device.sim import fake_kvikio


def _resolve(module, dotted: str):
    return operator.attrgetter(dotted)(module)


def test_installed_kvikio_has_every_attribute_tba_calls():
    try:
        kvikio = importlib.import_module("kvikio")
        for sub in ("kvikio.defaults", "kvikio.cufile_driver"):
            importlib.import_module(sub)
    except Exception as err:  # ImportError, or a missing libcufile / libcuda at import
        pytest.skip(f"kvikio is not importable here ({type(err).__name__}: {err}); install kvikio-cu12 or "
                    "kvikio-cu13 on a GPU machine to run this contract test")
    missing = []
    for dotted in KVIKIO_API:
        try:
            _resolve(kvikio, dotted)
        except AttributeError:
            missing.append(dotted)
    assert not missing, f"kvikio {getattr(kvikio, '__version__', '?')} lacks {missing}"
    for name in ("pwrite", "pread"):  # Note [A transfer waits for every piece it started] passes task_size
        assert list(inspect.signature(getattr(kvikio.CuFile, name)).parameters)[1:5] == [
            "buf", "size", "file_offset", "task_size"], name


def test_the_fake_kvikio_has_the_same_attributes(sim):
    with fake_kvikio(sim) as fake:
        for dotted in KVIKIO_API:
            _resolve(fake.module, dotted)
        for name in ("pwrite", "pread"):
            assert list(inspect.signature(getattr(fake.module.CuFile, name)).parameters)[1:5] == [
                "buf", "size", "file_offset", "task_size"], name
