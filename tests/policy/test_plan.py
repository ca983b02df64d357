"""The planner and its cost model on synthetic profiles, with exact expected plans.

Units: sizes in MiB, bandwidths in MiB/s, so that every number below can be checked by hand
against the model in ``tba/policy/_model.py``. Four layers, f = 1 s, b = 2 s, s = 100 MiB, x = 10 MiB,
largest storage 10 MiB (so the smallest window is 20 MiB); keep-all takes 12 s and 400 MiB.
A plan that spills every layer also holds its read buffers (up to the window) through the next forward;
one that keeps or recomputes a layer frees them first (Note [Idle read buffers and kept layers]), and a
kept layer's backward reads the spilled layer below it (Note [Backward through kept layers]).
"""

from __future__ import annotations

import dataclasses

import pytest

import tba
from tba.errors import TbaConfigError
from tba.policy import Adaptive, KeepAll, OffloadAll, OffloadedRecomputeAll, Plan, RecomputeAll, min_window_bytes, plan, shapes
from tba.policy._model import estimate

MIB = 1 << 20


def profile(write_mib_s: float, read_mib_s: float, layers: int = 4) -> tba.Profile:
    layer = tba.LayerProfile(forward_s=1.0, saved_bytes=100 * MIB, input_bytes=10 * MIB, backward_s=2.0,
                             backward_measured=True)
    return tba.Profile((layer,) * layers, write_mib_s * MIB, read_mib_s * MIB, max_storage_bytes=10 * MIB)


FAST = profile(1000, 1000)  # a layer's 100 MiB write takes 0.1 s, far less than its 1 s forward
SLOW = profile(50, 100)  # writes take 2 s per layer: only the first two finish within forward


def test_cost_model_keep_offload_recompute():
    keep = estimate(FAST, ["keep"] * 4)
    assert (keep.step_s, keep.keep_step_s, keep.memory_bytes) == (12.0, 12.0, 400 * MIB)
    offload = estimate(FAST, ["offload"] * 4)
    assert (offload.step_s, offload.memory_bytes, offload.backlog_bytes) == (12.0, 200 * MIB, 0)
    assert offload.hidden_writes == (True,) * 4
    recompute = estimate(FAST, ["recompute"] * 4)
    assert recompute.step_s == 16.0
    assert recompute.memory_bytes == 3 * 10 * MIB + 110 * MIB  # inputs below + the rebuilt top layer


def test_cost_model_slow_disk_backlog_and_small_window():
    cost = estimate(SLOW, ["offload"] * 4)
    assert cost.hidden_writes == (True, True, False, False)
    assert cost.backlog_bytes == 200 * MIB
    assert cost.memory_bytes == 400 * MIB  # backlog + idle read buffers (two layers) at forward's end
    small = estimate(FAST, ["offload"] * 4, 50 * MIB)
    assert small.memory_bytes == 50 * MIB
    assert small.step_s == pytest.approx(12.1)  # 4 layers x (100 - 50) MiB / 1000 MiB/s / 2 exposed
    assert small.read_stall_s == pytest.approx(0.1)


@pytest.mark.parametrize("budget_mib, code, window_mib, step_s, memory_mib", [
    (500, "KKKK", 512, 12.0, 400),
    (250, "OOKK", 512, 12.0, 200),  # layer 1 is read while layer 2's backward runs; OOOK and OOOO move more bytes
    (150, "OOOO", 150, 12.0, 150),  # window shrunk to fit; reads still hide
    (50, "OOOO", 50, 12.1, 50),  # recompute cannot fit: its rebuilt layer alone is 110 MiB
])
def test_memory_budget_fast_disk(budget_mib, code, window_mib, step_s, memory_mib):
    result = plan(FAST, memory_budget_bytes=budget_mib * MIB)
    assert (result.code, result.window_bytes, result.fits) == (code, window_mib * MIB, True)
    assert result.predicted_step_s == pytest.approx(step_s)
    assert result.predicted_memory_bytes == memory_mib * MIB


