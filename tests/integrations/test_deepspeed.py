"""tba inside DeepSpeed training on CPU, one process: exact against DeepSpeed alone.

Each case trains the tiny GPT for a few steps with DeepSpeed, once without and once with a
``"tba"`` block, from the same weights, batches and dropout seeds, and compares every loss and
every parameter with ``torch.equal``. Writes are flushed before backward so that backward really
reads the activations back from the file.
"""

from __future__ import annotations

import os

import pytest
import torch

deepspeed = pytest.importorskip("deepspeed")

from python_runs import run_python  # noqa: E402

from tba.bench.models import PRESETS, make_batch, make_gpt  # noqa: E402
from tba.integrations.deepspeed import TbaDeepSpeed  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_process_group")

CONFIG = PRESETS["tiny"]
STEPS = 3
MIN_OFFLOAD_BYTES = 16 << 10
"""Offload every activation of the tiny model but its smallest (fewer, larger test writes)."""
TRAIN_SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "deepspeed", "train.py")


def ds_config(stage: int, accumulation: int, directory: str | None, backend: str) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": CONFIG.batch_size,
        "gradient_accumulation_steps": accumulation,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": stage, "offload_optimizer": {"device": "cpu"}},
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 1 << 30,
    }
    if directory is not None:
        config["tba"] = {"directory": directory, "backend": backend, "min_offload_bytes": MIN_OFFLOAD_BYTES}
    return config


def full_params(engine, stage: int) -> list[torch.Tensor]:
    if stage == 3:
        return [deepspeed.utils.safe_get_full_fp32_param(p).clone() for p in engine.module.parameters()]
    return [p.detach().clone() for p in engine.module.parameters()]


def train(stage: int = 2, accumulation: int = 1, directory: str | None = None, *, checkpoint: bool = False,
          backend: str = "threads"):
    """STEPS optimizer steps; returns (losses, parameters, layer_saved_bytes, bytes read back) of the run."""
    model = make_gpt(CONFIG, seed=0)
    if checkpoint:
        for block in model.blocks:
            block.forward = lambda x, _forward=block.forward: deepspeed.checkpointing.checkpoint(_forward, x)
    config = ds_config(stage, accumulation, directory, backend)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    offload = TbaDeepSpeed(engine, layers=[*model.blocks, model.norm])
    assert (offload.offloader is not None) == (directory is not None)
    losses = []
    for index in range(STEPS * accumulation):
        tokens, targets = make_batch(CONFIG, seed=index)
        torch.manual_seed(index)
        with offload:
            loss = engine(tokens, targets)
        if offload.offloader is not None:
            offload.offloader.flush()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    assert engine.global_steps == STEPS
    saved, bytes_read = None, 0
    if offload.offloader is not None:
        assert offload.stats.bytes_written > 0, offload.stats.as_dict()
        saved, bytes_read = dict(offload.offloader.layer_saved_bytes), offload.stats.bytes_read
    offload.close()
    return losses, full_params(engine, stage), saved, bytes_read


def assert_same(reference, result) -> None:
    assert reference[0] == result[0], (reference[0], result[0])
    assert len(reference[1]) == len(result[1])
    for index, (expected, actual) in enumerate(zip(reference[1], result[1])):
        assert torch.equal(expected, actual), f"parameter {index} differs"


@pytest.mark.parametrize("accumulation", [1, 2])
def test_zero2_cpu_optimizer_offload_is_exact(spill_dir, backend, accumulation):
    reference = train(2, accumulation)
    result = train(2, accumulation, spill_dir, backend=backend)
    assert_same(reference, result)
    assert result[3] > 0, "backward read nothing back from the file"
    initial = [p.detach() for p in make_gpt(CONFIG, seed=0).parameters()]
    assert not any(torch.equal(p, q) for p, q in zip(result[1], initial)), "training did not move the weights"


@pytest.mark.parametrize("stage", [1, 3])
def test_other_zero_stages_are_exact_and_write_no_parameters(spill_dir, stage):
    """Same storages per layer as ZeRO-2: ZeRO-3's gathered parameters are never written."""
    reference = train(stage)
    result = train(stage, directory=spill_dir)
    assert_same(reference, result)
    assert result[3] > 0, "backward read nothing back from the file"
    zero2 = train(2, directory=spill_dir)
    assert result[2] == zero2[2]


def test_deepspeed_checkpointed_blocks_save_nothing_into_tba(spill_dir):
    reference = train(checkpoint=True)
    result = train(directory=spill_dir, checkpoint=True)
    assert_same(reference, result)
    blocks = range(CONFIG.layers)
    assert all(result[2].get(index, 0) == 0 for index in blocks), result[2]
    assert result[2][CONFIG.layers] > 0, "the final norm, head and loss should still be offloaded"
    plain = train(directory=spill_dir)
    assert all(plain[2][index] > 0 for index in blocks), plain[2]


def run_script(*flags: str, env: dict[str, str]) -> list[str]:
    proc = run_python([TRAIN_SCRIPT, "--preset", "tiny", "--steps", "1", *flags], env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line.split() for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert [line[:2] for line in lines] == [["step", "1"]], proc.stdout
    return [line[3] for line in lines]


@pytest.mark.slow
def test_train_script_prints_identical_losses_with_and_without_tba(spill_dir):
    env = dict(os.environ, TBA_DIR=spill_dir)
    for key in ("MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR"):
        env.pop(key, None)
    assert run_script(env=env) == run_script("--tba", env=env)


def test_zero3_finds_the_blocks_of_the_engines_module(spill_dir):
    """ZeRO-3 leaves every parameter empty between gathers: TbaDeepSpeed(engine) took the model's first container of
    repeated modules, two embeddings, as its layers (Note [Parameters partitioned away] in tba/runtime/_layers.py)."""
    gpt = make_gpt(CONFIG, seed=0)
    model = torch.nn.ModuleDict({"embeddings": torch.nn.ModuleList([torch.nn.Embedding(8, 4) for _ in range(2)]),
                                 "gpt": gpt})  # met before the blocks
    config = {**ds_config(3, 1, spill_dir, "threads"), "zero_optimization": {"stage": 3}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    assert all(p.numel() == 0 for p in engine.module.parameters()), "ZeRO-3 did not partition: the test proves nothing"
    offload = TbaDeepSpeed(engine)
    assert offload.offloader.layers == list(gpt.blocks)
    offload.close()
