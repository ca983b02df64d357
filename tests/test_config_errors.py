"""Bad input fails at the ``with`` line with an error that names the fix."""

from __future__ import annotations

import logging
import os
import re

import pytest
import torch

import tba
from tba import OffloadConfig, TbaConfigError, TbaError
from tba.io import SpillFile, available_backends


@pytest.mark.parametrize(
    "options, match",
    [
        ({"backend": "nvme-magic"}, "unknown backend 'nvme-magic'; choose one of auto, io_uring, threads"),
        ({"backend": 3}, "backend must be a string or an Engine"),
        ({"min_offload_bytes": -1}, "min_offload_bytes must be >= 0"),
        ({"prefetch_budget_bytes": -5}, "prefetch_budget_bytes must be >= 0"),
        ({"prefetch_depth_layers": -1}, "prefetch_depth_layers must be >= 0"),
        ({"block_size_bytes": 1000}, "block_size_bytes must be a positive multiple of 4096"),
        ({"memory_budget": 0}, "memory_budget must be > 0 .*leave it out for the default goal"),
        ({"memory_budget_bytes": "0M"}, "memory_budget_bytes must be > 0"),
        # A negative budget said "must be >= 0", and 0 is refused too.
        ({"memory_budget": -5}, "memory_budget must be > 0 .*got -5;"),
        ({"memory_budget_bytes": -1}, "memory_budget_bytes must be > 0 .*got -1;"),
    ],
)
def test_bad_options_raise_before_forward(spill_dir, options, match):
    with pytest.raises(TbaConfigError, match=match):
        with tba.offload_activations(spill_dir, **options):
            pytest.fail("the block must not run")


def test_directory_that_cannot_be_created(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(TbaConfigError, match="cannot create the offload directory .*pass directory="):
        with tba.offload_activations(str(blocker / "sub")):
            pytest.fail("the block must not run")


@pytest.mark.parametrize("below", ["", "sub"])
def test_directory_through_a_symbolic_link_to_a_missing_directory(tmp_path, below):
    """A link to a disk not mounted: the error said only "File exists"."""
    link = tmp_path / "scratch"
    link.symlink_to(tmp_path / "unmounted" / "tba")
    with pytest.raises(TbaConfigError, match="scratch is a symbolic link to .*unmounted/tba, which does not exist"):
        with tba.offload_activations(str(link / below)):
            pytest.fail("the block must not run")
    assert not (tmp_path / "unmounted").exists()


def test_directory_that_is_a_file(tmp_path):
    path = tmp_path / "file"
    path.write_text("")
    with pytest.raises(TbaConfigError, match="not a directory"):
        with tba.offload_activations(str(path)):
            pytest.fail("the block must not run")


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write into a read-only directory")
def test_directory_that_cannot_be_written(tmp_path):
    path = tmp_path / "ro"
    path.mkdir(mode=0o500)
    with pytest.raises(TbaConfigError, match="cannot"):
        with tba.offload_activations(str(path)):
            pytest.fail("the block must not run")


def test_directory_created_when_missing_and_default_from_env(tmp_path, monkeypatch, caplog):
    """Created with its parents and said at DEBUG (Note [The command line refuses a missing directory])."""
    target = tmp_path / "made" / "here"
    monkeypatch.setenv("TBA_DIR", str(target))
    with caplog.at_level(logging.DEBUG, logger="tba"):
        with tba.offload_activations() as off:
            torch.randn(10, requires_grad=True).exp()
    assert off.spill.directory == str(target) and target.is_dir()
    created = [r.getMessage() for r in caplog.records if "created the offload directory" in r.getMessage()]
    assert created == [f"tba: created the offload directory {target}, which did not exist"]
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="tba"), tba.offload_activations():
        pass
    assert not [r for r in caplog.records if "created the offload directory" in r.getMessage()]


def test_file_system_without_o_direct(spill_dir, monkeypatch, caplog):
    monkeypatch.setattr(tba.io._spill, "probe_direct_io", lambda directory: "O_DIRECT I/O failed: Invalid argument")
    with pytest.raises(TbaConfigError, match="choose a directory on a file system with O_DIRECT"):
        with tba.offload_activations(spill_dir, direct_io=True):
            pytest.fail("the block must not run")
    with caplog.at_level(logging.WARNING, logger="tba"):
        with tba.offload_activations(spill_dir) as off:
            pass
    assert not off.spill.direct
    assert [r.getMessage() for r in caplog.records] == [
        "tba: using buffered I/O (page cache) instead of O_DIRECT: O_DIRECT I/O failed: Invalid argument"
    ]


