"""A placement runner told of layers that the forward never runs says so, once."""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch
from torch import nn

import tba
from tba import defaults


def make_model() -> nn.Sequential:
    return nn.Sequential(*(nn.Sequential(nn.Linear(256, 256), nn.GELU()) for _ in range(4)))


def not_run_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "tba" and r.levelno == logging.WARNING and "ran none of the" in r.getMessage()]


POLICIES = {
    "adaptive": {},
    "recompute-plan": {"policy": tba.Plan(("recompute",) * 4, "4M")},
    "offload": {"policy": "offload"},
}


@pytest.mark.parametrize("options", POLICIES.values(), ids=POLICIES.keys())
@pytest.mark.parametrize("reusable", [False, True], ids=["one-shot", "reusable"])
def test_layers_of_another_model_are_named_once(spill_dir, caplog, options, reusable):
    """``layers=`` naming another model's blocks (a copy, the model of an earlier trial) used to be silent:
    an adaptive context never profiled nor planned, a pinned plan recomputed nothing, every step offloaded
    everything untagged, and nothing said why."""
    torch.manual_seed(0)
    model, other = make_model(), make_model()
    x = torch.randn(512, 256)
    caplog.set_level(logging.WARNING, logger="tba")
    off = tba.Offloader(spill_dir, layers=list(other), **options) if reusable else None
    for _ in range(4):
        with off if reusable else tba.offload_activations(spill_dir, layers=list(other), **options):
            loss = model(x).logsumexp(-1).mean()
        loss.backward()
    if off is not None:
        off.close()
    said = not_run_warnings(caplog)
    assert len(said) == 1, said
    assert "layers=" in said[0] and "Sequential" in said[0], said[0]


@pytest.mark.parametrize("options", POLICIES.values(), ids=POLICIES.keys())
def test_layers_of_the_model_that_runs_say_nothing(spill_dir, caplog, options):
    torch.manual_seed(0)
    model = make_model()
    x = torch.randn(512, 256)
    caplog.set_level(logging.WARNING, logger="tba")
    for _ in range(4):
        with tba.offload_activations(spill_dir, layers=list(model), **options):
            loss = model(x).logsumexp(-1).mean()
        loss.backward()
    assert not not_run_warnings(caplog)


@pytest.mark.parametrize("options", POLICIES.values(), ids=POLICIES.keys())
def test_a_block_that_only_runs_an_earlier_blocks_backward_says_nothing(spill_dir, caplog, options):
    """Note [A block that saved nothing saved nothing] in tba/runtime/_step_cycle.py: 1F1B micro-batches run the
    backward of one inside a block of its own; a block doing only that was taken for a forward that ran none of the
    layers, because another micro-batch's storages were alive."""
    torch.manual_seed(0)
    model = make_model()
    caplog.set_level(logging.WARNING, logger="tba")
    off = tba.Offloader(spill_dir, layers=list(model), **options)
    for _ in range(3):
        with off:
            first = model(torch.randn(512, 256)).logsumexp(-1).mean()
        with off:
            second = model(torch.randn(512, 256)).logsumexp(-1).mean()
        with off:
            first.backward()  # the second micro-batch's storages are alive meanwhile
        second.backward()
    off.close()
    assert not not_run_warnings(caplog)


def test_what_is_kept_per_input_shape_stays_bounded_over_many_shapes(spill_dir, monkeypatch):
    """Each input shape's profiled samples, plan and successor were kept for good: a new sequence length
    every step (no buckets) grew the runner by about 7 KiB per step with 24 layers, without bound."""
    monkeypatch.setattr(defaults, "INPUT_SHAPES_KEPT", 8, raising=False)
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(3)))
    for rows in range(1, 41):
        with tba.offload_activations(spill_dir, layers=list(model), min_offload_bytes=0) as off:
            loss = model(torch.randn(rows % 20 + 1, 64)).sum()
        loss.backward()
    runner = off.policy_runner
    assert len(runner._samples.by_shape) <= 8, len(runner._samples.by_shape)
    assert len(runner._next_shape) <= 8 and len(runner._plans) <= 8, (len(runner._next_shape), len(runner._plans))



