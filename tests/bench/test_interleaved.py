"""Modes measured by turns in one process: each its own model, steps alternating, losses step for step."""

from __future__ import annotations

import dataclasses

import pytest

from tba.bench import interleaved
from tba.bench.isolated import IsolatedRunError, fork_server
from tba.bench.mode_run import ModeRun
from tba.bench.models import PRESETS

TINY = PRESETS["tiny"]


@pytest.fixture
def order(monkeypatch) -> list[tuple[str, int, bool]]:
    """Every step taken, in order: (mode, step index, measured)."""
    taken: list[tuple[str, int, bool]] = []
    real_step = ModeRun.step

    def recording_step(self, index, **kwargs):
        taken.append((self.mode, index, kwargs.get("measured", True)))
        return real_step(self, index, **kwargs)

    monkeypatch.setattr(ModeRun, "step", recording_step)
    return taken


def test_modes_take_turns_and_exact_ones_lose_alike(spill_dir, order):
    results = interleaved.run_interleaved(["keep", "recompute", "tba"], TINY, rounds=2, warmup=1,
                                          directory=spill_dir, backend="threads")
    assert order == [(mode, step, step >= 1) for step in range(3) for mode in ("keep", "recompute", "tba")]
    assert [len(r.step_s) for r in results.values()] == [2, 2, 2]
    assert results["recompute"].losses == results["tba"].losses == results["keep"].losses
    assert len(results["keep"].losses) == 3 and results["tba"].offload_stats["tensors_offloaded"] > 0


def test_an_adaptive_mode_profiles_first_and_its_measured_steps_share_the_turns(spill_dir, order):
    results = interleaved.run_interleaved(["keep", "adaptive"], TINY, rounds=2, warmup=1, directory=spill_dir,
                                          backend="threads", offload_options={"adaptive": {"profile_steps": 2}})
    # adaptive warms up for 3 steps (1 + 2 profiled), keep for 1: adaptive starts two turns earlier
    assert order == [("adaptive", 0, False), ("adaptive", 1, False), ("keep", 0, False), ("adaptive", 2, False),
                     ("keep", 1, True), ("adaptive", 3, True), ("keep", 2, True), ("adaptive", 4, True)]
    assert results["adaptive"].losses[:3] == results["keep"].losses
    assert len(results["adaptive"].step_s) == len(results["keep"].step_s) == 2


def test_each_mode_once():
    with pytest.raises(ValueError, match="each mode once"):
        interleaved.run_interleaved(["keep", "keep"], TINY)


def test_rounds_must_be_positive():
    with pytest.raises(ValueError, match="rounds must be at least 1"):
        interleaved.run_interleaved(["keep"], TINY, rounds=0)


def test_a_failed_mode_unwraps_and_closes_the_others(spill_dir, monkeypatch):
    runs = []
    real_init = ModeRun.__init__

    def recording_init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        runs.append(self)

    monkeypatch.setattr(ModeRun, "__init__", recording_init)
    with pytest.raises(ValueError, match="unknown mode"):
        interleaved.run_interleaved(["recompute", "tba", "no-such-mode"], TINY, rounds=1, directory=spill_dir)
    recompute, offloading = runs
    assert all("forward" not in vars(block) for block in recompute.model.blocks)
    assert repr(offloading.offloader).endswith(", closed)")


@pytest.mark.slow
def test_in_a_fresh_process_and_in_a_forked_child(spill_dir):
    config = {"batch_size": 3}
    options = dict(rounds=1, warmup=1, directory=spill_dir, backend="threads", config_overrides=config)
    fresh = interleaved.run_interleaved_isolated(["keep", "tba"], "tiny", **options)
    with fork_server() as server:
        forked = interleaved.run_interleaved_isolated(["keep", "tba"], "tiny", server=server, **options)
        with pytest.raises(IsolatedRunError, match="unknown mode"):
            interleaved.run_interleaved_isolated(["keep", "no-such-mode"], "tiny", server=server, **options)
    here = interleaved.run_interleaved(["keep"], dataclasses.replace(TINY, **config), rounds=1, warmup=1)
    assert fresh["keep"].losses == fresh["tba"].losses == forked["tba"].losses == here["keep"].losses
    assert list(fresh) == ["keep", "tba"] and len(fresh["tba"].step_s) == 1