@pytest.mark.skipif(available_backends()["io_uring"] is None, reason="io_uring is available here")
def test_io_uring_requested_but_unavailable(spill_dir):
    with pytest.raises(TbaConfigError, match="backend 'io_uring' is not available: .*use backend='threads' or 'auto'"):
        tba.offload_activations(spill_dir, backend="io_uring")


@pytest.mark.parametrize("layers, match", [(5, "layers must be a module or a list of modules, got int 5"),
                                           ([1, 2], "layers must contain nn.Module objects, got int 1"),
                                           ("blocks", "layers must be a module or a list of modules")])
def test_bad_layers_are_config_errors(layers, match):
    with pytest.raises(TbaConfigError, match=match):
        tba.offload_activations(layers=layers)


def test_bad_plan_file_is_a_config_error(tmp_path):
    for text in ("not json", "[1, 2]", '{"decisions": ["fly"], "window_bytes": 0}', '{"window_bytes": 1}'):
        path = tmp_path / "plan.json"
        path.write_text(text)
        with pytest.raises(TbaConfigError, match="cannot load a plan from .*plan.json"):
            tba.Plan.load(str(path))
    with pytest.raises(TbaConfigError, match="cannot load a plan"):
        tba.Plan.load(str(tmp_path / "missing.json"))


def test_entering_a_one_shot_context_twice_names_the_reusable_offloader(spill_dir):
    x = torch.randn(64, 1024, requires_grad=True)
    ctx = tba.offload_activations(spill_dir)
    with ctx:
        y = x.sin()
    y.sum().backward()
    with pytest.raises(TbaError, match=r"one-shot.*tba\.Offloader\(\.\.\.\)"):
        with ctx:
            pass


@pytest.mark.parametrize("variable, value, option", [
    ("TBA_PROFILE_STEPS", "-1", "profile_steps"), ("TBA_QUEUE_DEPTH", "0", "queue_depth"),
    ("TBA_BLOCK_SIZE_BYTES", "1000", "block_size_bytes"), ("TBA_OVERHEAD_BOUND", "-1", "overhead_bound"),
    ("TBA_STAGING_BYTES", "0", "staging_bytes"), ("TBA_PREFETCH_DEPTH_LAYERS", "-1", "prefetch_depth_layers"),
])
def test_out_of_range_environment_value_names_the_variable(variable, value, option):
    from tba.config import OffloadConfig

    with pytest.raises(TbaConfigError, match=rf"{option}.*\(from \${variable}\)$"):
        OffloadConfig.from_env({variable: value})
    with pytest.raises(TbaConfigError) as raised:  # an argument is not blamed on the environment
        OffloadConfig.from_env({}, **{option: int(value)})
    assert "from $" not in str(raised.value)


def test_an_unknown_backend_from_the_environment_names_the_variable():
    """TBA_BACKEND=bogus raised "unknown backend 'bogus'" only when the offloader opened its engine, naming no variable,
    unlike every other TBA_* value (helper-143)."""
    with pytest.raises(TbaConfigError, match=r"unknown backend 'bogus'.*\(from \$TBA_BACKEND\)$"):
        tba.OffloadConfig.from_env({"TBA_BACKEND": "bogus"})
    assert tba.OffloadConfig.from_env({"TBA_BACKEND": "threads"}).backend == "threads"


@pytest.mark.parametrize("variable, value, expected", [
    ("TBA_DIRECT_IO", "auto", "write 1, 0 or none (true/false/none)"),
    ("TBA_VERIFY", "maybe", "write 1 or 0 (true/false)"),
])
def test_a_bad_flag_variable_names_every_value_it_takes(variable, value, expected):
    """TBA_DIRECT_IO takes none (the default, direct_io=None) too; its error named only 1 and 0 (helper-110)."""
    with pytest.raises(TbaConfigError, match=rf"^{variable}='{value}': {re.escape(expected)}$"):
        tba.OffloadConfig.from_env({variable: value})