@pytest.mark.parametrize("budget_mib, code, window_mib, step_s, memory_mib", [
    (250, "OOKK", 512, 12.0, 200),  # the TBA placement: layer 2's write would not finish in forward
    # layer 2 cannot hide its I/O and is over budget: recompute it, its 10 MiB input written (OORK: 13.6 s at 40 MiB)
    (150, "OOSK", 50, 13.5, 150),
])
def test_memory_budget_slow_disk(budget_mib, code, window_mib, step_s, memory_mib):
    result = plan(SLOW, memory_budget_bytes=budget_mib * MIB)
    assert (result.code, result.window_bytes, result.fits) == (code, window_mib * MIB, True)
    assert result.predicted_step_s == pytest.approx(step_s)
    assert result.predicted_memory_bytes == memory_mib * MIB


def test_unreachable_budget_raises_naming_the_least_memory():
    with pytest.raises(tba.TbaConfigError, match=r"memory_budget=60.0 MiB cannot be met: this model needs at "
                                                 r"least 120.0 MiB of activations \(plan O\w+\); raise memory_budget"):
        plan(SLOW, memory_budget_bytes=60 * MIB)  # OORR: layer 3 rebuilt on top of layer 2's input
    assert plan(SLOW, memory_budget_bytes=120 * MIB).predicted_memory_bytes <= 120 * MIB
    assert plan(FAST, memory_budget_bytes=20 * MIB).code == "OOOO"
    slack = dataclasses.replace(SLOW, memory_slack_bytes=30 * MIB)
    with pytest.raises(tba.TbaConfigError, match=r"at least 150.0 MiB .*30.0 MiB of it transient buffers"):
        plan(slack, memory_budget_bytes=120 * MIB)


def test_a_refusal_says_the_measured_buffers_are_the_process_peak():
    """The transient buffers are the process's peak over the profiled step: a thread allocating 256 MiB at a time
    beside a model that met 16 MiB alone had it refused as needing 50 MiB, told to lower its batch size (helper-138)."""
    slack = dataclasses.replace(SLOW, memory_slack_bytes=30 * MIB)
    with pytest.raises(tba.TbaConfigError, match=r"30.0 MiB of it transient buffers measured while profiling "
                                                 r"\(the process's peak: what other threads allocated meanwhile counts too\)"):
        plan(slack, memory_budget_bytes=120 * MIB)


def test_default_goal_is_least_memory_within_five_percent_of_the_fastest():
    assert plan(SLOW) == plan(SLOW, overhead_bound=0.05)
    assert plan(SLOW).goal == "overhead_bound=0.05"


@pytest.mark.parametrize("bound, code, window_mib, memory_mib", [
    (0.0, "OOKK", 100, 200),  # a window under 100 MiB would expose read time
    (0.101, "OOSK", 79, 179),  # 13 s + exposed reads <= 12 x 1.101 s; OORK holds its 10 MiB input too
])
def test_overhead_bound_slow_disk(bound, code, window_mib, memory_mib):
    result = plan(SLOW, overhead_bound=bound)
    assert (result.code, result.window_bytes, result.fits) == (code, window_mib * MIB, True)
    assert result.predicted_memory_bytes == memory_mib * MIB
    assert result.predicted_step_s <= 12.0 * (1 + bound) + 1e-9


def test_policy_classes():
    assert KeepAll().plan(FAST).code == "KKKK"
    assert OffloadAll().plan(FAST).code == "OOOO"
    assert RecomputeAll().plan(FAST).code == "RRRR"
    assert Adaptive(memory_budget_bytes=250 * MIB).plan(FAST) == plan(FAST, memory_budget_bytes=250 * MIB)
    assert min_window_bytes(FAST) == 20 * MIB
    assert OffloadedRecomputeAll().plan(FAST).code == "SSSS"
    assert len(shapes(4)) == 25 and shapes(4)[0] == ("keep",) * 4
    assert ("offload", "offloaded_recompute", "offloaded_recompute", "keep") in shapes(4)


