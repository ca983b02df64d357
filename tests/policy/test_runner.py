"""Placement policies applied to a real model: exact gradients under every plan, and the runner."""

from __future__ import annotations

import dataclasses
import gc
import logging
import time
import weakref

import pytest
import torch
from utils import run_step

import tba
from tba import _control
from tba.bench.models import GPTConfig, make_batch, make_gpt

CONFIG = GPTConfig(vocab_size=64, seq_len=16, width=32, layers=4, heads=2, batch_size=2)
STEPS = 4


@pytest.fixture
def model():
    return make_gpt(CONFIG, seed=3)


def train(model, make_offloader=None, steps: int = STEPS):
    """Per step: loss and gradients. ``make_offloader()`` is called once per step (None: keep-all)."""
    tokens, targets = make_batch(CONFIG, seed=4)
    return [
        run_step(model, lambda m: m(tokens, targets), make_offloader() if make_offloader else None,
                 seed=step, flush=False)
        for step in range(steps)
    ]


def assert_same(reference, result):
    assert len(reference) == len(result)
    for (ref_loss, ref_grads), (loss, grads) in zip(reference, result):
        assert torch.equal(ref_loss, loss)
        assert ref_grads.keys() == grads.keys()
        for name in ref_grads:
            assert torch.equal(ref_grads[name], grads[name]), f"gradient of {name} differs"


PINNED = {
    "keep": ("keep",) * 4,
    "offload": ("offload",) * 4,
    "recompute": ("recompute",) * 4,
    "mixed": ("offload", "recompute", "keep", "offload"),
    "all-four": ("offload", "offloaded_recompute", "recompute", "keep"),
}


@pytest.mark.parametrize("name", sorted(PINNED))
def test_every_pinned_plan_is_exact(model, spill_dir, name):
    reference = train(model)
    pinned = tba.Plan(PINNED[name], window_bytes=1 << 20)
    offloader = tba.Offloader(spill_dir, backend="threads", layers=model, min_offload_bytes=0, policy=pinned)
    assert_same(reference, train(model, lambda: offloader))
    offloader.close()
    assert all("forward" not in vars(block) for block in model.blocks), "recompute wrapper left on a layer"
    saved = offloader.layer_saved_bytes
    input_bytes = CONFIG.batch_size * CONFIG.seq_len * CONFIG.width * 4
    for index, decision in enumerate(PINNED[name]):
        if decision == "keep" or (decision == "recompute" and index < 3):  # R: its input stays in memory
            assert saved.get(index, 0) == 0
        elif decision == "offloaded_recompute" and index < 3:  # only its input reaches tba, through checkpoint
            assert saved[index] == input_bytes * STEPS
        else:
            assert saved[index] > input_bytes * STEPS


@pytest.mark.parametrize("policy", ["offload", "keep"])
def test_offload_and_keep_policies_are_exact(model, spill_dir, policy):
    reference = train(model)
    offloaders = []

    def make():
        offloaders.append(tba.offload_activations(spill_dir, backend="threads", layers=model,
                                                  min_offload_bytes=0, policy=policy))
        return offloaders[-1]

    assert_same(reference, train(model, make))
    written = sum(o.stats.bytes_written for o in offloaders)
    assert (written == 0) == (policy == "keep")