@pytest.mark.parametrize("make, match", [
    (lambda: tba.offload_activations(policy="Keep"), r"unknown policy 'Keep'; did you mean 'keep'\? use one of adaptive"),
    (lambda: tba.OffloadConfig(policy="ofload"), r"unknown policy 'ofload'; did you mean 'offload'\?"),
    (lambda: tba.OffloadConfig.from_env({"TBA_POLICY": "Adaptive"}), r"did you mean 'adaptive'\?"),
    (lambda: tba.Offloader(backend="io-uring"), r"unknown backend 'io-uring'; did you mean 'io_uring'\? choose one of"),
    (lambda: tba.OffloadConfig(Policy="keep"), r"unknown option 'Policy'; did you mean 'policy'\?"),
])
def test_near_miss_of_a_name_suggests_the_closest(make, match):
    with pytest.raises(TbaConfigError, match=match):
        make()


def test_far_miss_names_the_values_without_a_guess():
    with pytest.raises(TbaConfigError, match="unknown policy 'swap'; use one of adaptive, offload, keep") as info:
        tba.OffloadConfig(policy="swap")
    assert "did you mean" not in str(info.value)


@pytest.mark.parametrize("variable, value", [("TBA_MEMORY_BUDGET_BYTES", "1G"), ("TBA_MEMORY_BUDGET", "1G"),
                                             ("TBA_OVERHEAD_BOUND", "0.3")])
def test_a_goal_argument_wins_over_every_goal_variable(variable, value):
    budget = OffloadConfig.from_env({variable: value}, memory_budget="2G")
    assert (budget.memory_budget, budget.overhead_bound) == (2 << 30, None)
    bound = OffloadConfig.from_env({variable: value}, overhead_bound=0.1)
    assert (bound.memory_budget, bound.overhead_bound) == (None, 0.1)


@pytest.mark.parametrize("variable, value", [("TBA_MEMORY_BUDGET_BYTES", "1G"), ("TBA_MEMORY_BUDGET", "1G"),
                                             ("TBA_OVERHEAD_BOUND", "0.3")])
@pytest.mark.parametrize("policy, named", [("offload", "'offload'"), ("keep", "'keep'"),
                                           (tba.Plan(("keep",), 0), "a Plan")])
def test_a_goal_variable_beside_a_policy_that_plans_none_names_the_variable(variable, value, policy, named):
    """A goal set in the environment with policy="offload" (every integration's default) was refused when the
    offloader was built, as "memory_budget and overhead_bound need policy='adaptive', not 'offload'", naming no
    variable: under DeepSpeed it blamed the "tba" block, which held no goal (helper-154)."""
    with pytest.raises(TbaConfigError, match=rf"^\${variable}={value} is a goal of policy='adaptive', but policy is "
                                             rf"{named}: unset {variable}, or pass policy='adaptive'$"):
        OffloadConfig.from_env({variable: value}, policy=policy)
    with pytest.raises(TbaConfigError, match=r"but policy is 'keep' \(from \$TBA_POLICY\)"):
        OffloadConfig.from_env({variable: value, "TBA_POLICY": "keep"})


def test_a_goal_variable_under_the_deepspeed_integration_is_named(monkeypatch, spill_dir):
    from torch import nn

    from tba.integrations.deepspeed import TbaDeepSpeed

    class Engine:
        module = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
        global_steps = 0
        config = {"tba": {"directory": spill_dir}}

    monkeypatch.setenv("TBA_MEMORY_BUDGET", "2G")
    with pytest.raises(TbaConfigError, match=r"\$TBA_MEMORY_BUDGET=2G is a goal of policy='adaptive', but policy is "
                                             r"'offload': unset TBA_MEMORY_BUDGET"):
        TbaDeepSpeed(Engine())


def test_a_goal_keyword_replaces_the_configs_goal():
    config = OffloadConfig(memory_budget="1G").replace(overhead_bound=0.2)
    assert (config.memory_budget, config.memory_budget_bytes, config.overhead_bound) == (None, None, 0.2)


def test_two_goal_variables_still_conflict():
    with pytest.raises(TbaConfigError, match="give one adaptive goal"):
        OffloadConfig.from_env({"TBA_MEMORY_BUDGET": "1G", "TBA_OVERHEAD_BOUND": "0.1"})