def test_plan_json_round_trip_and_printing(tmp_path):
    result = plan(SLOW, memory_budget_bytes=150 * MIB)
    assert Plan.from_json(result.to_json()) == result
    path = tmp_path / "plan.json"
    result.save(str(path))
    assert Plan.load(str(path)) == result
    text = str(result)
    assert "plan OOSK" in text and "offload   layers 0-1" in text
    assert tba.Profile.from_json(SLOW.to_json()) == SLOW


def test_bad_goals_and_plans():
    with pytest.raises(ValueError, match="give one goal"):
        plan(FAST, memory_budget_bytes=1, overhead_bound=0.1)
    with pytest.raises(ValueError, match="memory_budget_bytes must be >= 0"):
        plan(FAST, memory_budget_bytes=-1)
    with pytest.raises(ValueError, match="unknown decision"):
        Plan(("keep", "swap"), 0)
    with pytest.raises(ValueError, match="cannot drive a model with 4 layers"):
        estimate(FAST, ["keep"] * 3)


def test_bad_placement_in_a_plan_is_a_config_error_with_the_closest():
    with pytest.raises(TbaConfigError, match=r"unknown decision 'kep' \(layer 0\); did you mean 'keep'\? "
                                             r"use one of keep, offload, recompute, offloaded_recompute"):
        Plan(("kep",), 0)
    with pytest.raises(TbaConfigError, match=r"'Offload' \(layer 1\); did you mean 'offload'\?"):
        Plan(("keep", "Offload"), 0)
    with pytest.raises(TbaConfigError, match="write_caps_bytes has 2 entries for 1 layers"):
        Plan(("keep",), 0, write_caps_bytes=(1, 2))


def test_plan_window_takes_sizes_and_names_itself_when_bad():
    assert Plan(("keep",), window_bytes="8M").window_bytes == 8 << 20
    assert Plan(("keep",), window_bytes=4096).window_bytes == 4096
    for bad, message in (("8 parsecs", "window_bytes: not a size"), (1.5, "whole number of bytes"),
                         (True, "whole number of bytes"), (-1, "must be >= 0")):
        with pytest.raises(tba.TbaConfigError, match=message):
            Plan(("keep",), window_bytes=bad)


def test_a_module_listed_twice_in_layers_is_a_config_error(tmp_path):
    from torch import nn

    block = nn.Linear(8, 8)
    with pytest.raises(tba.TbaConfigError, match=r"the same Linear twice \(at 0 and 2\)"):
        tba.Offloader(str(tmp_path), layers=[block, nn.Linear(8, 8), block], policy="offload")


@pytest.mark.parametrize("make", [lambda: tba.Profile((), MIB, MIB), lambda: tba.Profile(FAST.layers, 0, 0),
                                  lambda: tba.LayerProfile(-1.0, 5), lambda: tba.LayerProfile(0.1, -5),
                                  lambda: dataclasses.replace(FAST, outside_s=-0.1)],
                         ids=["no-layers", "no-bandwidth", "negative-time", "negative-bytes", "negative-outside"])
def test_a_bad_profile_is_a_config_error(make):
    """``tba.Profile`` and ``tba.LayerProfile`` are public (a user's ``tba.plan(profile)`` or policy builds them), and
    bad values raised bare ValueErrors that ``except tba.TbaError`` missed (helper-168)."""
    with pytest.raises(TbaConfigError):
        make()


def test_bad_profiles():
    with pytest.raises(ValueError, match="at least one layer"):
        tba.Profile((), MIB, MIB)
    with pytest.raises(ValueError, match="must be > 0"):
        dataclasses.replace(FAST, read_bytes_per_s=0)
    with pytest.raises(ValueError, match=r"io_overhead_s_per_byte must be >= 0 .*got 0 and -1e-09"):
        dataclasses.replace(FAST, io_overhead_s_per_byte=-1e-9)
    with pytest.raises(ValueError, match="memory_slack_bytes and io_overhead_s_per_byte must be >= 0"):
        dataclasses.replace(FAST, memory_slack_bytes=-1)
    with pytest.raises(ValueError, match="outside_s must be >= 0"):
        dataclasses.replace(FAST, outside_s=-0.1)
    with pytest.raises(ValueError, match="read_stall_credit_s_per_byte must be >= 0"):
        dataclasses.replace(FAST, read_stall_credit_s_per_byte=-1e-12)