@pytest.mark.parametrize("goal", [{"memory_budget_bytes": 1 << 40}, {"overhead_bound": 0.5}, {}])
def test_adaptive_profiles_then_plans_and_stays_exact(model, spill_dir, goal):
    reference = train(model, steps=STEPS + 1)
    offloader = tba.Offloader(spill_dir, backend="threads", layers=model, min_offload_bytes=0,
                              policy="adaptive", profile_steps=2, **goal)
    plans = []

    def make():
        plans.append(offloader.plan)
        return offloader

    assert_same(reference, train(model, make, steps=STEPS + 1))
    offloader.close()
    assert plans[:3] == [None, None, None]  # two profiled steps, planned when the third is entered
    assert plans[3] is not None and plans[3] == offloader.plan
    profile = offloader.policy_runner.profile
    assert len(profile.layers) == 4
    assert all(layer.saved_bytes > 0 and layer.forward_s > 0 and layer.backward_measured for layer in profile.layers)
    assert all(layer.input_bytes == 2 * 16 * 32 * 4 for layer in profile.layers)
    assert profile.max_storage_bytes > 0 and profile.write_bytes_per_s > 0
    if goal.get("memory_budget_bytes") == 1 << 40:
        assert offloader.plan.code == "KKKK"
    assert offloader.plan.goal == ("memory_budget_bytes=1099511627776" if goal.get("memory_budget_bytes") else
                                   f"overhead_bound={goal.get('overhead_bound', 0.05):g}")


def test_the_profile_measures_the_rest_of_the_step(model, spill_dir):
    offloader = tba.Offloader(spill_dir, backend="threads", layers=model, min_offload_bytes=0,
                              policy="adaptive", profile_steps=2)
    tokens, targets = make_batch(CONFIG, seed=4)
    for _ in range(3):
        with offloader:
            loss = model(tokens, targets)
        loss.backward()
        busy_until = time.thread_time() + 0.05  # an optimiser step: outside every layer
        while time.thread_time() < busy_until:
            pass
    offloader.close()
    profile = offloader.policy_runner.profile
    assert 0.05 <= profile.outside_s < 5.0  # the training thread's CPU seconds (a CPU model)
    assert offloader.plan.predicted_keep_step_s >= profile.outside_s



@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_forwards_without_grad_are_not_profiled_steps(model, spill_dir, mode):
    # Note [A forward without grad is no sample] in tba/runtime/_profiled_step.py: two validation passes
    # before training (a trainer's sanity check) were the profiled steps, and the plan kept every layer.
    offloader = tba.Offloader(spill_dir, backend="threads", layers=model, min_offload_bytes=0,
                              policy="adaptive", profile_steps=2, memory_budget_bytes=1 << 40)
    tokens, targets = make_batch(CONFIG, seed=4)
    for _ in range(2):
        with getattr(torch, mode)(), offloader:
            model(tokens, targets)
    plans = []
    for _ in range(3):
        with offloader:
            plans.append(offloader.plan)
            loss = model(tokens, targets)
        loss.backward()
    offloader.close()
    assert plans[:2] == [None, None] and plans[2] is not None  # the training steps were profiled
    assert all(layer.saved_bytes > 0 and layer.backward_measured for layer in offloader.policy_runner.profile.layers)


def _profiled_samples(offloader):
    return [sample for samples in offloader.policy_runner._samples.by_shape.values() for sample in samples]


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_forwards_whose_loss_is_dropped_are_not_profiled_steps(model, spill_dir, mode):
    # Note [A step whose loss was dropped is no sample] in tba/runtime/_profiled_step.py: an evaluation pass
    # with grad enabled after each training step, its loss dropped, was a profiled step (its saved bytes, no
    # backward), and a memory budget was planned from it (helper-124).
    offloader = tba.Offloader(spill_dir, backend="threads", layers=model, min_offload_bytes=0,
                              policy="adaptive", profile_steps=2, memory_budget_bytes=1 << 40)
    tokens, targets = make_batch(CONFIG, seed=4)
    for _ in range(3):
        with offloader:
            loss = model(tokens, targets)
        loss.backward()
        model.train(mode == "train")
        with offloader:
            dropped = model(tokens, targets)
        model.train()
        del dropped
    with offloader:
        pass
    offloader.close()
    samples = _profiled_samples(offloader)
    assert offloader.plan is not None and len(samples) == 2
    assert all(sample["backward_s"][-1] is not None for sample in samples)  # training steps only


