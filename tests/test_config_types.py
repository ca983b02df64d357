"""Options of the wrong type or range fail at the ``with`` line with :class:`tba.TbaConfigError`."""

from __future__ import annotations

import copy
import inspect
import os
import pickle
import subprocess
import uuid

import pytest
import torch

import tba
from tba import TbaConfigError


@pytest.mark.parametrize(
    "options, match",
    [
        ({"queue_depth": 100000}, "queue_depth must be in 1..4096"),
        ({"queue_depth": 0}, "queue_depth must be in 1..4096"),
        ({"block_size_bytes": "4 lots"}, "block_size_bytes: not a size"),
        ({"min_offload_bytes": 1.5}, "min_offload_bytes must be bytes"),
        ({"staging_bytes": [1]}, "staging_bytes must be bytes"),
        ({"prefetch_budget_bytes": 2.0**20}, "prefetch_budget_bytes must be bytes"),
        ({"direct_io": "False"}, "direct_io must be True or False or None"),
        ({"memory_budget_bytes": float("nan"), "policy": "adaptive"}, "memory_budget_bytes must be bytes"),
        ({"overhead_bound": "0.1", "policy": "adaptive"}, "overhead_bound must be a finite number"),
        ({"overhead_bound": float("nan"), "policy": "adaptive"}, "overhead_bound must be a finite number"),
        ({"overhead_bound": True, "policy": "adaptive"}, "overhead_bound must be a finite number"),
        ({"memory_budget_bytes": True, "policy": "adaptive"}, "memory_budget_bytes must be bytes"),
        ({"directory": "/tmp/a\0b"}, "NUL byte"),
        ({"queue_dept": 8}, "unknown option 'queue_dept'; did you mean 'queue_depth'"),
        ({"directory": ""}, "directory is empty"),
    ],
)
def test_bad_option_types(spill_dir, options, match):
    options = {"directory": spill_dir, **options}
    with pytest.raises(TbaConfigError, match=match):
        with tba.offload_activations(**options):
            pytest.fail("the block must not run")


def test_tilde_is_expanded(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    name = f"tba-{uuid.uuid4().hex}"
    x = torch.randn(64, 1024, requires_grad=True)
    with tba.offload_activations(f"~/{name}", min_offload_bytes=0) as off:
        y = (x * 2).sin().sum()
    y.backward()
    assert off.spill.directory == str(tmp_path / name)
    assert not (tmp_path / "~").exists()


@pytest.fixture
def readonly_dir(tmp_path):
    path = tmp_path / "ro"
    path.mkdir()
    if os.geteuid() != 0:
        path.chmod(0o500)
        yield str(path)
        path.chmod(0o700)
        return
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(path)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs: {done.stderr.decode().strip()}")
    try:
        yield str(path)
    finally:
        subprocess.run(["umount", str(path)], check=False)


def test_readonly_directory_is_a_config_error(readonly_dir, caplog):
    with pytest.raises(TbaConfigError, match="not writable"):
        with tba.offload_activations(readonly_dir):
            pytest.fail("the block must not run")
    assert "buffered I/O" not in caplog.text


def test_a_misspelt_option_of_offload_config_names_the_closest():
    with pytest.raises(TbaConfigError, match="unknown option 'memory_budjet'; did you mean 'memory_budget'"):
        tba.OffloadConfig(memory_budjet="1G")
    config = tba.OffloadConfig(queue_depth=16)
    assert copy.deepcopy(config) == config and pickle.loads(pickle.dumps(config)) == config
    assert "queue_depth" in inspect.signature(tba.OffloadConfig).parameters  # help() shows the fields
