"""The registry of runners that bare one-shot contexts share stays bounded (Note [Bare contexts' runners
are bounded] in tba/runtime/_shared_runners.py)."""

from __future__ import annotations

import copy
import gc

import torch

import tba
from tba import _control
from tba.bench.models import PRESETS, make_batch, make_gpt
from tba.runtime import _shared_runners


def _runners_in(root) -> list[tuple]:
    return [key for key in _shared_runners._SHARED_BARE_RUNNERS if str(key[0]).startswith(str(root))]


def _train(model, batch, directory, steps: int) -> list[torch.Tensor]:
    losses = []
    for step in range(steps):
        torch.manual_seed(step)  # the same dropout masks as the reference's
        with tba.offload_activations(directory):
            loss = model(*batch)
        loss.backward()
        losses.append(loss.detach())
    return losses


def test_a_sweep_on_fresh_directories_leaves_one_runner(tmp_path):
    # Each trial's model learns its layers on a directory of its own, then is freed: its runner holds
    # nothing a new one would not, and goes when the next trial's runner comes.
    config = PRESETS["tiny"]
    for trial in range(4):
        model, batch = make_gpt(config, seed=trial), make_batch(config)
        _train(model, batch, tmp_path / f"trial{trial}", steps=2)
        del model
        _control.settle()
        gc.collect()
    assert _runners_in(tmp_path) == [key for key in _runners_in(tmp_path) if str(key[0]).endswith("trial3")]
    assert len(_runners_in(tmp_path)) == 1, "a freed model's runner stayed registered for its directory"


def test_live_models_beyond_the_bound_profile_again_and_stay_exact(tmp_path, monkeypatch):
    monkeypatch.setattr(_shared_runners, "MAX_BARE_RUNNERS", 2)
    config = PRESETS["tiny"]
    models = [make_gpt(config, seed=i) for i in range(3)]
    references = [copy.deepcopy(model) for model in models]
    batch = make_batch(config)
    directories = [tmp_path / f"d{i}" for i in range(3)]
    losses, expected = [], []

    def train(i: int, steps: int) -> None:
        losses.extend(_train(models[i], batch, directories[i], steps))
        for step in range(steps):
            torch.manual_seed(step)
            loss = references[i](*batch)
            loss.backward()
            expected.append(loss.detach())

    for i in range(3):
        train(i, steps=1)
        assert len(_runners_in(tmp_path)) <= 2
    # The least recently used (d0) went; using d1 again keeps its runner and makes it the most recent.
    assert _names(tmp_path) == ["d1", "d2"]
    runner = _shared_runners._SHARED_BARE_RUNNERS[_runners_in(tmp_path)[0]]
    train(1, steps=1)
    assert _names(tmp_path) == ["d2", "d1"]
    assert _shared_runners._SHARED_BARE_RUNNERS[_runners_in(tmp_path)[-1]] is runner
    # d0 gets a new runner, which finds the layers, profiles and plans again; d2 goes.
    train(0, steps=4)
    assert _names(tmp_path) == ["d1", "d0"]
    assert all(torch.equal(a, b) for a, b in zip(losses, expected, strict=True))
    for model, reference in zip(models, references):
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad)


def _names(root) -> list[str]:
    return [str(key[0]).rsplit("/", 1)[-1] for key in _runners_in(root)]
