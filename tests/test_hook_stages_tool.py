"""tools/hook_stages.py: each variant runs and is measured, its patches are undone, gradients stay exact, bad values
are refused."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch
from utils import load_script

from tba.runtime._hooks import SavedTensorHooks
from tba.runtime._host_io import HostBatch

TOOLS = pathlib.Path(__file__).resolve().parents[1] / "tools"


@pytest.fixture
def stages():
    return load_script(TOOLS / "hook_stages.py")


def test_every_variant_is_measured_and_the_patches_are_undone(stages, tmp_path, capsys):
    before = vars(SavedTensorHooks)["_save_job"], vars(HostBatch)["write"]
    out = tmp_path / "stages.json"
    assert stages.main(["--count", "6", "--size", "64K", "--rounds", "2", "--directory", str(tmp_path),
                        "--json", str(out)]) == 0
    assert (vars(SavedTensorHooks)["_save_job"], vars(HostBatch)["write"]) == before
    printed = capsys.readouterr().out
    for name in stages.VARIANTS:
        assert f"\n{name} " in printed
    seconds = json.loads(out.read_text())["seconds"]
    assert sorted(seconds) == sorted(["base", *stages.VARIANTS])
    assert all(len(rounds) == 2 and all(s > 0 for s in rounds) for rounds in seconds.values())
    assert [p.name for p in tmp_path.iterdir()] == ["stages.json"]  # its spill directory is gone


@pytest.mark.parametrize("name", ["pack", "bookkeeping", "full"])
def test_a_patched_variant_still_trains_exactly(stages, tmp_path, name):
    """The variants differ in what tba does with the bytes, never in the gradients the loop gets."""
    torch.manual_seed(0)
    leaves = [torch.randn(1 << 14, requires_grad=True) for _ in range(5)]
    stages.forward_seconds(leaves, "base", str(tmp_path))
    expected = [leaf.grad.clone() for leaf in leaves]
    stages.forward_seconds(leaves, name, str(tmp_path))
    assert all(torch.equal(leaf.grad, grad) for leaf, grad in zip(leaves, expected))


def test_a_failing_variant_leaves_no_patch(stages, tmp_path):
    before = vars(SavedTensorHooks)["_save_job"]
    with pytest.raises(RuntimeError), stages._variant("pack"):
        assert vars(SavedTensorHooks)["_save_job"] is stages._keep_only
        raise RuntimeError("a forward failed")
    assert vars(SavedTensorHooks)["_save_job"] is before


@pytest.mark.parametrize("argv, match", [
    (["--count", "0"], "argument --count: 0 is too small"),
    (["--size", "6"], "argument --size: '6' must be a multiple of 4 bytes"),
    (["--size", "0"], "argument --size: '0' is not positive"),
    (["--size", "big"], "argument --size:"),
    (["--rounds", "x"], "argument --rounds: 'x' is not a whole number"),
    (["--json", "/proc/none/x.json"], "--json /proc/none/x.json"),
    (["--directory", "/nonexistent/here"], "--directory /nonexistent/here does not exist"),
])
def test_bad_values_are_refused(stages, argv, match, capsys):
    with pytest.raises(SystemExit) as exit_:
        stages.main(argv)
    assert exit_.value.code == 2
    assert match in capsys.readouterr().err