def test_backward_estimated_when_not_measured():
    layer = tba.LayerProfile(forward_s=0.5, saved_bytes=1)
    assert (layer.backward_s, layer.backward_measured) == (1.0, False)


def test_cost_model_offloaded_recompute():
    """S holds nothing between forward and backward: only the window and the layer being rebuilt."""
    cost = estimate(FAST, ["offloaded_recompute"] * 4)
    assert cost.step_s == 16.0  # recompute's 4 s; reading 10 MiB inputs at 1000 MiB/s hides
    assert cost.memory_bytes == 100 * MIB + 20 * MIB  # rebuilt top layer + its input and the next in the window
    assert estimate(FAST, ["recompute"] * 4).memory_bytes == 140 * MIB  # R also holds 3 inputs below
    slow_read = tba.Profile(FAST.layers, 1000 * MIB, 1 * MIB, max_storage_bytes=10 * MIB)
    assert estimate(slow_read, ["offloaded_recompute"] * 4).read_stall_s > 0  # 10 s per input read shows
    cost = estimate(SLOW, ["offloaded_recompute"] * 4)
    assert cost.hidden_writes == (True,) * 4 and cost.backlog_bytes == 0  # 10 MiB in 1 s forward at 50 MiB/s


@pytest.mark.parametrize("goal, code, memory_mib", [
    # the top layer is kept, since rebuilding it would overlap the reads backward starts with (Note [A
    # recomputed top layer rebuilds on top of forward's leftovers]); OOOORRRK fits too, 0.2 s slower
    ({"memory_budget_bytes": 150 * MIB}, "OOOOSSSK", 150),
    ({"memory_budget_bytes": 125 * MIB}, "OOOSSSSK", 125),  # they do not: write them too
    ({"overhead_bound": 0.34}, "OOOSSSSK", 120),
])
def test_planner_chooses_offloaded_recompute_on_deep_slow_disk(goal, code, memory_mib):
    result = plan(profile(50, 100, layers=8), **goal)
    assert (result.code, result.fits, result.predicted_memory_bytes) == (code, True, memory_mib * MIB)


def test_plan_with_every_placement_round_trips():
    pinned = Plan(("offloaded_recompute", "keep", "offload", "recompute"), 4 * MIB)
    assert pinned.code == "SKOR" and pinned.decisions[0] is tba.Placement.OFFLOADED_RECOMPUTE
    assert Plan.from_json(pinned.to_json()) == pinned
    assert "offloaded_recompute layers 0" in str(pinned)


def test_io_overhead_per_spilled_byte_is_added_to_step_time_and_steers_the_default_goal():
    assert plan(FAST).code == "OOOO"  # every write and read hides: offloading looks free
    costly = dataclasses.replace(FAST, io_overhead_s_per_byte=0.25 / (100 * MIB))  # 0.25 s per offloaded layer
    assert estimate(costly, ["offload"] * 4).step_s == pytest.approx(13.0)
    assert estimate(costly, ["keep"] * 4).step_s == 12.0
    assert estimate(costly, ["offloaded_recompute"] * 4).step_s == pytest.approx(16.1)  # 10 MiB inputs spilled
    chosen = plan(costly)  # two offloaded layers cost +4.2%, three +6.3%
    assert (chosen.code, chosen.fits) == ("OOKK", True)
    assert chosen.predicted_step_s <= 12.0 * 1.05


