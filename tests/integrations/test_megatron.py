"""tba on megatron-core: the --tba-* flags, exact training with and without Megatron recompute, the script."""

from __future__ import annotations

import argparse
import logging
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install 'tba-offload[megatron]')")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning:megatron", "ignore::DeprecationWarning:megatron")

from python_runs import run_python  # noqa: E402
from utils import load_script  # noqa: E402

import tba  # noqa: E402
from tba.errors import TbaConfigError  # noqa: E402
from tba.integrations.megatron import (  # noqa: E402
    MegatronOffloader,
    add_tba_arguments,
    check_recompute_config,
    offloader_from_args,
    recompute_prefetch_depth,
    wrap_forward_step,
)

SCRIPT_DIR = Path(__file__).resolve().parents[2] / "examples" / "megatron"
cpu_shims = load_script(SCRIPT_DIR / "cpu_shims.py")
pretrain_gpt = load_script(SCRIPT_DIR / "pretrain_gpt.py")

STEPS = 3
TINY = ["--cpu", "--layers", "2", "--hidden", "64", "--heads", "4", "--seq", "128", "--batch", "2", "--vocab", "256"]
HIDDEN_STATE_BYTES = 128 * 2 * 64 * 4
"""One [seq, batch, hidden] fp32 tensor of the TINY model: 64 KiB, the default min_offload_bytes."""
RECOMPUTE_FLAGS = {None: [], "full": ["--recompute-granularity", "full"],
                   "selective": ["--recompute-granularity", "selective"]}


@pytest.fixture(scope="module")
def world():
    with cpu_shims.cpu_megatron():
        yield


def parse(*flags: str) -> argparse.Namespace:
    return pretrain_gpt.build_parser().parse_args([*TINY, *flags])


def train_step(model, optimizer, batch, offloader=None) -> torch.Tensor:
    """The script's step, but every write completes before backward, so backward reads from the file
    whatever the disk's speed (a slow shared disk otherwise serves everything from memory)."""
    optimizer.zero_grad(set_to_none=False)
    if offloader is None:
        loss = pretrain_gpt.forward_loss(model, batch)
    else:
        with offloader:
            loss = pretrain_gpt.forward_loss(model, batch)
        offloader.flush()
    loss.backward()
    optimizer.step()
    return loss.detach()


def train(args: argparse.Namespace, offloader_factory=None):
    """STEPS steps of the script's training; returns the model, the offloader and (loss, grads) per step."""
    model = pretrain_gpt.build_gpt(args, torch.device("cpu"))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    offloader = offloader_factory(args, model) if offloader_factory else None
    batches = pretrain_gpt.synthetic_batches(args, torch.device("cpu"))
    steps = []
    for step in range(1, STEPS + 1):
        torch.manual_seed(args.seed + step)
        loss = train_step(model, optimizer, next(batches), offloader)
        steps.append((loss, {name: p.grad.clone() for name, p in model.named_parameters()}))
    if offloader is not None:
        offloader.close()
    return model, offloader, steps


def assert_same_steps(reference, candidate):
    for (ref_loss, ref_grads), (loss, grads) in zip(reference, candidate, strict=True):
        assert torch.equal(ref_loss, loss), (ref_loss, loss)
        assert ref_grads.keys() == grads.keys()
        for name in ref_grads:
            assert torch.equal(ref_grads[name], grads[name]), f"gradient of {name} differs"


@pytest.mark.parametrize("recompute", list(RECOMPUTE_FLAGS))
def test_training_is_exact_with_and_without_the_flag(world, spill_dir, recompute):
    _, _, reference = train(parse(*RECOMPUTE_FLAGS[recompute]))
    flags = ["--tba-offload-activations", "--tba-dir", spill_dir, "--tba-backend", "threads"]
    model, offloader, steps = train(parse(*RECOMPUTE_FLAGS[recompute], *flags), offloader_from_args)
    assert_same_steps(reference, steps)
    assert isinstance(offloader, MegatronOffloader)
    assert offloader.layers == list(model.decoder.layers)
    assert offloader.stats.bytes_written > 0 and offloader.stats.bytes_read > 0
    assert offloader.stats.resident_bytes == 0