@pytest.mark.parametrize("make, match", [
    (lambda: tba.Plan("keep", 0), r"Plan decisions must be a sequence of placements, one per layer, such as "
                                  r"\('keep', 'offload'\), got str 'keep'"),
    (lambda: tba.Adaptive(memory_budget_bytes="1 foo"), "memory_budget_bytes: not a size: '1 foo'"),
    (lambda: tba.Adaptive(memory_budget_bytes=[1]), "memory_budget_bytes must be bytes .* got list"),
    (lambda: tba.Adaptive(overhead_bound="x"), "overhead_bound must be a number such as 0.1, got str 'x'"),
    (lambda: tba.Adaptive(overhead_bound=-1), "overhead_bound must be >= 0"),
    (lambda: tba.find_layers(5), r"find_layers takes the model \(an nn.Module\), got int 5"),
])
def test_bad_arguments_of_public_helpers_are_config_errors(make, match):
    with pytest.raises(TbaConfigError, match=match):
        make()


def test_adaptive_takes_a_size_string_as_every_budget_does():
    assert tba.Adaptive(memory_budget_bytes="1G").memory_budget_bytes == 1 << 30


@pytest.mark.parametrize("directory, match", [
    ("/proc", r"creating a file in /proc failed \(No such file or directory\): it is on proc, a kernel pseudo file "
              r"system that holds no files; pass directory="),
    ("/proc/tba", r"cannot create the offload directory /proc/tba: creating a directory in /proc failed \(No such file "
                  r"or directory\): it is on proc, a kernel pseudo file system"),
])
def test_a_pseudo_file_system_is_named_not_a_missing_file(directory, match):
    """/proc said only "No such file or directory" of a directory that exists."""
    if os.geteuid() != 0 and directory == "/proc":
        pytest.skip("as a user, /proc is refused earlier as not writable")
    with pytest.raises(TbaConfigError, match=match):
        SpillFile(directory)


@pytest.mark.parametrize("make", [tba.offload_activations, tba.Offloader])
def test_policy_keep_from_the_environment_without_layers_names_the_variable(make, monkeypatch, spill_dir):
    """``TBA_POLICY=keep`` exported for a baseline run made a bare context fail as "policy keep needs the model's
    layers: pass layers=model", naming neither the variable nor that unsetting it is a fix: the program passed no
    policy at all (helper-168). An argument is not blamed on the environment."""
    monkeypatch.setenv("TBA_POLICY", "keep")
    with pytest.raises(TbaConfigError, match=r"^policy keep needs the model's layers: pass layers=model or a list of "
                                             r"blocks \(policy from \$TBA_POLICY=keep: or unset TBA_POLICY\)$"):
        make(spill_dir)
    with pytest.raises(TbaConfigError) as raised:
        make(spill_dir, policy="keep")
    assert "TBA_POLICY" not in str(raised.value)
    make(spill_dir, layers=[torch.nn.Linear(2, 2)]).close()  # with layers the variable's keep runs


def test_tba_directory_is_refused_naming_tba_dir(monkeypatch, spill_dir, tmp_path):
    """Every option's variable is TBA_<NAME> (help(tba.OffloadConfig), the README) but the directory's, TBA_DIR:
    ``TBA_DIRECTORY=/nvme/tba`` was ignored in silence and the spill file went to the system temp directory, maybe a
    RAM-backed one (helper-168). It is refused naming TBA_DIR, also beside TBA_DIR (two places for one option)."""
    monkeypatch.setenv("TBA_DIRECTORY", str(tmp_path))
    with pytest.raises(TbaConfigError, match=r"^\$TBA_DIRECTORY is not read: the directory's variable is TBA_DIR; "
                                             r"rename it to TBA_DIR$"):
        tba.offload_activations()
    monkeypatch.setenv("TBA_DIR", spill_dir)
    with pytest.raises(TbaConfigError, match=r"^\$TBA_DIRECTORY is not read"):
        tba.OffloadConfig.from_env()
    assert tba.OffloadConfig.from_env(directory=spill_dir).directory == spill_dir  # an argument needs no variable
    assert tba.OffloadConfig(directory=spill_dir).directory == spill_dir  # the plain constructor reads none
    monkeypatch.delenv("TBA_DIRECTORY")
    assert tba.OffloadConfig.from_env().directory == spill_dir
