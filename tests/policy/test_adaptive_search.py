"""The pruned adaptive search chooses what costing every shape chose: a differential test against a copy of
the planner before helper-107 made it prune (Note [The search prunes on lower bounds] in
``tba/policy/_shape_costs.py``), on seeded random profiles of 1-40 layers and both goals.

Plans must be equal field by field: decisions, window, goal, fits, the predicted step time and memory
(exactly: both are ``estimate`` of the same placement and window) and the write caps; a refused budget must
raise the same message.
"""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

from tba.defaults import MIB
from tba.errors import TbaConfigError
from tba.policy import LayerProfile, Profile, plan
from tba.policy._adaptive import budget_text
from tba.policy._model import estimate, forward_write_caps
from tba.policy._placement import OFFLOAD, RECOMPUTE, RECOMPUTED
from tba.policy._plan import _io_bytes, _plan_of, min_window_bytes, shapes


def reference_plan(profile, *, memory_budget_bytes=None, overhead_bound=None):
    """The adaptive planner as it was before the search pruned (cost every allowed shape, in order)."""
    allowed = [decisions for decisions in shapes(len(profile.layers))
               if all(layer.recomputable or d not in RECOMPUTED for layer, d in zip(profile.layers, decisions))]

    def lower(current, candidate):
        return candidate if current is None or candidate[0] < current[0] else current

    def search(profile, goal, rank, warning):
        low, high = min_window_bytes(profile), profile.max_window_bytes
        best = fallback = None
        for decisions in allowed:
            option, met = rank(decisions, low, high)
            fallback = lower(fallback, option)
            if met is not None:
                best = lower(best, met)
        if best is not None:
            return _plan_of(profile, best[1], best[2], goal)
        closest = _plan_of(profile, fallback[1], fallback[2], goal, fits=False)
        warning(closest)
        return closest

    if memory_budget_bytes is not None:
        profile, budget = profile.for_budget(), memory_budget_bytes

        def largest_window(decisions, low, high):
            if estimate(profile, decisions, high).memory_bytes <= budget:
                return high
            if OFFLOAD not in decisions or estimate(profile, decisions, low).memory_bytes > budget:
                return None
            lo, hi = low // MIB, high // MIB
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if mid * MIB < high and estimate(profile, decisions, mid * MIB).memory_bytes <= budget:
                    lo = mid
                else:
                    hi = mid - 1
            return max(lo * MIB, low)

        def rank(decisions, low, high):
            window = largest_window(decisions, low, high)
            cost = estimate(profile, decisions, window if window is not None else low)
            least = (cost.memory_bytes, cost.step_s, decisions.count(RECOMPUTE), -decisions.count(OFFLOAD))
            if window is None:
                return (least, decisions, low), None
            key = (round(cost.step_s, 9), _io_bytes(profile, decisions), cost.memory_bytes, decisions.count(RECOMPUTE))
            return (least, decisions, window), (key, decisions, window)

        def refuse(least):
            slack = profile.memory_slack_bytes
            measured = (f", {slack / MIB:.1f} MiB of it transient buffers measured while profiling (the process's peak: "
                        "what other threads allocated meanwhile counts too)") if slack else ""
            raise TbaConfigError(
                f"memory_budget={budget_text(budget)} cannot be met: this model needs at least "
                f"{least.predicted_memory_bytes / MIB:.1f} MiB of activations (plan {least.code}{measured}); "
                "raise memory_budget, or lower the batch size or sequence length")

        chosen = search(profile, f"memory_budget_bytes={budget}", rank, refuse)
        caps = forward_write_caps(profile, chosen.decisions, chosen.window_bytes, budget)
        return dataclasses.replace(chosen, write_caps_bytes=caps)

    bound = overhead_bound

    def smallest_window(decisions, limit_s, low, high):
        if OFFLOAD not in decisions or estimate(profile, decisions, low).step_s <= limit_s + 1e-9:
            return low if OFFLOAD in decisions else high
        lo, hi = low // MIB + 1, -(-high // MIB)
        while lo < hi:
            mid = (lo + hi) // 2
            if estimate(profile, decisions, min(mid * MIB, high)).step_s <= limit_s + 1e-9:
                hi = mid
            else:
                lo = mid + 1
        return min(lo * MIB, high)

    def rank_time(decisions, low, high):
        cost = estimate(profile, decisions, high)
        fastest = ((round(cost.step_s, 9), cost.memory_bytes), decisions, high)
        if cost.step_s > (1 + bound) * floor + 1e-9:
            return fastest, None
        window = smallest_window(decisions, (1 + bound) * floor, low, high)
        cost = estimate(profile, decisions, window)
        key = (cost.memory_bytes, round(cost.step_s, 9), _io_bytes(profile, decisions), decisions.count(RECOMPUTE))
        return fastest, (key, decisions, window)

    floor = min(estimate(profile, decisions, profile.max_window_bytes).step_s for decisions in allowed)
    return search(profile, f"overhead_bound={bound:g}", rank_time, lambda _: None)