def test_a_micro_batch_whose_backward_follows_the_next_entry_is_still_a_profiled_step(model, spill_dir):
    offloader = tba.Offloader(spill_dir, backend="threads", layers=model, min_offload_bytes=0,
                              policy="adaptive", profile_steps=2, memory_budget_bytes=1 << 40)
    tokens, targets = make_batch(CONFIG, seed=4)
    plans = []
    with offloader:
        previous = model(tokens, targets)
    for _ in range(3):
        with offloader:
            plans.append(offloader.plan)
            loss = model(tokens, targets)
        previous.backward()
        previous = loss
    previous.backward()
    offloader.close()
    assert plans[-1] is not None  # its samples were taken, though no backward had run at the next entry


def test_budget_below_the_least_the_model_needs_raises_when_planning(model, spill_dir):
    tokens, targets = make_batch(CONFIG, seed=4)
    offloader = tba.Offloader(spill_dir, backend="threads", layers=model, min_offload_bytes=0,
                              memory_budget=1000, profile_steps=1)
    for _ in range(1):  # the profiled step
        with offloader:
            loss = model(tokens, targets)
        loss.backward()
    with pytest.raises(tba.TbaConfigError, match=r"memory_budget=1000 bytes cannot be met: this model needs at least "
                                                 r"[0-9.]+ MiB of activations .*raise memory_budget"):
        with offloader:
            pass
    offloader.close()


def test_a_budget_refused_at_planning_keeps_nothing_of_the_step_once_handled(model, spill_dir):
    """Note [A raised error is no local of the frame it leaves] in tba/_control.py: the refusal, made on the control
    thread, kept the failed step's frames (the graph a training loop held there) until the cycle collector ran."""
    tokens, targets = make_batch(CONFIG, seed=4)
    offloader = tba.Offloader(spill_dir, backend="threads", layers=model, min_offload_bytes=0,
                              memory_budget=1000, profile_steps=1)
    with offloader:
        model(tokens, targets).backward()

    def step() -> tuple[weakref.ref, weakref.ref]:
        held = model(tokens, targets)  # a graph of the loop's, alive in this frame when the refusal is raised
        try:
            with offloader:
                pass
        except tba.TbaConfigError as err:
            return weakref.ref(err), weakref.ref(held)
        raise AssertionError("the budget was not refused")

    gc.disable()
    try:
        error, held = step()
        _control.call(len, ())  # the control thread is past the refused job
        assert error() is None and held() is None, "the refusal's error and its caller's graph are in a cycle"
    finally:
        gc.enable()
        offloader.close()


class _RefusesLargeShapes(tba.Policy):
    """Keeps everything, but refuses (as a budget would) a profile saving over twice the first one's bytes."""

    def __init__(self):
        self.first = None

    def plan(self, profile):
        saved = sum(layer.saved_bytes for layer in profile.layers)
        self.first = self.first or saved
        if saved > 2 * self.first:
            raise tba.TbaConfigError("this shape cannot be met; lower the batch size")
        return tba.KeepAll().plan(profile)


def test_a_refused_shape_does_not_refuse_the_steps_of_other_shapes(model, spill_dir):
    small, large = make_batch(CONFIG, seed=4), make_batch(dataclasses.replace(CONFIG, batch_size=8), seed=4)
    offloader = tba.Offloader(spill_dir, backend="threads", layers=model, min_offload_bytes=0,
                              policy=_RefusesLargeShapes(), profile_steps=1)
    refused = []
    for step, batch in enumerate([small] * 3 + [large] * 4 + [small] * 3):
        try:
            with offloader:
                loss = model(*batch)
        except tba.TbaConfigError:
            refused.append(step)  # at the entry after the large shape's profiled step (its shape is unknown there)
            continue
        loss.backward()
    offloader.close()
    assert refused and refused[-1] <= 7, f"steps {refused} refused: the small batch, whose plan fits, stayed refused"


