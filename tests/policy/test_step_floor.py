"""StepFloor: a lower bound of the cost model's step time for every placement shape and window, and a useful one."""

from __future__ import annotations

import random

import pytest

from tba.defaults import MIB
from tba.policy import LayerProfile, Profile, min_window_bytes
from tba.policy._model import estimate
from tba.policy._shape_costs import decisions_of, shape_list
from tba.policy._step_floor import StepFloor
from tests.policy.test_adaptive_search import layer_count, random_profile


@pytest.mark.parametrize("seed", range(6))
def test_floor_is_at_most_the_models_step_time(seed):
    rng = random.Random(seed)
    for _ in range(25):
        profile = random_profile(rng, layer_count(rng))
        floor = StepFloor(profile)
        windows = (min_window_bytes(profile), profile.max_window_bytes, 0, rng.randrange(0, 1024) * MIB)
        for shape in shape_list(len(profile.layers)):
            decisions = decisions_of(shape, len(profile.layers))
            bound = floor.step_s(shape)
            for window in windows:
                assert bound <= estimate(profile, decisions, window).step_s, (shape, window, profile)


def test_floor_counts_reads_that_cannot_start_earlier():
    """Offloaded layers reading for 2 s each under 1 s of backward: from the first offloaded layer's read on, backward
    waits for the reads (Note [A spilled layer's read starts no earlier than D layers above it])."""
    layer = LayerProfile(forward_s=0.5, backward_s=1.0, saved_bytes=200 * MIB, input_bytes=MIB)
    profile = Profile((layer,) * 8, write_bytes_per_s=10_000 * MIB, read_bytes_per_s=100 * MIB)
    offload_four = (4, False, 0)
    # Layer 3's read starts with layer 4's backward, after 3 s; the four reads take 8 s: backward >= 11 s of its 8 s
    # of compute (reading 8 s in 8 s of compute alone would bound nothing), and the model says 11 s too.
    assert StepFloor(profile).step_s(offload_four) == pytest.approx(4 + 11, abs=1e-6)
    assert estimate(profile, decisions_of(offload_four, 8)).step_s == pytest.approx(4 + 11)