def test_layer_tags_repeat_every_step(world, spill_dir):
    args = parse()
    model = pretrain_gpt.build_gpt(args, torch.device("cpu"))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    # Offload-all pinned: under the adaptive default the third step follows a plan, and a plan that keeps or
    # recomputes a layer (it depends on measured times) tags other bytes than the profiling steps did.
    offloader = MegatronOffloader(model, spill_dir, backend="threads", policy="offload")
    batches = pretrain_gpt.synthetic_batches(args, torch.device("cpu"))
    train_step(model, optimizer, next(batches), offloader)
    first = dict(offloader.layer_saved_bytes)
    for _ in range(STEPS - 1):
        train_step(model, optimizer, next(batches), offloader)
    offloader.close()
    assert set(first) == {None, 0, 1}, "the embedding (None) and both layers save activations"
    assert offloader.layer_saved_bytes == {layer: STEPS * nbytes for layer, nbytes in first.items()}


def test_full_recompute_writes_only_region_inputs_once(world, spill_dir):
    """Under full recompute each layer writes its input and nothing from inside; backward writes nothing."""
    args = parse("--recompute-granularity", "full")
    model = pretrain_gpt.build_gpt(args, torch.device("cpu"))
    batch = next(pretrain_gpt.synthetic_batches(args, torch.device("cpu")))
    aware = MegatronOffloader(model, spill_dir, backend="threads")
    plain = tba.Offloader(spill_dir, backend="threads", layers=list(model.decoder.layers))
    for offloader in (aware, plain):
        torch.manual_seed(0)
        with offloader:
            loss = pretrain_gpt.forward_loss(model, batch)
        offloader.flush()
        written = offloader.stats.bytes_written
        loss.backward()
        assert offloader.stats.bytes_written == written, "backward (the recompute) wrote to disk"
        offloader.close()
    assert aware.layer_saved_bytes[0] == HIDDEN_STATE_BYTES, "layer 0 writes exactly its input"
    masks_per_layer = 2  # bias-dropout-add after attention and after the MLP, run with grad on
    assert aware.tensors_kept_in_recompute == args.layers * masks_per_layer
    assert aware.bytes_kept_in_recompute == args.layers * masks_per_layer * HIDDEN_STATE_BYTES
    assert plain.layer_saved_bytes[0] == (1 + masks_per_layer) * HIDDEN_STATE_BYTES, "plain tba writes the masks"


def test_wrap_forward_step_runs_the_forward_inside_tba(world, spill_dir):
    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        output = model(**batch)
        return output, lambda out: out.mean()

    args = parse("--tba-offload-activations", "--tba-dir", spill_dir, "--tba-backend", "threads")
    wrapped = wrap_forward_step(forward_step, lambda: args)
    assert wrapped.tba_offloader() is None
    losses = []
    for step_func in (forward_step, wrapped):
        model = pretrain_gpt.build_gpt(args, torch.device("cpu"))
        batches = pretrain_gpt.synthetic_batches(args, torch.device("cpu"))
        torch.manual_seed(0)
        output, loss_func = step_func(batches, model)
        if step_func is wrapped:
            wrapped.tba_offloader().flush()
        loss_func(output).backward()
        losses.append(loss_func(output).detach())
    offloader = wrapped.tba_offloader()
    assert torch.equal(losses[0], losses[1])
    assert isinstance(offloader, MegatronOffloader) and offloader.stats.bytes_written > 0
    offloader.close()