class _ChainedBlock(nn.Module):
    """A block that takes and returns its ``hidden`` and ``mask`` tensors in one container (a tuple, a list or
    a dict), as blocks chained by ``nn.Sequential`` do."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(64, 64)

    def forward(self, state):
        hidden, mask = (state["hidden"], state["mask"]) if isinstance(state, dict) else state
        hidden = torch.relu(self.linear(hidden)) * mask
        return {"hidden": hidden, "mask": mask} if isinstance(state, dict) else type(state)((hidden, mask))


class _KeepEveryLayer(tba.Policy):
    name = "keep-every-layer"

    def plan(self, profile):
        return tba.Plan(("keep",) * len(profile.layers), "1M")


@pytest.mark.parametrize("wrap", ["tuple", "list", "dict"])
def test_an_input_shape_given_in_a_container_is_told_from_another(spill_dir, wrap):
    """The input shape was read from the first layer's top-level tensor arguments only: blocks chained with
    ``(hidden, mask)`` tuples (or a list, or a dict of tensors) had the shape ``()`` at every batch size, so the
    plan made at 8 rows ran at 64 rows as its own, keeping all that a memory budget was planned for at 8 rows."""
    torch.manual_seed(0)
    model = nn.Sequential(*(_ChainedBlock() for _ in range(3)))
    pack = {"tuple": tuple, "list": list, "dict": lambda state: dict(zip(("hidden", "mask"), state))}[wrap]
    off = tba.Offloader(spill_dir, layers=list(model), policy=_KeepEveryLayer(), min_offload_bytes=0)
    kept = []
    for rows in [8] * 4 + [64]:
        before = off.stats.bytes_kept_by_reason.get("layer kept by policy", 0)
        with off:
            out = model(pack((torch.randn(rows, 64, requires_grad=True), torch.ones(rows, 64))))
            loss = (out["hidden"] if wrap == "dict" else out[0]).sum()
        loss.backward()
        kept.append(off.stats.bytes_kept_by_reason.get("layer kept by policy", 0) - before)
    off.close()
    assert kept[3] > 0, kept  # the plan for 8 rows keeps every layer
    assert kept[4] == 0, f"a step of 64 rows kept {kept[4]} bytes under the plan made for 8 rows"


class _EncoderDecoder(nn.Module):
    """Two blocks over a source of fixed length, then two over a target whose length varies: the first layer's
    input shape is the same at every step."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.ModuleList(nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(2))
        self.decoder = nn.ModuleList(nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(2))

    def forward(self, source: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        for block in self.encoder:
            source = block(source)
        target = target + source.mean(0)
        for block in self.decoder:
            target = block(target)
        return target


def test_a_layer_that_saves_more_than_its_shapes_plan_was_made_for_keeps_no_more(spill_dir):
    """The input shape is read at the first layer, so a later layer's inputs may grow under the same shape (a
    decoder's target length under a fixed source length) or vary with the data (tokens routed to an expert): a
    plan's kept layers then kept all they saved, 16 times what the plan (and a memory budget) was made for. They
    keep at most what they saved in the profiled step the plan was made from; the rest is offloaded, exactly
    (Note [A covered step keeps no more than the plan was made for] in tba/runtime/_input_shapes.py)."""
    torch.manual_seed(0)
    model = _EncoderDecoder()
    off = tba.Offloader(spill_dir, layers=[*model.encoder, *model.decoder], policy=_KeepEveryLayer(),
                        min_offload_bytes=0)
    kept, grads = [], []
    for rows in [16] * 4 + [256]:
        source, target = torch.randn(32, 64), torch.randn(rows, 64)
        before = off.stats.bytes_kept_by_reason.get("layer kept by policy", 0)
        for context in (off, None):
            model.zero_grad(set_to_none=True)
            with off if context else contextlib.nullcontext():
                loss = model(source, target).logsumexp(-1).mean()
            loss.backward()
            grads.append([p.grad for p in model.parameters()])
        kept.append(off.stats.bytes_kept_by_reason.get("layer kept by policy", 0) - before)
    off.close()
    assert all(torch.equal(a, b) for with_tba, without in zip(grads[::2], grads[1::2]) for a, b in zip(with_tba, without))
    assert kept[3] > 0, kept  # the plan keeps every layer
    assert kept[4] <= kept[3], f"a step of 256 target rows kept {kept[4]} bytes, its plan was made keeping {kept[3]}"


def _written_each_step(off: tba.Offloader, step_loss, steps: int) -> tuple[list[int], tba.Plan | None]:
    """The bytes ``off`` wrote in each of ``steps`` steps of ``step_loss(step)`` and backward, each step's writes
    flushed inside its ``with`` (counted in that step, not in a later one's when they end late); then its plan, closed."""
    written = []
    for step in range(steps):
        before = off.stats.bytes_written
        with off:
            loss = step_loss(step)
            off.flush()
        loss.backward()
        written.append(off.stats.bytes_written - before)
    plan = off.plan
    off.close()
    return written, plan


class _RecomputeThenKeep(tba.Policy):
    name = "recompute-then-keep"

    def plan(self, profile):
        half = len(profile.layers) // 2
        return tba.Plan(("recompute",) * half + ("keep",) * (len(profile.layers) - half), "1M")


def test_a_kept_layer_after_a_recomputed_one_keeps_its_input(spill_dir):
    """A block ending in tanh saves its output, which the next block's linear saves again: profiled (offloading
    every layer), that storage counted in the first block's bytes, but under ``RRKK`` the recomputed block's saves
    never reach tba, and the kept one saves it first. Held to what it saved when profiled, the kept layer wrote its
    input to disk at every step, which its plan keeps."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(128, 128), nn.Tanh()) for _ in range(4)))
    off = tba.Offloader(spill_dir, layers=list(model), policy=_RecomputeThenKeep(), min_offload_bytes=0)
    written, plan = _written_each_step(off, lambda step: model(torch.randn(64, 128)).sum(), 5)
    assert plan is not None and plan.code == "RRKK", plan
    assert written[3:] == [0, 0], written


def test_an_offloader_alternating_between_two_models_says_it_never_plans(spill_dir, caplog):
    """An adaptive Offloader that learned one model's layers forgets them at a step that runs none of them (a
    step of another model) and finds that model's layers instead: entered for a generator and a discriminator in
    turn, it never profiled nor planned, offloading every layer of both at every step, and only logged at INFO."""
    torch.manual_seed(0)
    first, second = make_model(), make_model()
    caplog.set_level(logging.WARNING, logger="tba")
    off = tba.Offloader(spill_dir, min_offload_bytes=0)
    for step in range(8):
        with off:
            loss = (first if step % 2 == 0 else second)(torch.randn(64, 256)).logsumexp(-1).mean()
        loss.backward()
    plan = off.plan
    off.close()
    said = [r.getMessage() for r in caplog.records if r.name == "tba" and "Offloader per model" in r.getMessage()]
    assert plan is None
    assert len(said) == 1, said


def test_an_offloader_alternating_between_two_models_says_its_budget_is_not_checked(spill_dir, caplog):
    """Note [A budget no plan is made for is said to be unchecked] in tba/runtime/_layer_notices.py: a budget no
    placement could meet trained on, never refused, and the warning did not name it."""
    torch.manual_seed(0)
    first, second = make_model(), make_model()
    caplog.set_level(logging.WARNING, logger="tba")
    off = tba.Offloader(spill_dir, min_offload_bytes=0, memory_budget="1K")
    for step in range(6):
        with off:
            loss = (first if step % 2 == 0 else second)(torch.randn(64, 256)).logsumexp(-1).mean()
        loss.backward()
    off.close()
    said = [r.getMessage() for r in caplog.records if r.name == "tba" and "Offloader per model" in r.getMessage()]
    assert len(said) == 1 and "memory_budget=1.0 KiB is not checked, since no plan is made" in said[0], said


def test_an_offloader_around_another_model_once_says_nothing(spill_dir, caplog):
    torch.manual_seed(0)
    model, other = make_model(), make_model()
    caplog.set_level(logging.WARNING, logger="tba")
    off = tba.Offloader(spill_dir, min_offload_bytes=0)
    for step in range(8):
        with off:
            loss = (other if step == 4 else model)(torch.randn(64, 256)).logsumexp(-1).mean()
        loss.backward()
    off.close()
    assert not [r.getMessage() for r in caplog.records if r.name == "tba" and "Offloader per model" in r.getMessage()]


class _SkipsALayer(nn.Module):
    """Four blocks, the third skipped at odd steps (LayerDrop)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(4))
        self.step = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for index, block in enumerate(self.blocks):
            if index != 2 or self.step % 2 == 0:
                x = block(x)
        return x


def test_a_kept_layer_that_did_not_run_in_the_profiled_step_is_not_capped(spill_dir):
    """A step under its shape's own plan keeps at most what each layer saved when profiled (Note [A covered step
    keeps no more than the plan was made for]); a layer that did not run in that step (LayerDrop) saved nothing
    there, and held to nothing, it wrote every tensor its plan keeps whenever it ran."""
    torch.manual_seed(0)
    model = _SkipsALayer()
    off = tba.Offloader(spill_dir, layers=list(model.blocks), policy=_KeepEveryLayer(), min_offload_bytes=0)

    def step_loss(step: int) -> torch.Tensor:
        model.step = step
        return model(torch.randn(64, 64)).sum()

    written, plan = _written_each_step(off, step_loss, 6)
    assert plan is not None and plan.code == "KKKK", plan
    assert written[2:] == [0] * 4, written