def test_adaptive_one_shot_contexts_share_a_runner(model, spill_dir):
    reference = train(model)
    offloaders = []

    planned = []

    def make():
        offloaders.append(tba.offload_activations(spill_dir, backend="threads", layers=model, min_offload_bytes=0,
                                                  policy="adaptive", memory_budget_bytes=1 << 40, profile_steps=1))
        planned.append(offloaders[-1].plan is not None)
        return offloaders[-1]

    assert_same(reference, train(model, make))
    runners = {id(o.policy_runner) for o in offloaders}
    assert len(runners) == 1
    assert planned == [False, False, True, True]  # the second context plans when it is entered
    # The first step is profiled offloading everything; then keep-all fits a 1 TiB budget (storages
    # saved before the first layer, here the embedding's output, follow the offloader as always).
    assert [sorted(o.layer_saved_bytes, key=str) for o in offloaders] == [[0, 1, 2, 3, None]] + [[None]] * 3
    assert len({id(o.policy_runner) for o in offloaders}) == 1
    assert not [name for name in vars(model.blocks[0]) if name.startswith("_tba")], "the model was modified"


class KeepFirstOffloadRest(tba.Policy):
    def __init__(self):
        self.profiles = []

    def plan(self, profile):
        self.profiles.append(profile)
        return tba.Plan(("keep",) + ("offload",) * (len(profile.layers) - 1), window_bytes=profile.max_window_bytes)


@dataclasses.dataclass(frozen=True)
class KeepAllFrozen(tba.Policy):
    window_bytes: int = 1 << 20

    def plan(self, profile):
        return tba.Plan(("keep",) * len(profile.layers), window_bytes=self.window_bytes)


@pytest.mark.parametrize("with_layers", [True, False], ids=["layers", "bare"])
@pytest.mark.parametrize("same_object", [True, False], ids=["one-object", "object-per-step"])
def test_a_policy_object_given_to_one_shot_contexts_profiles_once_then_plans(model, spill_dir, with_layers,
                                                                             same_object):
    # A runner per one-shot context never got past profiling: a custom policy silently offloaded all.
    reference = train(model, steps=5)
    policy, offloaders = KeepFirstOffloadRest(), []

    def make():
        layers = {"layers": model} if with_layers else {}
        offloaders.append(tba.offload_activations(spill_dir, backend="threads", min_offload_bytes=0, profile_steps=1,
                                                  policy=policy if same_object else KeepFirstOffloadRest(), **layers))
        return offloaders[-1]

    assert_same(reference, train(model, make, steps=5))
    assert len({id(o.policy_runner) for o in offloaders}) == 1
    assert len(offloaders[-1].policy_runner.policy.profiles) == 1
    assert offloaders[-1].plan.code == "KOOO"
    assert offloaders[-1].stats.bytes_kept_by_reason.get(tba.KeepReason.LAYER_KEPT.value, 0) > 0


def test_a_policy_object_built_every_step_shares_the_runner_another_one_replaces_it(model, spill_dir):
    # Note [A policy object in one-shot contexts]: policy=MyPolicy() in the with line builds one per step.
    def runner(policy):
        return tba.offload_activations(spill_dir, layers=model, policy=policy).policy_runner

    first = runner(KeepAllFrozen())
    assert runner(KeepAllFrozen()) is first and runner(KeepFirstOffloadRest()) is runner(KeepFirstOffloadRest())
    other = runner(KeepAllFrozen(window_bytes=2 << 20))
    assert other is not first and runner(KeepAllFrozen(window_bytes=2 << 20)) is other
    assert runner(KeepAllFrozen()) is not first, "the slot holds the last policy only: nothing accumulates"


class HoldsTheModel(tba.Policy):
    def __init__(self, model):
        self.model, self.blocks = model, list(model.blocks)

    def plan(self, profile):
        return tba.Plan(("keep",) * len(profile.layers), window_bytes=profile.max_window_bytes)


def test_a_policy_object_holding_the_model_built_every_step_shares_the_runner_without_copying_the_model(model,
                                                                                                      spill_dir):
    # Its attributes were deep-copied: the model's weights copied at every step, and the copy never equal to
    # the model, so every step built a new runner and profiled, silently offloading everything.
    def runner():
        return tba.offload_activations(spill_dir, layers=model, policy=HoldsTheModel(model)).policy_runner

    first = runner()
    assert runner() is first
    assert not any(isinstance(value, torch.nn.Module) for value in [*first.policy_attributes.values(),
                                                                     *first.policy_attributes["blocks"]])
    other = make_gpt(CONFIG)
    assert tba.offload_activations(spill_dir, layers=model, policy=HoldsTheModel(other)).policy_runner is not first