def test_the_rest_of_the_step_counts_in_every_placement_and_in_the_overhead_ratio():
    costly = dataclasses.replace(FAST, io_overhead_s_per_byte=0.25 / (100 * MIB))
    whole = dataclasses.replace(costly, outside_s=4.0)  # head, loss and optimiser: 4 s of a 16 s step
    for decisions in (["keep"] * 4, ["offload"] * 4, ["recompute"] * 4):
        assert estimate(whole, decisions).step_s == pytest.approx(estimate(costly, decisions).step_s + 4.0)
        assert estimate(whole, decisions).memory_bytes == estimate(costly, decisions).memory_bytes
    assert estimate(whole, ["offload"] * 4).keep_step_s == 16.0
    assert estimate(whole, ["offload"] * 4).overhead == pytest.approx(1.0 / 16)  # not 1 / 12 of the layers alone
    chosen = plan(whole)  # three offloaded layers: +4.7% of the whole step (+6.3% of the layers' time)
    assert (chosen.code, chosen.fits) == ("OOOK", True)
    assert chosen.predicted_step_s <= 16.0 * 1.05
    assert tba.Profile.from_json(whole.to_json()) == whole


def test_a_recomputed_top_layer_rebuilds_on_top_of_the_write_backlog():
    """Note [A recomputed top layer rebuilds on top of forward's leftovers]: writes at 1 MiB/s leave
    almost all of both offloaded layers' 200 MiB unwritten when backward starts rebuilding the top layer,
    and backward's start has read a window of the topmost offloaded layer back already."""
    crawl = profile(1, 1000, layers=3)
    cost = estimate(crawl, ["offload", "offload", "recompute"], 10 * MIB)
    assert cost.backlog_bytes > 190 * MIB
    # backlog, its input, its rebuilt internals, the 10 MiB window read back at backward's start
    assert cost.memory_bytes == cost.backlog_bytes + 10 * MIB + 100 * MIB + 10 * MIB
    kept_top = estimate(crawl, ["offload", "offload", "keep"], 10 * MIB)
    assert kept_top.memory_bytes < cost.memory_bytes


def test_only_a_memory_budget_plans_with_the_drain_bandwidth():
    from tba.policy import LayerProfile, Profile

    # Writes hide at 6 GB/s; at the drain bandwidth (the backlog the profiled step measured) the
    # first layers' bytes are still in memory when backward starts, so offloading them saves less.
    layers = tuple(LayerProfile(forward_s=0.01, backward_s=0.02, saved_bytes=10 * MIB, input_bytes=2 * MIB)
                   for _ in range(4))
    profile = Profile(layers=layers, write_bytes_per_s=6000 * MIB, read_bytes_per_s=9000 * MIB,
                      max_storage_bytes=2 * MIB, drain_bytes_per_s=200 * MIB)
    budget = 32 * MIB
    optimistic = plan(dataclasses.replace(profile, drain_bytes_per_s=None), memory_budget_bytes=budget)
    careful = plan(profile, memory_budget_bytes=budget)
    assert careful.predicted_memory_bytes <= budget
    assert careful.decisions != optimistic.decisions or careful.predicted_memory_bytes > optimistic.predicted_memory_bytes
    assert plan(profile) == plan(dataclasses.replace(profile, drain_bytes_per_s=None))
    with pytest.raises(ValueError, match="drain_bytes_per_s must be > 0"):
        dataclasses.replace(profile, drain_bytes_per_s=0.0)


def test_a_layer_that_changes_its_input_is_never_recomputed():
    # Note [A recomputed layer must not change its input] in tba/runtime/_recompute_inputs.py.
    fixed = dataclasses.replace(SLOW, layers=tuple(dataclasses.replace(layer, recomputable=i != 2)
                                                   for i, layer in enumerate(SLOW.layers)))
    assert plan(SLOW, memory_budget_bytes=150 * MIB).code == "OOSK"
    with pytest.raises(tba.TbaConfigError, match="cannot be met"):
        plan(fixed, memory_budget_bytes=150 * MIB)
    assert plan(SLOW, overhead_bound=0.5).code == "OOSK"
    assert plan(fixed, overhead_bound=0.5).code[2] not in "RS"
    assert tba.Profile.from_dict(fixed.to_dict()) == fixed


