"""What tba decided is visible: the engine and O_DIRECT in force, DEBUG lines for each decision,
bytes per discovered layer, per-step stats (``reset_stats``), and reprs."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import tba
from tba.io import ThreadEngine, resolve_backend


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(128, 128), nn.Linear(128, 128)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x).relu())


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(128, 128), *[Block() for _ in range(3)])


def step(offloader: tba.Offloader, model: nn.Module, *, flush: bool = False) -> None:
    """One step; with ``flush``, every write completes before backward, which then reads each storage back."""
    with offloader:
        loss = model(torch.randn(128, 128)).sum()
    if flush:
        offloader.flush()
    loss.backward()


@pytest.mark.parametrize("backend", ["auto", "threads"])
def test_resolved_backend_and_direct_io(backend, spill_dir):
    offloader = tba.Offloader(spill_dir, backend=backend, min_offload_bytes=0)
    assert offloader.backend == backend
    assert offloader.resolved_backend == resolve_backend(backend) != "auto"
    assert offloader.resolved_direct_io is None
    step(offloader, make_model())
    assert offloader.resolved_direct_io is offloader.spill.direct is True  # tmp_path is on a disk with O_DIRECT
    assert f"-> {offloader.resolved_backend}" in repr(offloader) and "direct_io=None -> True" in repr(offloader)
    offloader.close()


def test_an_engine_instance_is_its_own_backend(spill_dir):
    engine = ThreadEngine(workers=2)
    offloader = tba.Offloader(spill_dir, backend=engine)
    assert offloader.resolved_backend == "threads"
    assert repr(engine) == "ThreadEngine(name='threads', queue_depth=2)"
    offloader.close()
    engine.close()


def test_each_decision_is_logged_at_debug(spill_dir, caplog):
    offloader = tba.Offloader(spill_dir, backend="threads", min_offload_bytes=0)
    with caplog.at_level(logging.DEBUG, logger="tba"):
        step(offloader, make_model())
    offloader.close()
    text = caplog.text
    assert f"offloading to {spill_dir} with ThreadEngine" in text
    assert "O_DIRECT" in text and "prefetch window self-sized" in text and "found during the first forward" in text
    assert "found 3 repeated blocks (Block)" in text


def test_layer_saved_bytes_are_keyed_by_discovered_layer(spill_dir):
    offloader = tba.Offloader(spill_dir, backend="threads", min_offload_bytes=0)
    model = make_model()
    for _ in range(2):
        step(offloader, model)
        assert len(offloader.discovered_layers) == 3
        assert set(offloader.layer_saved_bytes) == {None, 0, 1, 2}
        assert offloader.layer_saved_bytes[0] == offloader.layer_saved_bytes[1] == offloader.layer_saved_bytes[2] > 0
    offloader.close()


@pytest.mark.usefixtures("read_back_always")
def test_reset_stats_gives_per_step_counters(spill_dir):
    # Every layer offloaded in every step: the adaptive default may keep some once it has a plan,
    # depending on the machine's load, and each step would write a different amount. Each step
    # flushes before backward, so that every step writes and reads back, whatever the timing.
    offloader = tba.Offloader(spill_dir, backend="threads", min_offload_bytes=0, policy="offload")
    model = make_model()
    step(offloader, model, flush=True)
    after_one = offloader.stats.tensors_offloaded
    step(offloader, model, flush=True)
    second = offloader.stats.tensors_offloaded - after_one
    so_far = offloader.reset_stats()
    assert so_far.tensors_offloaded == after_one + second and so_far.bytes_written > 0
    assert offloader.stats.bytes_written == 0 and offloader.stats.tensors_offloaded == 0
    assert offloader.stats.peak_resident_bytes == offloader.stats.resident_bytes
    step(offloader, model, flush=True)
    stats = offloader.stats
    assert stats.tensors_offloaded == second
    assert 0 < stats.bytes_written < so_far.bytes_written and 0 < stats.bytes_read < so_far.bytes_read
    assert 0 < stats.peak_resident_bytes and set(stats.kept_by_reason) == {"parameter"}
    assert 0 < stats.tensors_kept == stats.kept_by_reason["parameter"]
    assert "bytes_written=" in repr(stats)
    offloader.close()


def test_config_repr():
    assert "queue_depth=4" in repr(tba.OffloadConfig(queue_depth=4))


def test_the_repr_names_the_policy_and_the_plan_in_force(spill_dir):
    """docs/api.md lists repr(offloader) among the ways to see what tba decided: the plan too (helper-106)."""
    model = make_model()
    plan = tba.Plan(("offload", "keep", "recompute"), window_bytes=1 << 20)
    offloader = tba.Offloader(spill_dir, layers=list(model)[1:], policy=plan)
    step(offloader, model)
    assert "policy=Plan -> OKR, reusable" in repr(offloader), repr(offloader)
    offloader.close()
    default = tba.Offloader(spill_dir)
    assert "policy=adaptive, reusable" in repr(default), repr(default)  # no plan before its steps
    default.close()
