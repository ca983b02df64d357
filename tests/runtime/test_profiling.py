"""Samples.profile: compute times and the I/O overhead calibration (tba/runtime/_profiling.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import tba
from tba.defaults import PEAK_HEADROOM
from tba.policy._model import OFFLOAD, estimate
from tba.runtime._profiling import Samples

MIB = 1 << 20


def _sample(span_s: float | None, cpu_times: bool = True, period_s: float | None = None,
            period_cpu_s: float | None = None, span_cpu_s: float | None = None, first: bool = False) -> dict:
    return {
        "period_s": period_s, "period_cpu_s": period_cpu_s, "span_cpu_s": span_cpu_s, "first": first,
        "forward_s": [0.3, 0.3], "forward_cpu_s": [0.1, 0.1],
        "backward_s": [0.5, 0.5], "backward_cpu_s": [0.2, 0.2],
        "cpu_times": cpu_times, "span_s": span_s,
        "saved_bytes": [100 * MIB, 100 * MIB], "input_bytes": [MIB, MIB],
        "written": 200 * MIB, "write_s": 0.02, "read": 200 * MIB, "read_s": 0.02,
        "max_storage": 10 * MIB, "window_bytes": 512 * MIB,
    }


def _profile(*samples: dict):
    collected = Samples()
    collected.by_shape[None] = list(samples)
    return collected.profile(None, 2, 1, 512 * MIB)


def test_cpu_models_are_profiled_with_cpu_time_and_the_rest_of_the_fastest_step_is_io_overhead():
    profile = _profile(_sample(1.3), _sample(1.1))
    assert [layer.forward_s for layer in profile.layers] == [0.1, 0.1]
    assert [layer.backward_s for layer in profile.layers] == [0.2, 0.2]
    modelled = estimate(dataclasses.replace(profile, io_overhead_s_per_byte=0.0), (OFFLOAD, OFFLOAD)).step_s
    assert modelled == pytest.approx(0.6, abs=0.01)  # 10 GB/s disk: the I/O hides
    # the fastest step (1.1 s) took 0.5 s beyond the model, over 200 MiB spilled
    assert profile.io_overhead_s_per_byte == pytest.approx((1.1 - modelled) / (200 * MIB))
    assert estimate(profile, (OFFLOAD, OFFLOAD)).step_s == pytest.approx(1.1)


def test_wall_clock_on_cuda_and_no_overhead_when_the_model_was_not_beaten_or_not_timed():
    cuda = _profile(_sample(0.1, cpu_times=False))
    assert [layer.forward_s for layer in cuda.layers] == [0.3, 0.3]
    assert cuda.io_overhead_s_per_byte == 0.0  # faster than predicted: never negative
    assert _profile(_sample(None)).io_overhead_s_per_byte == 0.0


def test_the_rest_of_the_step_is_the_shortest_period_beyond_its_span_and_does_not_change_the_io_overhead():
    plain = _profile(_sample(1.3, cpu_times=False), _sample(1.1, cpu_times=False))
    profile = _profile(_sample(1.3, cpu_times=False, period_s=1.6), _sample(1.1, cpu_times=False, period_s=1.5))
    assert profile.outside_s == pytest.approx(0.3)  # min(1.6 - 1.3, 1.5 - 1.1)
    assert profile.io_overhead_s_per_byte == pytest.approx(plain.io_overhead_s_per_byte)
    assert estimate(profile, (OFFLOAD, OFFLOAD)).step_s == pytest.approx(estimate(plain, (OFFLOAD, OFFLOAD)).step_s + 0.3)
    assert _profile(_sample(1.1, cpu_times=False, period_s=1.0)).outside_s == 0.0  # never below zero
    assert plain.outside_s == 0.0  # no period measured


def test_on_the_cpu_the_rest_is_the_training_threads_cpu_time_and_the_first_step_is_left_out():
    # Wall-clock: 0.5 s beyond the span, of which the training thread computed 0.2 s (the rest it was
    # preempted by tba's threads, or waited).
    cpu = _profile(_sample(1.1, period_s=1.6, span_cpu_s=0.6, period_cpu_s=0.8))
    assert cpu.outside_s == pytest.approx(0.2)
    first = _sample(1.1, period_s=5.0, span_cpu_s=0.6, period_cpu_s=4.6, first=True)  # lazy optimiser state
    assert _profile(first).outside_s == 0.0
    assert _profile(first, _sample(1.1, period_s=1.6, span_cpu_s=0.6, period_cpu_s=0.9)).outside_s == pytest.approx(0.3)


def test_memory_slack_is_calibrated_against_the_backlog_measured_at_the_end_of_forward():
    # A slow disk (100 MiB/s) behind 0.1 s layers: the model puts about 180 of the 200 MiB offloaded in
    # the write backlog, where the step measured 20 MiB still unwritten when forward ended. Against the
    # model's own backlog the slack would come out 0, and a placement with no backlog (keep-all, 200 MiB
    # saved) would be predicted below the 300 MiB offload-all measured.
    sample = {**_sample(1.1), "write_s": 2.0, "peak_bytes": 300 * MIB, "backlog_bytes": 20 * MIB}
    profile = _profile(sample)
    bare = dataclasses.replace(profile, memory_slack_bytes=0, memory_headroom_per_io_byte=0.0)
    assert estimate(bare, (OFFLOAD, OFFLOAD)).backlog_bytes > 150 * MIB
    measured = int(300 * MIB * (1 + PEAK_HEADROOM))
    assert estimate(bare, (OFFLOAD, OFFLOAD)).memory_bytes > measured  # the old calibration: no slack
    calibrated = estimate(bare, (OFFLOAD, OFFLOAD), backlog_bytes=20 * MIB).memory_bytes
    assert calibrated == 220 * MIB  # 20 MiB backlog + the 200 MiB read window held idle
    assert profile.memory_slack_bytes == 300 * MIB - calibrated  # as measured; the headroom scales with I/O
    assert estimate(profile, (OFFLOAD, OFFLOAD), backlog_bytes=20 * MIB).memory_bytes == measured
    assert estimate(profile, ("keep", "keep")).memory_bytes == 280 * MIB  # 200 MiB saved + 80 MiB slack
    # Without a measured backlog (older samples, other callers) the model's own is used, as before.
    del sample["backlog_bytes"]
    assert _profile(sample).memory_slack_bytes == 0


def test_budgets_plan_with_a_write_queue_that_drains_no_faster_than_the_backlog_measured():
    # A 10 GB/s disk behind two 0.1 s layers: the model writes everything within forward, but the step
    # measured 50 MiB unwritten when forward ended. Budgets then plan with a queue that leaves as much;
    # other goals keep the measured bandwidth.
    fast = {**_sample(1.1), "peak_bytes": 300 * MIB}
    assert _profile(fast).drain_bytes_per_s is None
    assert estimate(_profile(fast), (OFFLOAD, OFFLOAD)).backlog_bytes == 0
    profile = _profile({**fast, "backlog_bytes": 50 * MIB})
    assert profile.write_bytes_per_s == pytest.approx(200 * MIB / 0.02)
    assert profile.drain_bytes_per_s < profile.write_bytes_per_s
    assert estimate(profile, (OFFLOAD, OFFLOAD)).backlog_bytes == 0
    backlog = estimate(profile.for_budget(), (OFFLOAD, OFFLOAD)).backlog_bytes
    assert 50 * MIB - 2 <= backlog <= 50.01 * MIB  # to a byte a layer
    # Everything unwritten (no byte written within forward): the model's backlog reaches it, to a byte a
    # layer, at a rate still above zero; more than the layers saved counts as everything.
    for measured in (200 * MIB, 500 * MIB):
        everything = _profile({**fast, "backlog_bytes": measured})
        assert estimate(everything.for_budget(), (OFFLOAD, OFFLOAD)).backlog_bytes >= 200 * MIB - 2
        assert everything.drain_bytes_per_s > 0


def test_no_write_finished_while_profiling_still_gives_budgets_a_finite_drain_and_caps():
    from tba.policy import plan

    stuck = _profile({**_sample(1.1), "written": 0, "write_s": 0.0, "peak_bytes": 300 * MIB, "backlog_bytes": 50 * MIB})
    assert stuck.write_bytes_per_s == float("inf")
    drained = stuck.for_budget()
    assert 0 < drained.write_bytes_per_s < float("inf")
    assert estimate(drained, (OFFLOAD, OFFLOAD)).backlog_bytes >= 50 * MIB - 2
    # A budget's plan carries write caps; at an infinite bandwidth these once made 0 x inf (int(nan)).
    without = dataclasses.replace(stuck, drain_bytes_per_s=None)
    budget = estimate(without, (OFFLOAD, OFFLOAD)).memory_bytes + MIB
    assert len(plan(without, memory_budget_bytes=budget).write_caps_bytes) == 2
    assert len(plan(stuck, memory_budget_bytes=budget + 50 * MIB).write_caps_bytes) == 2


def test_on_the_cpu_io_time_is_each_steps_wall_clock_beyond_its_own_compute():
    # Note [I/O time is measured within one step]: spans of 1.3 and 1.1 s whose training thread
    # computed 1.2 and 0.7 s; the per-layer minima add up to 0.6 s. The I/O time is the least of
    # 0.1 and 0.4 s, not the 0.5 s the fastest span takes beyond the minima.
    profile = _profile(_sample(1.3, span_cpu_s=1.2), _sample(1.1, span_cpu_s=0.7))
    assert profile.io_overhead_s_per_byte == pytest.approx(0.1 / (200 * MIB))
    assert profile.read_stall_credit_s_per_byte == 0.0
    assert estimate(profile, (OFFLOAD, OFFLOAD)).step_s == pytest.approx(0.7)
    assert _profile(_sample(1.1, span_cpu_s=1.2)).io_overhead_s_per_byte == 0.0  # never below zero


def test_a_read_stall_longer_than_the_measured_io_time_is_credited_back_but_a_smaller_window_still_costs():
    # A 40 MiB window on 100 MiB layers: the model's exposure is 2 x 60 MiB / (10 GB/s) / 2 = 6 ms of
    # read stall, where the steps measured 2 ms of I/O time in all.
    sample = {**_sample(0.602, span_cpu_s=0.6), "window_bytes": 40 * MIB}
    profile = _profile(sample)
    windowed = dataclasses.replace(profile, memory_slack_bytes=0)
    stall = estimate(dataclasses.replace(windowed, read_stall_credit_s_per_byte=0.0), (OFFLOAD, OFFLOAD),
                     40 * MIB).read_stall_s
    assert stall == pytest.approx(2 * 60 * MIB / (200 * MIB / 0.02) / 2)
    assert profile.io_overhead_s_per_byte == 0.0
    assert profile.read_stall_credit_s_per_byte == pytest.approx((stall - 0.002) / (200 * MIB))
    at_profiled = estimate(profile, (OFFLOAD, OFFLOAD), 40 * MIB)
    assert at_profiled.read_stall_s == pytest.approx(0.002)
    assert at_profiled.step_s == pytest.approx(0.602)
    # 20 MiB less window: the model's extra stall for it counts in full
    smaller = estimate(profile, (OFFLOAD, OFFLOAD), 20 * MIB)
    assert smaller.read_stall_s == pytest.approx(0.002 + 2 * 20 * MIB / (200 * MIB / 0.02) / 2)


def test_the_other_compute_threads_run_queue_waits_are_io_time_too():
    # Note [A preempted partner costs the training thread CPU time]: 0.1 s of the training thread's
    # own gap and 0.15 s its OpenMP partner waited for a core.
    profile = _profile({**_sample(1.3, span_cpu_s=1.2), "span_preempted_s": 0.15})
    assert profile.io_overhead_s_per_byte == pytest.approx(0.25 / (200 * MIB))
    assert _profile({**_sample(1.3, span_cpu_s=1.2), "span_preempted_s": None}).io_overhead_s_per_byte == \
        pytest.approx(0.1 / (200 * MIB))


def test_an_encoders_nested_fast_path_in_eval_runs_inside_the_bare_context(spill_dir):
    """nn.TransformerEncoder in eval under no_grad hands its layers a nested tensor, which has no shape:
    the first layer's shape hook raised 'NestedTensorImpl doesn't support sizes' (helper-55)."""
    torch.manual_seed(0)
    encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 64, batch_first=True), 2)
    x = torch.randn(3, 8, 32)
    padding = torch.zeros(3, 8, dtype=torch.bool)
    padding[:, -2:] = True
    for _ in range(4):  # profiled steps, then planned ones, each followed by an evaluation
        encoder.train()
        with tba.offload_activations(directory=spill_dir, min_offload_bytes=0):
            loss = encoder(x, src_key_padding_mask=padding).sum()
        loss.backward()
        encoder.eval()
        with torch.no_grad():
            expected = encoder(x, src_key_padding_mask=padding)
            with tba.offload_activations(directory=spill_dir):
                got = encoder(x, src_key_padding_mask=padding)
        assert torch.equal(expected, got)


def test_a_nested_input_shape_is_never_compared_with_a_plain_one():
    """A nested input of two pieces against a plain input of the same rank: ``covers`` compared their sizes
    element by element (a tag against a length), which raised TypeError."""
    from tba.runtime._input_shapes import covers, signature

    nested = torch.nested.nested_tensor([torch.zeros(6, 32), torch.zeros(5, 32)])
    plain = torch.zeros(2, 8, 32)
    assert signature((nested,), {}) == (((2, 6, 32), ("nested", torch.float32)),)
    assert not covers(signature((plain,), {}), signature((nested,), {}))
    assert not covers(signature((nested,), {}), signature((plain,), {}))
    assert covers(signature((nested,), {}), signature((torch.nested.nested_tensor([torch.zeros(4, 32)]),), {}))


# An uneven 6-block model whose layers run in a millisecond behind a slow disk: offload-all measured
# 40 of its 43 MiB still unwritten when forward ended, so offloading saves nothing, and its blocks are
# not recomputable (torch.compile wrappers). Keep-all holds the 43 MiB saved plus the 3 MiB of
# transient buffers the profiled step measured beyond the model: 46 MiB.
_UNEVEN_MIB = [2, 12, 1, 8, 4, 16]
_UNEVEN_KEEP_PEAK = (sum(_UNEVEN_MIB) + 3) * MIB


def _uneven(peak_bytes: int | None) -> dict:
    n = len(_UNEVEN_MIB)
    return {**_sample(0.05), "forward_s": [0.002] * n, "forward_cpu_s": [0.001] * n, "backward_s": [0.004] * n,
            "backward_cpu_s": [0.002] * n, "saved_bytes": [m * MIB for m in _UNEVEN_MIB], "input_bytes": [MIB // 2] * n,
            "written": 43 * MIB, "write_s": 0.5, "read": 43 * MIB, "read_s": 0.1, "max_storage": 4 * MIB,
            "window_bytes": 64 * MIB, "peak_bytes": peak_bytes, "backlog_bytes": 40 * MIB}


def _uneven_profile():
    collected = Samples()
    collected.by_shape[None] = [_uneven(None)]
    bare = collected.profile(None, 6, 1, 64 * MIB, wrappable=[False] * 6)
    modelled = estimate(bare, (OFFLOAD,) * 6, 64 * MIB, backlog_bytes=40 * MIB).memory_bytes
    collected.by_shape[None] = [_uneven(modelled + 3 * MIB)]
    return collected.profile(None, 6, 1, 64 * MIB, wrappable=[False] * 6), modelled + 3 * MIB


def test_the_peak_headroom_scales_with_what_a_placements_io_can_add():
    # Note [Headroom scales with a plan's I/O]: the slack is the profiled peak less the model's, as
    # measured; PEAK_HEADROOM of that peak is charged per byte of backlog and read buffers, so that
    # offload-all's prediction at the profiled window is the peak taken PEAK_HEADROOM higher, as before,
    # and a placement with no I/O gets none of it.
    from tba.policy import KEEP, io_bytes

    profile, peak = _uneven_profile()
    assert profile.memory_slack_bytes == 3 * MIB
    offload_all = (OFFLOAD,) * 6
    assert estimate(profile, offload_all, 64 * MIB, backlog_bytes=40 * MIB).memory_bytes == int(peak * (1 + PEAK_HEADROOM))
    assert estimate(profile.for_budget(), (KEEP,) * 6).memory_bytes == _UNEVEN_KEEP_PEAK
    one = (OFFLOAD,) + (KEEP,) * 5
    cost = estimate(profile.for_budget(), one)
    bare = dataclasses.replace(profile.for_budget(), memory_headroom_per_io_byte=0.0)
    io = io_bytes(profile, one, profile.max_window_bytes, cost.backlog_bytes)
    assert 0 < io < 40 * MIB
    assert cost.memory_bytes - estimate(bare, one).memory_bytes == pytest.approx(profile.memory_headroom_per_io_byte * io, abs=1)


def test_a_budget_above_keep_alls_peak_is_accepted_on_an_uneven_model_and_a_refusal_names_no_more_than_it():
    # Charged to keep-all too, the headroom (a quarter of offload-all's 60 MiB peak) refused 1.1x keep-all's
    # 46 MiB, claiming at least 61.2 MiB: more than keep-all holds (seen on a ROK run, 56.5 vs 46.2 MiB).
    from tba.errors import TbaConfigError
    from tba.policy import KEEP, plan

    profile, _ = _uneven_profile()
    for fraction in (1.1, 1.0):
        chosen = plan(profile, memory_budget_bytes=int(fraction * _UNEVEN_KEEP_PEAK))
        assert chosen.decisions == (KEEP,) * 6 and chosen.predicted_memory_bytes == _UNEVEN_KEEP_PEAK
    with pytest.raises(TbaConfigError, match="cannot be met") as refused:
        plan(profile, memory_budget_bytes=_UNEVEN_KEEP_PEAK // 2)
    least = float(str(refused.value).split("needs at least ")[1].split(" MiB")[0])
    assert least <= _UNEVEN_KEEP_PEAK / MIB


def test_no_placement_is_charged_more_than_the_whole_headroom_it_was_charged_before():
    # The headroom once folded into the slack (the profiled peak taken PEAK_HEADROOM higher, less the
    # model) is the most any placement that moves no more than offload-all's I/O is charged now.
    from tba.policy import io_bytes
    from tba.policy._plan import shapes

    profile, peak = _uneven_profile()
    before = dataclasses.replace(profile, memory_slack_bytes=int(peak * (1 + PEAK_HEADROOM)) - (peak - 3 * MIB),
                                 memory_headroom_per_io_byte=0.0)
    budget = profile.for_budget()
    most = io_bytes(profile, (OFFLOAD,) * 6, 64 * MIB, 40 * MIB)
    for decisions in shapes(len(profile.layers)):
        cost = estimate(budget, decisions)
        if io_bytes(budget, decisions, budget.max_window_bytes, cost.backlog_bytes) <= most:
            assert cost.memory_bytes <= estimate(before.for_budget(), decisions).memory_bytes, decisions


class _Passes(nn.Module):
    """Returns its input as it is (an adapter switched off, a dropout of p=0 folded away)."""

    def __init__(self) -> None:
        super().__init__()
        self.unused = nn.Linear(4, 4)

    def forward(self, x):
        return x


def test_a_layer_returning_its_input_profiles_a_backward_of_no_less_than_zero(spill_dir):
    # Its input's gradient hook runs before its output's (one tensor, hooks in the order they were put on): a
    # measured backward of about -0.2 ms, which Profile refuses (Note [A profile the model cannot price]).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), _Passes(), _Passes(), nn.Linear(4, 4))
    offloader = tba.Offloader(spill_dir, backend="threads", min_offload_bytes=0, layers=[model[1], model[2]],
                              overhead_bound=0.5)
    for step in range(4):
        with offloader:
            loss = model(torch.randn(8, 4, generator=torch.Generator().manual_seed(step))).square().mean()
        loss.backward()
    assert offloader.plan is not None
    assert all(layer.backward_s >= 0 for layer in offloader.policy_runner.profile.layers)
    offloader.close()