@pytest.mark.parametrize("with_layers", [True, False], ids=["layers", "bare"])
@pytest.mark.parametrize("same_object", [True, False], ids=["one-object", "object-per-step"])
def test_a_policy_object_holding_the_model_does_not_keep_it_alive_through_the_shared_runner(spill_dir, with_layers,
                                                                                          same_object):
    # The registries held the runner, the runner the policy, the policy the model: the weak-keyed entry
    # never died and the model (its weights) lived for good.
    held = {"model": make_gpt(CONFIG, seed=1)}
    held["policy"] = HoldsTheModel(held["model"])
    offloaders = []

    def make():
        model = held["model"]
        offloaders[:] = [tba.offload_activations(spill_dir, profile_steps=1, min_offload_bytes=0,
                                                 policy=held["policy"] if same_object else HoldsTheModel(model),
                                                 **({"layers": model} if with_layers else {}))]
        return offloaders[0]

    train(held["model"], make, steps=3)
    assert offloaders[0].plan is not None and offloaders[0].plan.code == "KKKK"
    freed = weakref.ref(held["model"])
    held.clear()
    offloaders.clear()
    gc.collect()
    _control.settle()  # the last one-shot offloader closes on the control thread
    gc.collect()
    assert freed() is None, "the model was kept alive"


class WrapsAdaptive(tba.Policy):
    def __init__(self):
        self.inner = tba.Adaptive(overhead_bound=10.0)  # no __eq__: a new one never equals the last

    def plan(self, profile):
        return self.inner.plan(profile)


def test_a_policy_object_per_step_that_never_matches_the_last_one_is_warned_about(model, spill_dir, caplog):
    # A runner per step never plans: every step profiled and offloaded everything, without a word.
    with caplog.at_level(logging.WARNING, logger="tba"):
        train(model, lambda: tba.offload_activations(spill_dir, layers=model, policy=WrapsAdaptive(), profile_steps=1,
                                                     min_offload_bytes=0), steps=3)
    assert caplog.text.count("build the policy once, outside the training loop") == 1
    assert "WrapsAdaptive" in caplog.text


@pytest.mark.parametrize("returned", ["short", "not a plan"])
def test_a_policy_returning_a_plan_that_does_not_fit_the_layers_is_a_clear_error(model, spill_dir, returned):
    class Wrong(tba.Policy):
        def plan(self, profile):
            return tba.Plan(("keep",), window_bytes=1 << 20) if returned == "short" else "keep"

    policy = Wrong()
    tokens, targets = make_batch(CONFIG, seed=4)
    with tba.offload_activations(spill_dir, layers=model, policy=policy, profile_steps=1):
        loss = model(tokens, targets)
    loss.backward()
    with pytest.raises(tba.TbaConfigError, match=r"policy Wrong.plan\(profile\) returned .* for a profile of 4 "
                                                 r"layers; return a tba.Plan with one decision per profile.layers"):
        with tba.offload_activations(spill_dir, layers=model, policy=policy, profile_steps=1):
            pass


def test_recompute_wrapper_removed_at_exit_backward_still_recomputes(model, spill_dir):
    tokens, targets = make_batch(CONFIG, seed=4)
    torch.manual_seed(0)
    expected = torch.autograd.grad(model(tokens, targets), list(model.parameters()))
    pinned = tba.Plan(("recompute",) * 4, window_bytes=1 << 20)
    calls = []
    model.blocks[1].attn.register_forward_hook(lambda *args: calls.append(1))
    with tba.offload_activations(spill_dir, backend="threads", layers=model, policy=pinned):
        torch.manual_seed(0)
        loss = model(tokens, targets)
    assert all("forward" not in vars(block) for block in model.blocks)
    assert len(calls) == 1
    grads = torch.autograd.grad(loss, list(model.parameters()))
    assert len(calls) == 2, "backward did not recompute layer 1"
    assert all(torch.equal(a, b) for a, b in zip(expected, grads))