def test_flags_parse_and_validate(capsys):
    parser = argparse.ArgumentParser()
    assert add_tba_arguments(parser) is parser, "usable as Megatron-LM's extra_args_provider"
    args = parser.parse_args([])
    assert (args.tba_offload_activations, args.tba_dir, args.tba_policy, args.tba_memory_budget, args.tba_backend) == \
        (False, None, None, None, None), "flags not given leave the option to TBA_* or the schema's default"
    assert parser.parse_args(["--tba-memory-budget", "2GiB"]).tba_memory_budget == 2 << 30
    assert parser.parse_args(["--tba-memory-budget", "1.5GB"]).tba_memory_budget == 1_500_000_000
    assert parser.parse_args(["--tba-policy", "adaptive"]).tba_policy == "adaptive"
    for bad in (["--tba-policy", "smart"], ["--tba-memory-budget", "lots"], ["--tba-backend", "gds"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)
    assert "'smart' is not a --tba-policy choice; choose from adaptive, offload, keep" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser.parse_args(["--tba-policy", "ofload"])
    assert "did you mean 'offload'?" in capsys.readouterr().err
    # Out of range: refused at parse, naming the flag (helper-85: only the offloader's build refused it, after the
    # model was made).
    for flag, value, reason in (("--tba-queue-depth", "0", "1..4096"), ("--tba-block-size-bytes", "1000", "multiple of 4096")):
        with pytest.raises(SystemExit):
            parser.parse_args([flag, value])
        err = capsys.readouterr().err
        assert flag in err and reason in err, err


def test_flags_that_keep_activations_in_memory_or_do_not_fit(world):
    model = pretrain_gpt.build_gpt(parse(), torch.device("cpu"))
    assert offloader_from_args(parse(), model) is None
    assert offloader_from_args(parse("--tba-offload-activations", "--tba-policy", "keep"), model) is None
    for flags in (["--tba-memory-budget", "1GiB"], ["--tba-policy", "adaptive"]):
        with pytest.raises(TbaConfigError, match="go together"):
            offloader_from_args(parse("--tba-offload-activations", *flags), model)
    recomputed = pretrain_gpt.build_gpt(parse(*RECOMPUTE_FLAGS["full"]), torch.device("cpu"))
    with pytest.raises(TbaConfigError, match="recompute them twice"):
        offloader_from_args(parse(*RECOMPUTE_FLAGS["full"], "--tba-offload-activations", "--tba-policy", "adaptive",
                                  "--tba-memory-budget", "1MiB"), recomputed)


def test_tba_flags_without_offload_activations_warn(caplog):
    """--tba-memory-budget or --tba-dir without --tba-offload-activations trained without tba, saying nothing."""
    model = torch.nn.Linear(2, 2)
    with caplog.at_level(logging.WARNING, logger="tba"):
        assert offloader_from_args(parse(), model) is None
        assert not caplog.records
        assert offloader_from_args(parse("--tba-memory-budget", "1GiB", "--tba-dir", "/x"), model) is None
    [record] = caplog.records
    assert all(word in record.getMessage() for word in ("--tba-dir", "--tba-memory-budget", "add --tba-offload-activations"))


def test_args_without_the_flags_or_a_model_that_is_not_one_are_refused():
    """offloader_from_args(None or a dict, model) returned None (tba silently off, also through wrap_forward_step), and
    MegatronOffloader("model") raised AttributeError from chunk.modules()."""
    for args in (None, {"tba_offload_activations": True}, argparse.Namespace(lr=0.1)):
        with pytest.raises(TbaConfigError, match="extra_args_provider=add_tba_arguments"):
            offloader_from_args(args, nn.Linear(2, 2))
    for model in ("model", 3, [nn.Linear(2, 2), "chunk"]):
        with pytest.raises(TbaConfigError, match="must be a module or a list of model chunks"):
            MegatronOffloader(model)


def test_adaptive_policy_is_exact_and_plans_after_profiling(world, spill_dir):
    _, _, reference = train(parse())
    flags = ["--tba-offload-activations", "--tba-dir", spill_dir, "--tba-backend", "threads",
             "--tba-policy", "adaptive", "--tba-overhead-bound", "0.5"]
    _, offloader, steps = train(parse(*flags), offloader_from_args)
    assert_same_steps(reference, steps)
    assert offloader.plan is not None and len(offloader.plan.decisions) == len(offloader.layers)


def test_offloader_built_directly_offloads_by_default(world, spill_dir, monkeypatch):
    """MegatronOffloader(model) took Offloader's default policy, "adaptive" (or $TBA_POLICY), unlike every other
    integration, and an implicit "adaptive" slipped past the check that refuses it beside Megatron's recompute."""
    monkeypatch.setenv("TBA_POLICY", "adaptive")
    for flags in ((), ("--recompute-granularity", "full")):
        model = pretrain_gpt.build_gpt(parse(*flags), torch.device("cpu"))
        offloader = MegatronOffloader(model, spill_dir, backend="threads")
        assert offloader.config.policy == "offload"
        offloader.close()
    with pytest.raises(TbaConfigError, match="recompute them twice"):
        MegatronOffloader(model, spill_dir, backend="threads", policy="adaptive")


def test_a_goal_without_the_adaptive_policy_names_the_integrations_default(world, spill_dir):
    """MegatronOffloader(model, memory_budget=...) said "need policy='adaptive', not 'offload'", a policy the user
    never gave (helper-154): it names the integration's default and the fix."""
    model = pretrain_gpt.build_gpt(parse(), torch.device("cpu"))
    with pytest.raises(TbaConfigError, match=r"^MegatronOffloader's memory_budget is a goal of policy='adaptive', and "
                                             r"policy is 'offload' \(the integration's default\): pass "
                                             r"policy='adaptive' too, or drop memory_budget$"):
        MegatronOffloader(model, spill_dir, backend="threads", memory_budget="1GiB")
    with pytest.raises(TbaConfigError, match=r"and policy is 'keep': pass"):
        MegatronOffloader(model, spill_dir, backend="threads", policy="keep", overhead_bound=0.1)


def test_bad_models_and_settings_are_refused():
    with pytest.raises(TbaConfigError, match="no megatron-core TransformerBlock"):
        MegatronOffloader(nn.Linear(4, 4))
    with pytest.raises(TbaConfigError, match="CheckpointWithoutOutput"):
        check_recompute_config(SimpleNamespace(recompute_granularity="selective",
                                               recompute_modules=["core_attn", "layernorm"]))
    with pytest.raises(TbaConfigError, match="cpu_offloading=False"):
        check_recompute_config(SimpleNamespace(cpu_offloading=True))
    check_recompute_config(SimpleNamespace(recompute_granularity="selective", recompute_modules=["core_attn", "mlp"]))
    uniform = SimpleNamespace(config=SimpleNamespace(recompute_granularity="full", recompute_method="uniform",
                                                     recompute_num_layers=2))
    block = SimpleNamespace(config=SimpleNamespace(recompute_granularity="full", recompute_method="block",
                                                   recompute_num_layers=2))
    assert (recompute_prefetch_depth([uniform]), recompute_prefetch_depth([block])) == (2, 1)


LINE_RE = re.compile(r"^step (\d+) loss (\S+) time (\d+\.\d+) mem (\d+\.\d+)$")


@pytest.mark.slow
def test_script_prints_identical_losses_with_and_without_tba(spill_dir):
    runs = []
    for flags in ([], ["--tba-offload-activations", "--tba-dir", spill_dir]):
        proc = run_python([str(SCRIPT_DIR / "pretrain_gpt.py"), *TINY, "--steps", "2", *flags], timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        steps = [LINE_RE.match(line) for line in proc.stdout.splitlines() if line.startswith("step ")]
        assert [m and int(m.group(1)) for m in steps] == [1, 2], proc.stdout
        runs.append([m.group(2) for m in steps])
        assert ("MiB written" in proc.stdout) == bool(flags)
    assert runs[0] == runs[1]


def test_a_config_that_chose_a_policy_keeps_it(world, spill_dir):
    """Note [An integration's offload default and a given config]: the integration's policy="offload" beside config=
    won over it: an adaptive config with its goal was refused as if its user had asked for offload, and a pinned plan
    became offload-all, silently."""
    model = pretrain_gpt.build_gpt(parse(), torch.device("cpu"))
    plan = tba.Plan(("keep", "offload"), 1 << 20)
    for config, policy in ((tba.OffloadConfig(policy="adaptive", overhead_bound=0.5), "adaptive"),
                           (tba.OffloadConfig(policy=plan), plan), (tba.OffloadConfig(backend="threads"), "offload")):
        offloader = MegatronOffloader(model, spill_dir, config=config)
        assert offloader.config.policy == policy
        offloader.close()


def test_wrap_forward_step_refuses_args_without_the_flags_where_it_is_called():
    """wrap_forward_step(step, None) returned a wrapper that raised only at the first training step's forward."""
    for args in (None, {"tba_offload_activations": True}):
        with pytest.raises(TbaConfigError, match="extra_args_provider=add_tba_arguments"):
            wrap_forward_step(lambda data, model: None, args)
    wrap_forward_step(lambda data, model: None, lambda: None)  # a getter is read at the first call


def test_a_prefetch_depth_from_the_config_or_its_variable_is_kept(world, spill_dir, monkeypatch):
    """MegatronOffloader set prefetch_depth_layers itself (1, or recompute_num_layers), an option, which won over the
    config= beside it and over TBA_PREFETCH_DEPTH_LAYERS, silently (Note [An integration's default yields to a chosen
    option] in tba/integrations/__init__.py)."""
    model = pretrain_gpt.build_gpt(parse("--recompute-granularity", "full", "--recompute-num-layers", "2"),
                                   torch.device("cpu"))
    depths = {}
    for name, options in (("config", {"config": tba.OffloadConfig(prefetch_depth_layers=3)}), ("default", {}),
                          ("option", {"prefetch_depth_layers": 5})):
        offloader = MegatronOffloader(model, spill_dir, backend="threads", **options)
        depths[name] = offloader.config.prefetch_depth_layers
        offloader.close()
    monkeypatch.setenv("TBA_PREFETCH_DEPTH_LAYERS", "4")
    offloader = offloader_from_args(parse("--recompute-granularity", "full", "--recompute-num-layers", "2",
                                          "--tba-offload-activations", "--tba-dir", spill_dir), model)
    depths["variable"] = offloader.config.prefetch_depth_layers
    offloader.close()
    assert depths == {"config": 3, "default": 2, "option": 5, "variable": 4}


def test_flags_checked_against_each_other_parse_in_either_order(capsys):
    """Each flag was range-checked alone, beside the schema's defaults of the others: --tba-staging-bytes 1M was refused
    at parse ("must hold at least one block of block_size_bytes (4194304); ... lower block_size_bytes") beside the
    --tba-block-size-bytes 512K that does so. A pair that does not fit is refused where the offloader is built."""
    parser = add_tba_arguments(argparse.ArgumentParser())
    for flags in (["--tba-staging-bytes", "1M", "--tba-block-size-bytes", "512K"],
                  ["--tba-block-size-bytes", "512K", "--tba-staging-bytes", "1M"]):
        options = tba.integrations.megatron.options_from_args(parser.parse_args(flags))
        assert (options["staging_bytes"], options["block_size_bytes"]) == (1 << 20, 512 << 10)
        assert tba.OffloadConfig(**options).staging_bytes == 1 << 20
    for flag, value, reason in (("--tba-staging-bytes", "-1", "staging_bytes"), ("--tba-block-size-bytes", "1000", "4096")):
        with pytest.raises(SystemExit):
            parser.parse_args([flag, value])
        err = capsys.readouterr().err
        assert flag in err and reason in err, err
    with pytest.raises(TbaConfigError, match="must hold at least one block"):
        tba.OffloadConfig(**tba.integrations.megatron.options_from_args(parser.parse_args(["--tba-staging-bytes", "1M"])))


def test_wrap_forward_step_refuses_flags_that_do_not_go_together_where_it_is_called():
    """--tba-policy adaptive without its goal (or a goal without it) passed wrap_forward_step and was refused only at
    the first training step's forward, after Megatron-LM had built the model and the optimizer."""
    for flags in (["--tba-policy", "adaptive"], ["--tba-memory-budget", "1GiB"]):
        with pytest.raises(TbaConfigError, match="go together"):
            wrap_forward_step(lambda data, model: None, parse("--tba-offload-activations", *flags))
        wrap_forward_step(lambda data, model: None, parse(*flags))  # tba off: offloader_from_args warns at the first call


def test_a_plan_that_only_keeps_and_offloads_runs_beside_megatrons_recompute(world, spill_dir):
    """Beside Megatron's recompute every policy but "offload" and "keep" was refused as "tba's adaptive policy chooses
    which layers to recompute itself", a pinned tba.Plan that recomputes nothing too, with a fix (--tba-policy offload)
    that drops the plan. A plan that recomputes a layer is refused naming the plan."""
    model = pretrain_gpt.build_gpt(parse(*RECOMPUTE_FLAGS["full"]), torch.device("cpu"))
    plan = tba.Plan(("keep", "offload"), 1 << 20)
    offloader = MegatronOffloader(model, spill_dir, backend="threads", policy=plan)
    assert offloader.config.policy == plan
    offloader.close()
    with pytest.raises(TbaConfigError, match=r"the plan recomputes layer 0 itself; Megatron's recompute_granularity='full' "
                                             r"would recompute it twice: .*keep or offload"):
        MegatronOffloader(model, spill_dir, backend="threads", policy=tba.Plan(("offloaded_recompute", "keep"), 1 << 20))