@pytest.mark.parametrize("bound", [float("nan"), float("inf"), -float("inf")])
def test_an_overhead_bound_that_is_not_a_finite_number_is_refused(bound):
    # A NaN bound compared false with every step time: plan(FAST, overhead_bound=nan) returned the least-memory
    # placement as fitting, whatever it cost; the option (tba.OffloadConfig) already refuses both.
    with pytest.raises(tba.TbaConfigError, match="overhead_bound must be a finite number"):
        plan(FAST, overhead_bound=bound)
    with pytest.raises(tba.TbaConfigError, match="overhead_bound must be a finite number"):
        Adaptive(overhead_bound=bound)


@pytest.mark.parametrize("field, bad", [
    ("forward_s", float("nan")), ("forward_s", -1.0), ("forward_s", float("inf")), ("backward_s", -5.0),
    ("backward_s", float("nan")), ("saved_bytes", -100 * MIB), ("input_bytes", -1),
])
def test_a_layer_profile_no_plan_can_price_is_refused_naming_the_field(field, bad):
    # A negative forward made recompute look faster than keep-all (RRR, "fits"), NaN times planned RRK for the
    # default goal, negative bytes predicted an activation peak of 0: each a plan the model could not price.
    with pytest.raises(ValueError, match=rf"{field} must be"):
        dataclasses.replace(FAST.layers[0], **{field: bad})
    assert dataclasses.replace(FAST.layers[0], forward_s=0.0, backward_s=0.0, saved_bytes=0, input_bytes=0).forward_s == 0


@pytest.mark.parametrize("field, bad", [
    ("write_bytes_per_s", float("nan")), ("read_bytes_per_s", float("nan")), ("memory_slack_bytes", float("nan")),
    ("io_overhead_s_per_byte", float("nan")), ("outside_s", float("nan")), ("read_stall_credit_s_per_byte", float("nan")),
    ("drain_bytes_per_s", float("nan")), ("max_storage_bytes", -1), ("prefetch_depth_layers", -1),
    ("max_window_bytes", -1), ("io_overhead_s_per_byte", float("inf")), ("outside_s", float("inf")),
])
def test_a_profile_no_plan_can_price_is_refused_naming_the_field(field, bad):
    # NaN passed every "must be > 0" / ">= 0" check: a NaN slack made every prediction NaN and the budget's
    # plan "fit" at a predicted peak of nan bytes.
    with pytest.raises(ValueError, match=rf"{field}( and \w+)? must be"):
        dataclasses.replace(FAST, **{field: bad})
    assert dataclasses.replace(FAST, write_bytes_per_s=float("inf"), read_bytes_per_s=float("inf")).layers == FAST.layers



@pytest.mark.parametrize("fields, message", [
    ({"decisions": None}, r"Plan decisions must be a sequence of placements, one per layer, .* got NoneType None"),
    ({"write_caps_bytes": 5}, r"Plan write_caps_bytes must be a sequence of sizes, one per layer, .* got int 5"),
    ({"write_caps_bytes": ("x",)}, "Plan write_caps_bytes entry: not a size: 'x'"),
    ({"write_caps_bytes": (-1,)}, "Plan write_caps_bytes entry must be >= 0, got -1"),
    ({"write_caps_bytes": (1.5,)}, "Plan write_caps_bytes entry must be a whole number of bytes .* got float 1.5"),
])
def test_a_plan_with_a_bad_field_is_a_config_error_naming_it(fields, message):
    # A TypeError ('NoneType' object is not iterable), a ValueError (invalid literal for int()), or silently
    # taken (a negative cap, 1.5 truncated to 1): the caps hold forward back, so a pinned plan's must be sizes.
    with pytest.raises(TbaConfigError, match=message):
        Plan(**{"decisions": ("keep",), "window_bytes": 0, **fields})
    assert Plan(("keep", "offload"), 0, write_caps_bytes=("1M", 4096)).write_caps_bytes == (MIB, 4096)