def test_policy_config_errors(model, spill_dir):
    with pytest.raises(tba.TbaConfigError, match="one adaptive goal"):
        tba.Offloader(spill_dir, layers=model, memory_budget="1M", overhead_bound=0.1)
    with pytest.raises(tba.TbaConfigError, match="needs the model's layers"):
        tba.Offloader(spill_dir, policy="keep")
    with pytest.raises(tba.TbaConfigError, match=r"memory_budget \(1048576\) and memory_budget_bytes \(5\) differ"):
        tba.Offloader(spill_dir, memory_budget="1M", memory_budget_bytes=5)
    with pytest.raises(tba.TbaConfigError, match="unknown policy"):
        tba.Offloader(spill_dir, layers=model, policy="swap")
    with pytest.raises(tba.TbaConfigError, match="need policy='adaptive'"):
        tba.Offloader(spill_dir, layers=model, policy="offload", memory_budget_bytes=1)
    with pytest.raises(tba.TbaConfigError, match="need policy='adaptive', not a Plan"):
        tba.Offloader(spill_dir, layers=model, policy=tba.Plan(("keep",) * 4, 0), memory_budget="1K")
    with pytest.raises(tba.TbaConfigError, match="need policy='adaptive', not a KeepAll"):
        tba.offload_activations(spill_dir, layers=model, policy=tba.KeepAll(), memory_budget="1K")
    with pytest.raises(tba.TbaConfigError, match="need policy='adaptive', not a OffloadAll"):
        tba.Offloader(spill_dir, layers=model, policy=tba.OffloadAll(), overhead_bound=0.2)
    with pytest.raises(tba.TbaConfigError, match=r"the plan has 2 decisions but layers= has 4 layers; give the plan one "
                                                 r"decision per layer \(4\), or pass the layers it was made for"):
        tba.Offloader(spill_dir, layers=model, policy=tba.Plan(("keep", "keep"), 0))
    with pytest.raises(tba.TbaConfigError, match="memory_budget_bytes must be > 0"):
        tba.Offloader(spill_dir, layers=model, policy="adaptive", memory_budget_bytes=-5)


def test_a_shape_hook_left_by_an_interrupted_step_is_replaced_not_doubled(model, spill_dir):
    # A signal handler's exception can end a step before exit removes the first layer's shape hook;
    # the next attach must replace it: two would remove each other's handle mid-forward and torch
    # would call one without its kwargs (TypeError: _check_shape() missing ... 'kwargs').
    tokens, targets = make_batch(CONFIG, seed=4)
    offloader = tba.Offloader(spill_dir, layers=model, backend="threads")
    try:
        with offloader:
            offloader.policy_runner._attach_shape_hook()
            loss = model(tokens, targets)
        loss.backward()
        assert len(model.blocks[0]._forward_pre_hooks) == 0
    finally:
        offloader.close()


def test_profiled_steps_on_a_gpu_synchronise_the_stream_except_while_a_graph_is_captured(monkeypatch):
    """Note [Layer time on a GPU]: the timer's stamps wait for the current stream, never during capture."""
    from types import SimpleNamespace

    from torch import nn

    from tba.runtime._runner import PolicyRunner

    class OnCuda(nn.Linear):
        def parameters(self, recurse: bool = True):
            yield SimpleNamespace(is_cuda=True, device="cuda:0")

    synced, capturing = [], [False]
    stream = SimpleNamespace(synchronize=lambda: synced.append(1))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    on_cpu, on_cuda = nn.Linear(2, 2), OnCuda(2, 2)  # the runner holds its layers weakly
    assert PolicyRunner([on_cpu])._stream_sync() is None  # the CPU needs none
    synchronize = PolicyRunner([on_cuda])._stream_sync()
    synchronize()
    capturing[0] = True
    synchronize()
    assert synced == [1]