def random_profile(rng: random.Random, layer_count: int) -> Profile:
    """A profile with every knob of the model drawn: sizes from bytes to GiB (MiB-aligned or not), zero and
    infinite bandwidths' edges, layers that cannot be recomputed, every prefetch depth and window."""
    scale = rng.choice([1, 1000, MIB, 64 * MIB])
    uniform = rng.random() < 0.3  # repeated layers: many equal keys, so ties decide
    template = None
    layers = []
    for _ in range(layer_count):
        if uniform and template is not None:
            layers.append(template)
            continue
        forward = rng.choice([0.0, rng.uniform(0.001, 0.05), rng.uniform(0.5, 2.0)])
        backward = rng.choice([None, 2 * forward, rng.uniform(0.0, 0.1)])
        saved = rng.choice([0, rng.randrange(1, 200) * scale, rng.randrange(1, 10**9)])
        layers.append(template := LayerProfile(
            forward_s=forward, backward_s=backward, backward_measured=backward is not None, saved_bytes=saved,
            input_bytes=rng.choice([0, saved // rng.randrange(1, 20), rng.randrange(1, 50) * scale]),
            recomputable=rng.random() > 0.1))
    largest = max((layer.saved_bytes for layer in layers), default=0)
    write = rng.choice([rng.uniform(10, 4000) * MIB, math.inf, rng.uniform(0.5, 5) * largest + 1])
    return Profile(
        tuple(layers), write_bytes_per_s=write,
        read_bytes_per_s=rng.choice([rng.uniform(10, 8000) * MIB, math.inf, rng.uniform(0.5, 5) * largest + 1]),
        max_storage_bytes=rng.choice([0, largest // rng.randrange(1, 8), rng.randrange(0, 64) * MIB]),
        prefetch_depth_layers=rng.choice([0, 1, 1, 2, 3, 50]),
        max_window_bytes=rng.choice([512 * MIB, rng.randrange(1, 2048) * MIB, rng.randrange(1, 10**9)]),
        memory_slack_bytes=rng.choice([0, rng.randrange(0, 10**9)]),
        memory_headroom_per_io_byte=rng.choice([0.0, rng.uniform(0, 0.5)]),
        io_overhead_s_per_byte=rng.choice([0.0, rng.uniform(0, 1e-9)]),
        read_stall_credit_s_per_byte=rng.choice([0.0, rng.uniform(0, 1e-9)]),
        outside_s=rng.choice([0.0, rng.uniform(0, 1)]),
        drain_bytes_per_s=rng.choice([None, write / 2 if write < math.inf else 100 * MIB]))


def layer_count(rng: random.Random) -> int:
    """Mostly a few layers (where the reference is fast), sometimes up to 40."""
    return rng.choice([rng.randint(1, 8), rng.randint(1, 16), rng.randint(1, 40) if rng.random() < 0.15 else 3])


def outcome(profile, **goal):
    """The plan, or the refusal's message."""
    try:
        return plan(profile, **goal)
    except TbaConfigError as err:
        return str(err)


def reference_outcome(profile, **goal):
    try:
        return reference_plan(profile, **goal)
    except TbaConfigError as err:
        return str(err)


@pytest.mark.parametrize("seed", range(12))
def test_pruned_search_plans_as_costing_every_shape(seed):
    rng = random.Random(seed)
    for _ in range(20):
        profile = random_profile(rng, layer_count(rng))
        keep_bytes = estimate(profile.for_budget(), ["keep"] * len(profile.layers)).memory_bytes
        for goal in ({"overhead_bound": rng.choice([0.0, 0.01, 0.05, 0.3, 2.0])},
                     {"memory_budget_bytes": int(keep_bytes * rng.choice([0.02, 0.1, 0.3, 0.6, 0.95, 1.5]))},
                     {"memory_budget_bytes": rng.randrange(0, 2 * keep_bytes + 2)}):
            assert outcome(profile, **goal) == reference_outcome(profile, **goal), (goal, profile)


def test_pruned_search_on_float_sizes_plans_as_before():
    """Sizes that are not whole numbers send the memory to ``estimate`` (no prefix sums): the same plans."""
    rng = random.Random(7)
    for _ in range(10):
        base = random_profile(rng, rng.randint(1, 10))
        profile = dataclasses.replace(base, layers=tuple(
            dataclasses.replace(layer, saved_bytes=layer.saved_bytes * 1.5, input_bytes=layer.input_bytes + 0.5)
            for layer in base.layers))
        keep_bytes = estimate(profile.for_budget(), ["keep"] * len(profile.layers)).memory_bytes
        for goal in ({"overhead_bound": 0.05}, {"memory_budget_bytes": int(keep_bytes * 0.4)}):
            assert outcome(profile, **goal) == reference_outcome(profile, **goal)


def gpt_like(layer_count: int) -> Profile:
    """Blocks of 10 ms forward, 96 MiB saved and 12 MiB of input on a disk writing 1.5 GB/s and reading 2.5 GB/s."""
    layer = LayerProfile(forward_s=0.010, backward_s=0.020, saved_bytes=96 * MIB, input_bytes=12 * MIB)
    return Profile((layer,) * layer_count, write_bytes_per_s=1.5e9, read_bytes_per_s=2.5e9, max_storage_bytes=12 * MIB,
                   memory_slack_bytes=64 * MIB, memory_headroom_per_io_byte=0.05, io_overhead_s_per_byte=2e-12,
                   outside_s=0.05)


@pytest.mark.parametrize("goal", [{}, {"memory_budget_bytes": 48 * 29 * MIB}])
def test_the_search_runs_the_cost_model_on_few_shapes(monkeypatch, goal):
    """Running the model on every one of the 2401 shapes of 48 layers, several times while a window was searched,
    made planning cubic in the layers (1.2 s for 48 layers, 10 s for 96): it now runs on the few that could win."""
    import tba.policy._adaptive as adaptive

    calls = []
    monkeypatch.setattr(adaptive, "estimate", lambda *args: calls.append(args) or estimate(*args))
    profile = gpt_like(48)
    assert plan(profile, **goal) == reference_plan(gpt_like(48), **({"overhead_bound": 0.05} | goal))
    assert len(calls) < 200


@pytest.mark.parametrize("seconds", [1e308, 1e300])
def test_times_beyond_floats_plan_as_before(seconds):
    """Layer times whose sums overflow to inf (finite each, so a profile accepts them): the step bound is inf - inf,
    which bounds nothing; it had pruned every shape and planned RRK, 'goal NOT met', for OOO."""
    layer = LayerProfile(forward_s=seconds, backward_s=seconds, saved_bytes=100 * MIB, input_bytes=10 * MIB)
    profile = Profile((layer,) * 3, 1000 * MIB, 1000 * MIB, max_storage_bytes=10 * MIB)
    for goal in ({"overhead_bound": 0.05}, {"memory_budget_bytes": 150 * MIB}):
        assert outcome(profile, **goal) == reference_outcome(profile, **goal)