def test_a_policy_object_shows_its_class_and_goal():
    class Mine(tba.Policy):
        def __init__(self) -> None:
            self.depth, self._cache = 3, {}

        def plan(self, profile):
            return tba.OffloadAll().plan(profile)

    assert repr(tba.Adaptive(memory_budget_bytes="2G")) == "Adaptive(memory_budget_bytes=2147483648, overhead_bound=None)"
    assert repr(tba.Adaptive()) == "Adaptive(memory_budget_bytes=None, overhead_bound=0.05)"
    assert repr(tba.OffloadAll()) == "OffloadAll()" and repr(tba.KeepAll()) == "KeepAll()"
    assert repr(Mine()) == "Mine(depth=3)"


@pytest.mark.parametrize("budget, shown", [(1, "1 byte"), (1024, "1024 bytes"), (100 << 10, "0.1 MiB"),
                                           (45 * MIB + MIB // 5, "45.2 MiB")])
def test_a_refused_budget_is_shown_as_given_not_as_0_0_mib(budget, shown):
    layer = tba.LayerProfile(forward_s=1.0, saved_bytes=100 * MIB, input_bytes=10 * MIB, backward_s=2.0)
    profile = tba.Profile(layers=(layer,) * 4, write_bytes_per_s=50 * MIB, read_bytes_per_s=100 * MIB,
                          max_storage_bytes=10 * MIB)
    with pytest.raises(tba.TbaConfigError, match=rf"^memory_budget={shown} cannot be met: this model needs at least"):
        tba.plan(profile, memory_budget_bytes=budget)


def test_a_plan_repr_names_its_placements_and_builds_the_plan_again():
    plan = tba.Plan(("keep", tba.Placement.OFFLOADED_RECOMPUTE), "8M", goal="overhead_bound=0.05", write_caps_bytes=(1, 2))
    text = repr(plan)
    assert text.startswith("Plan(decisions=('keep', 'offloaded_recompute'), window_bytes=8388608, goal='overhead_bound=0.05'")
    assert "<Placement" not in text and eval(text, {"Plan": tba.Plan}) == plan


def test_the_constructor_type_checkers_see_is_the_dataclass_one():
    # Note [A field that takes more than it holds] in tba/config.py: Plan's __init__ for type checkers (sizes as
    # strings, any sequence) is declared by hand under TYPE_CHECKING; it must name the fields, in order, with
    # their defaults.
    import ast
    import inspect

    from tba.policy import _plan

    tree = ast.parse(inspect.getsource(_plan))
    plan_class = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Plan")
    declared = next(node for block in plan_class.body if isinstance(block, ast.If)
                    for node in block.body if isinstance(node, ast.FunctionDef) and node.name == "__init__")
    names = [arg.arg for arg in declared.args.args[1:]]
    defaults = [ast.literal_eval(value) for value in declared.args.defaults]
    fields = dataclasses.fields(tba.Plan)
    assert names == [field.name for field in fields]
    assert defaults == [field.default for field in fields if field.default is not dataclasses.MISSING]
    assert len(defaults) == len(names) - 2  # decisions and window_bytes are required


def test_a_plan_that_cannot_be_saved_is_a_config_error_naming_the_path(tmp_path):
    """``plan.save("/missing/plan.json")`` raised a bare FileNotFoundError where ``Plan.load`` of the same path is a
    TbaConfigError naming it (helper-168)."""
    plan = Plan(("keep", "offload"), 0)
    target = tmp_path / "missing" / "plan.json"
    with pytest.raises(TbaConfigError, match=rf"cannot save the plan to {target}: FileNotFoundError: .*; pass a path "
                                             r"in an existing, writable directory"):
        plan.save(str(target))
    plan.save(str(tmp_path / "plan.json"))
    assert Plan.load(str(tmp_path / "plan.json")) == plan
