"""ShapeCosts: the memory of every placement shape equals the cost model's, at every window."""

from __future__ import annotations

import random

import pytest

from tba.defaults import MIB
from tba.policy import min_window_bytes, shapes
from tba.policy._model import estimate
from tba.policy._shape_costs import ShapeCosts, decisions_of, shape_list
from tests.policy.test_adaptive_search import layer_count, random_profile


def test_shape_list_is_shapes_in_order():
    for count in (1, 2, 5, 9):
        assert [decisions_of(shape, count) for shape in shape_list(count)] == shapes(count)


@pytest.mark.parametrize("seed", range(6))
def test_memory_is_the_models_at_every_window(seed):
    rng = random.Random(seed)
    for _ in range(25):
        profile = random_profile(rng, layer_count(rng))
        low, high = min_window_bytes(profile), profile.max_window_bytes
        costs = ShapeCosts(profile, (low, high))
        windows = (low, high, 0, rng.randrange(0, 1024) * MIB, rng.randrange(0, 10**9))
        for shape in shape_list(len(profile.layers)):
            decisions = decisions_of(shape, len(profile.layers))
            for window in windows:
                assert costs.memory_bytes(shape, window) == estimate(profile, decisions, window).memory_bytes, (
                    shape, window, profile)
