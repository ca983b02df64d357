"""Capacity search on fake measurements: linear peaks, a confirmation that disagrees, failures."""

from __future__ import annotations

import pytest

from tba.cli._capacity_search import MeasureError, Point, find_max_batch, linear_fit, predict

MIB = 1 << 20


def linear(a, b, calls):
    def measure(batch):
        calls.append(batch)
        return Point(batch, peak_bytes=a + b * batch, step_s=0.1 * batch)
    return measure


def test_linear_peaks_are_found_with_probes_a_capped_guess_and_one_confirmation():
    calls = []
    search = find_max_batch(linear(10 * MIB, 3 * MIB, calls), 100 * MIB, probes=(1, 2))
    assert search.max_batch == 30 and search.confirmed and not search.capped  # 10 + 3 * 30 = 100
    # 8x the largest batch measured (far below the budget: no confirmation at 17), then the line's prediction
    assert calls == [1, 2, 16, 30, 31]
    assert search.predicted == 30 and search.fit == pytest.approx((10 * MIB, 3 * MIB))


def test_a_confirmation_that_disagrees_is_adjusted():
    calls = []

    def convex(batch):  # looks linear at small batches, grows faster later
        calls.append(batch)
        return Point(batch, peak_bytes=10 * MIB + 3 * MIB * batch + (MIB * (batch - 10) ** 2 // 4 if batch > 10 else 0))

    search = find_max_batch(convex, 100 * MIB, probes=(1, 2))
    truth = max(b for b in range(1, 100) if convex(b).peak_bytes <= 100 * MIB)
    assert search.max_batch == truth and search.confirmed
    assert calls[:3] == [1, 2, 16] and len(calls) <= 4 + 2 * 3 + 100  # probes, confirmations, truth scan


def test_a_confirmation_above_the_prediction_that_still_fits_moves_up():
    calls = []
    steps = iter([MIB, 2 * MIB])  # probes overestimate the slope (small tensors kept in memory)

    def measure(batch):
        calls.append(batch)
        peak = next(steps, None) or MIB // 2 * batch + MIB
        return Point(batch, peak_bytes=peak)

    search = find_max_batch(measure, 21 * MIB, probes=(1, 2))
    assert search.max_batch == 40 and search.confirmed  # 0.5 MiB * 40 + 1 MiB = 21 MiB
    assert calls[2] == 16 and 17 not in calls  # 9 MiB at 16: far below the budget, so not confirmed


def test_a_guess_near_the_budget_is_confirmed_and_one_far_below_it_is_not():
    near, far = [], []
    find_max_batch(linear(0, 4.5 * MIB, near), 512 * MIB, probes=(13, 26))
    assert near[:4] == [13, 26, 113, 114]  # 508.5 MiB at 113: within CONFIRM_MARGIN of the budget
    search = find_max_batch(linear(0, 3 * MIB, far), 300 * MIB, probes=(13, 26), first_guess=60)
    assert far[:4] == [13, 26, 60, 100] and search.max_batch == 100 and search.confirmed  # 180 MiB at 60


def test_a_strategy_that_raises_at_its_first_probe_is_reported_failed():
    calls = []

    def measure(batch):
        calls.append(batch)
        raise MeasureError("ValueError: unknown decision 'offloaded_recompute'")

    search = find_max_batch(measure, 100 * MIB, probes=(4, 8))
    assert search.max_batch is None and "unknown decision" in search.error and calls == [4]


def test_a_failure_at_a_larger_batch_counts_as_not_fitting():
    def measure(batch):
        if batch > 12:
            raise MeasureError("TbaConfigError: budget cannot be met")
        return Point(batch, peak_bytes=MIB * batch)

    search = find_max_batch(measure, 100 * MIB, probes=(1, 2))
    assert search.max_batch == 12 and search.confirmed
    assert search.point(13).error.startswith("TbaConfigError")


def test_nothing_fits_and_the_cap():
    search = find_max_batch(linear(200 * MIB, MIB, []), 100 * MIB, probes=(1, 2))
    assert search.max_batch == 0 and search.confirmed
    capped = find_max_batch(linear(MIB, 0, []), 100 * MIB, probes=(1, 2), max_batch=64)
    assert capped.max_batch == 64 and capped.capped and not capped.confirmed


def test_fit_and_prediction_edges():
    assert linear_fit([Point(1, error="x")]) is None
    assert linear_fit([Point(4, peak_bytes=8)]) == (0.0, 2.0)
    assert predict((0.0, 0.0), 10, max_batch=7) == 7 and predict((20.0, 0.0), 10) == 0
    assert predict((0.0, 3.0), 10) == 3


def test_after_the_confirmation_each_round_measures_one_batch():
    calls = []

    def measure(batch):  # the probes' slope is a little high, as with full recompute on the deep preset
        calls.append(batch)
        return Point(batch, peak_bytes=(4 if batch <= 26 else 3) * MIB * batch)

    search = find_max_batch(measure, 512 * MIB, probes=(13, 26))
    assert search.max_batch == 170 and search.confirmed  # 3 MiB * 170 = 510 MiB
    # 384 MiB at 128: far below the budget, so the refitted line guesses next instead of confirming 129
    assert calls[:4] == [13, 26, 128, 172] and len(calls) == len(set(calls)) <= 4 + 3


def test_a_flat_peak_grows_the_batch_geometrically_instead_of_jumping_to_the_cap():
    calls = []

    def measure(batch):  # an adaptive plan spends the budget at every batch, until none fits
        calls.append(batch)
        if batch > 100:
            raise MeasureError("TbaConfigError: memory_budget cannot be met")
        return Point(batch, peak_bytes=400 * MIB + batch)

    search = find_max_batch(measure, 512 * MIB, probes=(13, 26))
    assert 90 <= search.max_batch <= 100 and search.predicted == 4096
    fitted = 0
    for batch in calls:
        assert batch <= 8 * max(fitted, 1) + 1 or batch <= 26, calls
        if batch <= 100:
            fitted = max(fitted, batch)


def test_a_flat_fit_that_predicts_below_a_fitting_batch_doubles_it():
    calls = []

    def measure(batch):  # adaptive peaks, noisy and falling: the line predicts nothing fits
        calls.append(batch)
        if batch > 100:
            raise MeasureError("TbaConfigError: memory_budget cannot be met")
        return Point(batch, peak_bytes=(480 if batch == 13 else 400) * MIB)

    search = find_max_batch(measure, 512 * MIB, probes=(13, 26))
    assert calls[:4] == [13, 26, 52, 104], calls  # not 27, 28, ... one sample a round
    assert search.max_batch <= 100 and len(calls) <= 4 + 6


def test_a_first_guess_replaces_the_prediction_and_an_over_guess_skips_its_neighbour():
    calls = []

    def measure(batch):
        calls.append(batch)
        if batch > 160:
            raise MeasureError("TbaConfigError: memory_budget=512.0 MiB cannot be met", needed_bytes=16 * batch * MIB // 5)
        return Point(batch, peak_bytes=500 * MIB)

    search = find_max_batch(measure, 512 * MIB, probes=(13,), first_guess=267)
    # 267 refused, needing 3.2 MiB a sample: 267 x 512 / 854.4 = 160, which fits, and 161 does not
    assert calls == [13, 267, 160, 161]
    assert search.max_batch == 160 and search.confirmed and search.point(267).needed_bytes == 16 * 267 * MIB // 5


def test_a_tolerance_ends_the_search_within_that_fraction():
    calls = []

    def noisy(batch):  # over the budget from 205, with peaks that do not say so clearly
        calls.append(batch)
        return Point(batch, peak_bytes=(600 if batch >= 205 else 2 * batch) * MIB)

    exact = find_max_batch(noisy, 512 * MIB, probes=(13, 26))
    assert exact.max_batch == 204 and exact.confirmed and exact.next_over == 205
    rounds_exact = len(calls)
    calls.clear()
    loose = find_max_batch(noisy, 512 * MIB, probes=(13, 26), tolerance=0.02)
    assert not loose.confirmed and loose.next_over - loose.max_batch <= 0.02 * loose.max_batch
    assert 200 <= loose.max_batch <= 204 and len(calls) < rounds_exact



def test_with_a_tolerance_the_confirmation_steps_by_it():
    calls = []
    search = find_max_batch(linear(0, 2 * MIB, calls), 512 * MIB, probes=(100, 200), tolerance=0.02)
    assert calls == [100, 200, 256, 261] and search.max_batch == 256 and search.next_over == 261


def test_a_first_guess_outside_the_bracket_is_not_run():
    calls = []

    def measure(batch):  # the probe at keep-all's batch comes in just over the budget
        calls.append(batch)
        return Point(batch, peak_bytes=(520 if batch == 13 else 400) * MIB)

    search = find_max_batch(measure, 512 * MIB, probes=(13,), first_guess=200, tolerance=0.02)
    assert 200 not in calls and search.max_batch < 13


def test_over_at_is_claimed_only_when_the_search_settled():
    def measure(batch):  # gentle up to 200, then far over: interpolation alone would creep
        return Point(batch, peak_bytes=(400 * MIB + batch * MIB // 2) if batch <= 200 else 4096 * MIB)

    search = find_max_batch(measure, 512 * MIB, probes=(100, 400), tolerance=0.02)
    assert search.settled == (search.next_over - search.max_batch <= max(1, int(0.02 * search.max_batch)))
    assert search.max_batch >= 180, search.points  # each round moves at least the tolerance's step


def test_the_confirmation_never_measures_above_a_batch_known_over():
    calls = []
    search = find_max_batch(linear(0, 5 * MIB // 2, calls), 499 * MIB, probes=(100, 200), tolerance=0.02)
    assert calls == [100, 200, 199] and search.max_batch == 199 and search.confirmed  # 202 was not run


def test_illinois_interpolation_does_not_crawl_from_one_end():
    import numpy as np

    measured = [(13, 39.1), (26, 59.3), (208, 399.5), (212, 407.2), (236, 511.7), (237, 513.9), (240, 520.2),
                (246, 533.1), (268, 579.5)]  # offloaded recompute on the deep preset: steep near the budget
    calls = []

    def measure(batch):
        calls.append(batch)
        return Point(batch, peak_bytes=int(np.interp(batch, *zip(*measured)) * MIB))

    search = find_max_batch(measure, 512 * MIB, probes=(13, 26), tolerance=0.02)
    # 400 MiB at 208 is far below the budget: no confirmation at 212, the refitted line guesses 268
    assert calls == [13, 26, 208, 268, 245, 235, 239] and search.max_batch == 235 and search.settled
    # plain regula falsi crawled down from the upper end: 268, 246, 240, 237, 236


def test_a_refusal_whose_estimate_a_fitting_batch_disproved_is_bisected_not_crawled():
    """Seen on `capacity --preset deep --budget 512M`: adaptive at 255 refused, needing 1285.6 MiB, so
    the guess was 101; 101 fitted at 332 MiB, and the search then crept up 2 samples a round (103, 105,
    ... 113) until its rounds ran out, unconfirmed. Once a batch above the refusal's estimate fits,
    the estimate is wrong, and the bracket is bisected."""
    calls = []

    def measure(batch):
        calls.append(batch)
        if batch > 180:
            raise MeasureError("TbaConfigError: memory_budget=512.0 MiB cannot be met", needed_bytes=1285 * MIB)
        return Point(batch, peak_bytes=(480 if batch == 13 else 300) * MIB)

    search = find_max_batch(measure, 512 * MIB, probes=(13,), first_guess=255, tolerance=0.02)
    # 255 x 512 / 1285 = 101.6: 101 fits, so its neighbour; 103 fits too, so (103 + 255) // 2
    assert calls[:5] == [13, 255, 101, 103, 179], calls
    assert 176 <= search.max_batch <= 180 and search.next_over - search.max_batch <= 4, (calls, search)


def test_a_line_that_keeps_predicting_a_little_more_is_galloped_not_crept():
    """Seen on `capacity --preset deep --budget 512M`: offloaded recompute's peaks near the budget sat
    a few MiB under it, each refit predicted a few samples more, and the search crept 206, 210, 236,
    247, 253, 257, 262, 267 (about 18 s a run) before 272 was over (Note [Gallop while everything
    fits])."""
    import numpy as np

    measured = [(13, 38.0), (26, 69.9), (206, 448.0), (210, 456.8), (236, 453.1), (247, 473.9), (253, 485.1),
                (257, 508.3), (262, 501.8), (267, 511.1), (272, 537.4), (400, 800.0)]
    calls = []

    def measure(batch):
        calls.append(batch)
        return Point(batch, peak_bytes=int(np.interp(batch, *zip(*measured)) * MIB))

    search = find_max_batch(measure, 512 * MIB, probes=(13, 26), tolerance=0.02)
    assert search.settled and 262 <= search.max_batch <= 271 and search.next_over - search.max_batch <= 5
    assert len(calls) <= 8, calls  # crept: 11