def test_an_entry_that_fails_after_its_profiled_step_started_leaves_no_hook(model, spill_dir, monkeypatch):
    """A profiled step's entry that raises after its timer went on (``torch.cuda.synchronize()`` at the peak's start
    raising an earlier kernel's error) is undone as a failed step is: its timer's hooks on the layers and its global
    module pre-hook (tba/runtime/_outside.py) stayed registered, running at every module call of the program, until
    another step ended (helper-111)."""
    from torch.nn.modules import module as module_hooks

    from tba.runtime._peak import StepPeak

    def failing_start(self, held_bytes, cuda, release=False):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    tokens, targets = make_batch(CONFIG, seed=4)
    offloader = tba.Offloader(spill_dir, layers=model, backend="threads", policy="adaptive")
    try:
        with monkeypatch.context() as patch:
            patch.setattr(StepPeak, "start", failing_start)
            with pytest.raises(RuntimeError, match="illegal memory access"), offloader:
                pass
        assert not module_hooks._global_forward_pre_hooks
        assert all(not block._forward_pre_hooks and not block._forward_hooks for block in model.blocks)
        for _ in range(3):  # the profiled steps, then a planned one
            with offloader:
                loss = model(tokens, targets)
            loss.backward()
        assert offloader.policy_runner.plan is not None
    finally:
        offloader.close()


class RecomputeWhatMayBe(tba.Policy):
    """Recomputes every layer the profile marks recomputable, as the adaptive search may (its shapes recompute
    a run of neighbouring layers)."""

    def plan(self, profile):
        return tba.Plan(tuple("recompute" if layer.recomputable else "offload" for layer in profile.layers), "1M")


def test_a_layer_inside_another_given_layer_is_never_planned_for_recomputation(model, spill_dir):
    """``layers=`` whose blocks nest (a block and one of its submodules, or ``list(model.modules())``) were each
    profiled as recomputable, so the adaptive search could plan both recomputed (``RRRK`` over a block and its
    first submodule), which the step it planned for refused: 'layers 0 (Block) and 1 (Linear) are both
    recomputed, and layer 1 is inside layer 0', at every entry from then on. A layer inside another of the layers
    is profiled as not recomputable; the outer one's recomputation covers it."""
    reference = train(model, steps=5)
    inner = next(module for module in model.blocks[0].modules() if isinstance(module, torch.nn.Linear))
    layers = [model.blocks[0], inner, *model.blocks[1:]]
    offloader = tba.Offloader(spill_dir, backend="threads", min_offload_bytes=0, layers=layers,
                              policy=RecomputeWhatMayBe())
    result = train(model, lambda: offloader, steps=5)
    plan = offloader.plan
    offloader.close()
    assert_same(reference, result)
    assert plan is not None and plan.code == "RORRR", plan


@pytest.mark.parametrize("policy", [tba.KeepAll, tba.policy.Adaptive, KeepAllFrozen], ids=lambda p: p.__name__)
def test_a_policy_class_given_for_its_object_names_the_fix(model, spill_dir, policy):
    """``policy=tba.KeepAll`` (the class, not an object of it) was 'unknown policy <class ...>; use one of adaptive,
    offload, keep or a tba.Plan', naming neither a tba.Policy object nor the parentheses left out."""
    with pytest.raises(tba.TbaConfigError, match=rf"policy is the class {policy.__name__}, not an object of it: pass "
                                                 rf"policy={policy.__name__}\(\)"):
        tba.Offloader(spill_dir, layers=model, policy=policy)


def test_an_unknown_policy_object_names_every_kind_of_policy(model, spill_dir):
    with pytest.raises(tba.TbaConfigError, match="unknown policy None; use one of adaptive, offload, keep, a tba.Plan "
                                                 "or a tba.Policy"):
        tba.Offloader(spill_dir, layers=model, policy=None)
