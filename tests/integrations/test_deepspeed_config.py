"""The "tba" block of a DeepSpeed config, and the shared-disk check: no DeepSpeed needed.

A stand-in engine (module, config, global_steps) drives :class:`TbaDeepSpeed` through the
NVMe paths that need DeepSpeed's async_io op, which CI does not build.
"""

from __future__ import annotations

import errno
import json
import logging
import os

import pytest
import torch

from tba import OffloadConfig, TbaConfigError
from tba.bench.models import PRESETS, make_batch, make_gpt
from tba.integrations import deepspeed as tba_ds
from tba.integrations import shared_disk
from tba.io import _bandwidth


class FakeEngine:
    """What TbaDeepSpeed uses of a DeepSpeedEngine; step() counts optimizer steps."""

    def __init__(self, config: dict) -> None:
        self.module = make_gpt(PRESETS["tiny"])
        self.config = config
        self.global_steps = 0

    def __call__(self, *args):
        return self.module(*args)

    def step(self) -> None:
        self.global_steps += 1


def nvme_config(nvme_path: str, *, aio: dict | None = None, **block) -> dict:
    config = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": nvme_path}},
              "tba": block}
    if aio is not None:
        config["aio"] = aio
    return config


def test_no_block_means_no_tba():
    assert tba_ds.parse_config({"zero_optimization": {"stage": 2}}) is None
    offload = tba_ds.TbaDeepSpeed(FakeEngine({}))
    assert offload.offloader is None and offload.stats is None
    with offload:
        pass
    offload.close()


@pytest.mark.parametrize("block, words", [
    ({"dirctory": "/tmp"}, ["unknown key", "'dirctory'", "did you mean 'directory'?"]),
    ({"queue_depth": -1}, ["queue_depth", "1..4096"]),
    ({"queue_depth": True}, ["queue_depth", "an int"]),
    ({"enabled": "yes"}, ["enabled", "true or false"]),
    ({"directory": 3}, ["directory", "a path"]),
    ({"direct_io": "on"}, ["direct_io"]),
    ("on", ["must be an object"]),
    ({"memory_budget": "1G"}, ["\"memory_budget\" is a goal of \"policy\": \"adaptive\", and this block's policy is "
                               "\"offload\" (the default here)", "add \"policy\": \"adaptive\", or drop \"memory_budget\""]),
    ({"policy": "keep", "overhead_bound": 0.1}, ["\"overhead_bound\" is a goal of \"policy\": \"adaptive\", and this "
                                                 "block's policy is \"keep\"", "or drop \"overhead_bound\""]),
])
def test_bad_block_is_refused_with_the_fix(block, words):
    """A goal without "policy": "adaptive" was refused only by the offloader, as "need policy='adaptive', not 'offload'"
    for a block that never said "offload"; beside "keep" it was accepted and tba silently stayed off (helper-154)."""
    with pytest.raises(TbaConfigError) as err:
        tba_ds.parse_config({"tba": block})
    for word in words:
        assert word in str(err.value)
    assert "DeepSpeed config \"tba\" block" in str(err.value)


def test_policies_pass_through_to_the_offloader(spill_dir):
    adaptive = tba_ds.TbaDeepSpeed(FakeEngine({"tba": {"directory": spill_dir, "policy": "adaptive",
                                                       "memory_budget_bytes": 1 << 20}}))
    assert adaptive.offloader.policy_runner.policy.memory_budget_bytes == 1 << 20
    adaptive.close()
    for block in ({"policy": "smart"}, {"memory_budget_bytes": 1 << 20}, {"memory_budget": "1M"}):
        with pytest.raises(TbaConfigError, match="\"tba\" block: "):
            tba_ds.TbaDeepSpeed(FakeEngine({"tba": {"directory": spill_dir, **block}}))
    assert tba_ds.TbaDeepSpeed(FakeEngine({"tba": {"policy": "keep"}})).offloader is None
    assert tba_ds.TbaDeepSpeed(FakeEngine({"tba": {"enabled": False}})).offloader is None


def test_offloader_errors_name_the_block(spill_dir):
    with pytest.raises(TbaConfigError, match=r"\"tba\" block: block_size_bytes must be a positive multiple of 4096"):
        tba_ds.TbaDeepSpeed(FakeEngine({"tba": {"directory": spill_dir, "block_size_bytes": 1000}}))
    with pytest.raises(TbaConfigError, match="unknown backend 'uring'"):
        tba_ds.TbaDeepSpeed(FakeEngine({"tba": {"directory": spill_dir, "backend": "uring"}}))


def test_the_integration_says_what_it_runs(spill_dir):
    """``repr(TbaDeepSpeed(engine))`` was ``<... object at 0x...>``, saying neither whether tba is on nor with what
    (helper-168)."""
    assert repr(tba_ds.TbaDeepSpeed(FakeEngine({}))) == "TbaDeepSpeed(off: no \"tba\" block)"
    assert repr(tba_ds.TbaDeepSpeed(FakeEngine({"tba": {"enabled": False}}))) == "TbaDeepSpeed(off: \"enabled\": false)"
    assert repr(tba_ds.TbaDeepSpeed(FakeEngine({"tba": {"policy": "keep"}}))) == "TbaDeepSpeed(off: \"policy\": \"keep\")"
    on = tba_ds.TbaDeepSpeed(FakeEngine({"tba": {"directory": spill_dir}}))
    assert repr(on) == f"TbaDeepSpeed({on.offloader!r})" and spill_dir in repr(on) and "policy=offload" in repr(on)
    on.close()


def test_config_file_is_read(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"tba": {"directory": "/x", "queue_depth": 4}}))
    settings = tba_ds.parse_config(str(path))
    assert settings.directory == "/x" and settings.offloader_options == {"queue_depth": 4}
    path.write_text("{not json")
    with pytest.raises(TbaConfigError, match="as JSON"):
        tba_ds.parse_config(str(path))
    path.write_text("[1, 2]")
    with pytest.raises(TbaConfigError, match="holds list, not a JSON object"):
        tba_ds.parse_config(path)


@pytest.mark.parametrize("config", [5, None, ["ds.json"]])
def test_a_config_neither_a_dict_nor_a_path_is_refused_before_anything_is_read(config):
    # open(5) would have read file descriptor 5 (helper-85)
    with pytest.raises(TbaConfigError, match="must be a dict or the path of a JSON file"):
        tba_ds.parse_config(config)


def test_nvme_offload_places_tba_beside_the_swap_and_takes_aio_settings(tmp_path):
    nvme = str(tmp_path / "nvme")
    settings = tba_ds.parse_config(nvme_config(nvme, aio={"block_size": 2 << 20, "queue_depth": 16}))
    assert settings.directory == os.path.join(nvme, "tba")
    assert settings.offloader_options["block_size_bytes"] == 2 << 20
    assert settings.offloader_options["queue_depth"] == 16
    assert settings.optimizer_on_nvme and not settings.params_on_nvme
    defaults = tba_ds.parse_config(nvme_config(nvme))
    assert (defaults.offloader_options["block_size_bytes"], defaults.offloader_options["queue_depth"]) == (1 << 20, 8)
    explicit = tba_ds.parse_config(nvme_config(nvme, aio={"queue_depth": 16}, directory="/elsewhere", queue_depth=2))
    assert explicit.directory == "/elsewhere" and explicit.offloader_options["queue_depth"] == 2
    config = nvme_config(nvme)
    config["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": str(tmp_path / "params")}
    both = tba_ds.parse_config(config)
    assert both.directory == str(tmp_path / "params" / "tba") and both.params_on_nvme
    assert tba_ds.parse_config({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}, "tba": {}}).directory is None
    with pytest.raises(TbaConfigError, match="no nvme_path"):
        tba_ds.parse_config({"zero_optimization": {"offload_param": {"device": "nvme"}}, "tba": {}})


def test_zero_below_stage_3_swaps_nothing_to_nvme(tmp_path):
    """ZeRO-1/2 accept offload_optimizer device "nvme" but keep the states in host memory (no swapper)."""
    config = nvme_config(str(tmp_path / "nvme"))
    config["zero_optimization"]["stage"] = 2
    settings = tba_ds.parse_config(config)
    assert settings.directory == str(tmp_path / "nvme" / "tba")
    assert not settings.optimizer_on_nvme and not settings.params_on_nvme


def train_fake(engine: FakeEngine, offload: tba_ds.TbaDeepSpeed, steps: int) -> list[float]:
    tokens, targets = make_batch(PRESETS["tiny"])
    losses = []
    for step in range(steps):
        torch.manual_seed(step)
        with offload:
            loss = engine(tokens, targets)
        loss.backward()
        engine.step()
        losses.append(loss.item())
    offload.close()
    return losses


def test_shared_disk_check_runs_after_the_first_step_and_cleans_up(tmp_path, monkeypatch, caplog):
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    calls = []

    def slow_disk(directory, **options):
        calls.append((directory, options))
        return 1e3, 1e3

    monkeypatch.setattr(shared_disk, "measure_bandwidth", slow_disk)
    engine = FakeEngine(nvme_config(str(nvme), aio={"block_size": 1 << 20, "queue_depth": 4}, backend="threads",
                                    min_offload_bytes=0))
    offload = tba_ds.TbaDeepSpeed(engine)
    with caplog.at_level(logging.WARNING, logger="tba"):
        losses = train_fake(engine, offload, 3)
    assert calls == [(str(nvme / "tba"), {"backend": "threads", "block_size_bytes": 1 << 20, "queue_depth": 4})]
    assert offload.stats.bytes_written > 0
    assert sum("cannot keep up" in record.getMessage() for record in caplog.records) == 1
    assert os.listdir(nvme) == [], "tba's subdirectory was left behind"
    reference = FakeEngine({})
    assert train_fake(reference, tba_ds.TbaDeepSpeed(reference), 3) == losses


def test_check_shared_disk_compares_io_time_with_step_time():
    common = {"write_bytes_per_s": 1e9, "read_bytes_per_s": 0.5e9, "directory": "/nvme/tba"}
    assert shared_disk.check_shared_disk(tba_bytes_per_step=600_000_000, deepspeed_bytes_per_step=0, step_s=1.0,
                                         **common) is None
    warning = shared_disk.check_shared_disk(tba_bytes_per_step=600_000_000, deepspeed_bytes_per_step=200_000_000,
                                            step_s=1.0, **common)
    assert warning is not None and "1.20 s of I/O" in warning and "/nvme/tba" in warning
    assert shared_disk.deepspeed_swap_bytes_per_step(optimizer_on_nvme=True, params_on_nvme=True, num_params=10,
                                                     param_itemsize_bytes=2) == 240 + 60


def test_measure_bandwidth_leaves_nothing(spill_dir):
    write_rate, read_rate = shared_disk.measure_bandwidth(spill_dir, backend="threads", probe_bytes=4 << 20)
    assert write_rate > 0 and read_rate > 0
    assert shared_disk.same_device(spill_dir, os.path.join(spill_dir, "not", "yet"))


def test_close_removes_the_nvme_path_it_made_and_nothing_else(tmp_path):
    """Note [TbaDeepSpeed removes the directories it made]: an empty nvme_path stayed (helper-41)."""
    nvme = tmp_path / "disk" / "nvme"
    engine = FakeEngine(nvme_config(str(nvme), backend="threads", min_offload_bytes=0, check_bandwidth=False))
    offload = tba_ds.TbaDeepSpeed(engine)
    train_fake(engine, offload, 2)
    assert offload.stats.bytes_written > 0
    assert os.listdir(tmp_path) == [], "directories tba made were left behind"
    engine = FakeEngine(nvme_config(str(nvme), backend="threads", min_offload_bytes=0, check_bandwidth=False))
    offload = tba_ds.TbaDeepSpeed(engine)
    train_fake(engine, offload, 1)  # close() included; now a swap folder appears before the second close
    offload = tba_ds.TbaDeepSpeed(engine)
    with offload:
        engine(*make_batch(PRESETS["tiny"]))
    (nvme / "zero_stage_3").mkdir()
    offload.close()
    assert sorted(os.listdir(nvme)) == ["zero_stage_3"], "a directory holding DeepSpeed's files was removed"


def test_close_removes_a_directory_given_under_home(tmp_path, monkeypatch):
    """"directory": "~/..." is the offloader's under $HOME; close() looked for the directories it made under
    ./~ and left the real ones behind."""
    monkeypatch.setenv("HOME", str(tmp_path))
    engine = FakeEngine({"tba": {"directory": "~/disk/tba", "backend": "threads", "min_offload_bytes": 0}})
    offload = tba_ds.TbaDeepSpeed(engine)
    train_fake(engine, offload, 1)
    assert offload.stats.bytes_written > 0
    assert os.listdir(tmp_path) == [], "directories tba made were left behind"


def test_an_aio_setting_tba_cannot_take_is_blamed_on_aio(tmp_path):
    """An aio.block_size tba refuses was reported as the "tba" block's block_size_bytes, a key it did not set."""
    with pytest.raises(TbaConfigError, match=r"aio\.block_size 1000,.*set \"block_size_bytes\" in the \"tba\" block"):
        tba_ds.parse_config(nvme_config(str(tmp_path), aio={"block_size": 1000}))
    settings = tba_ds.parse_config(nvme_config(str(tmp_path), aio={"block_size": 1000}, block_size_bytes=1 << 20))
    assert settings.offloader_options["block_size_bytes"] == 1 << 20


def test_a_bad_layers_argument_is_not_blamed_on_the_block():
    """TbaDeepSpeed(engine, layers="x") said 'DeepSpeed config "tba" block: layers must be ...', a key the block cannot have."""
    with pytest.raises(TbaConfigError, match="^layers must be a module") as err:
        tba_ds.TbaDeepSpeed(FakeEngine({"tba": {}}), layers="x")
    assert "DeepSpeed config" not in str(err.value)


def test_shared_disk_check_takes_sizes_written_as_text(tmp_path, monkeypatch):
    """The block may give sizes as text ("64K"); the check after the first step measured with the raw string
    and raised TypeError at the second step's ``with``, ending the training."""
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    calls = []
    monkeypatch.setattr(shared_disk, "measure_bandwidth", lambda directory, **options: calls.append(options) or (1e12, 1e12))
    engine = FakeEngine(nvme_config(str(nvme), backend="threads", min_offload_bytes=0, block_size_bytes="64K",
                                    queue_depth=4))
    train_fake(engine, tba_ds.TbaDeepSpeed(engine), 3)
    assert calls == [{"backend": "threads", "block_size_bytes": 64 << 10, "queue_depth": 4}]
    assert os.listdir(nvme) == []


@pytest.mark.parametrize("error", [OSError(errno.ENOSPC, "No space left on device"),
                                   OSError(errno.EINVAL, "Invalid argument")], ids=["full", "no-o-direct"])
def test_shared_disk_check_that_cannot_measure_does_not_end_training(tmp_path, monkeypatch, caplog, error):
    """The check's 64 MiB probe file on a nearly full shared disk (posix_fallocate: ENOSPC), or an O_DIRECT open where
    the file system has none (tba's own spill falls back to buffered I/O): the raw OSError came out of the second
    step's ``with``, ending a training that ran, for a diagnostic. It is skipped with a warning naming the reason."""
    nvme = tmp_path / "nvme"
    nvme.mkdir()

    def failing_open(directory, size, **options):
        raise error

    monkeypatch.setattr(_bandwidth, "open_scratch", failing_open)
    engine = FakeEngine(nvme_config(str(nvme), backend="threads", min_offload_bytes=0))
    offload = tba_ds.TbaDeepSpeed(engine)
    with caplog.at_level(logging.WARNING, logger="tba"):
        losses = train_fake(engine, offload, 3)
    warnings = [record.getMessage() for record in caplog.records if "shared-disk check" in record.getMessage()]
    assert len(warnings) == 1 and error.strerror in warnings[0] and '"check_bandwidth": false' in warnings[0], warnings
    assert offload.stats.bytes_written > 0 and os.listdir(nvme) == []
    reference = FakeEngine({})
    assert train_fake(reference, tba_ds.TbaDeepSpeed(reference), 3) == losses


@pytest.mark.parametrize("given", ["model", "initialize's tuple"])
def test_something_other_than_the_engine_is_refused_naming_it(given):
    """The model (whose own ``config`` was read as DeepSpeed's: "the DeepSpeed config must be a dict ..., got GPTConfig")
    or deepspeed.initialize's whole tuple (AttributeError: 'tuple' object has no attribute 'config')."""
    model = make_gpt(PRESETS["tiny"])
    with pytest.raises(TbaConfigError, match=r"engine, optimizer, _, _ = deepspeed.initialize"):
        tba_ds.TbaDeepSpeed(model if given == "model" else (model, None, None, None))


@pytest.mark.parametrize(("config", "words"), [
    ({"zero_optimization": 3}, "zero_optimization must be an object"),
    ({"zero_optimization": {"stage": 3, "offload_param": "nvme"}}, "zero_optimization.offload_param must be an object"),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": 5}}},
     "offload_optimizer.nvme_path must be a path"),
    ({"aio": [1], "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/x"}}},
     "aio must be an object"),
], ids=["zero", "offload_param", "nvme_path", "aio"])
def test_a_deepspeed_section_of_the_wrong_type_is_refused_naming_it(config, words):
    """tba read these sections' keys with ``.get``: AttributeError or TypeError from inside tba (helper-125)."""
    with pytest.raises(TbaConfigError, match=words):
        tba_ds.TbaDeepSpeed(FakeEngine({**config, "tba": {}}))


def test_tba_variables_win_over_the_defaults_taken_from_nvme_offload(tmp_path, monkeypatch):
    """With NVMe offload the directory and the request size and depth default to DeepSpeed's nvme_path and aio block,
    passed to the offloader as arguments, which win over TBA_DIR and the other variables: TBA_DIR, set to put tba on
    another disk (as the shared-disk warning advises), was ignored silently (Note [An integration's default yields to a
    chosen option] in tba/integrations/__init__.py). The block's own keys still win over the variables."""
    nvme, elsewhere = tmp_path / "nvme", tmp_path / "elsewhere"
    nvme.mkdir()
    elsewhere.mkdir()
    monkeypatch.setenv("TBA_DIR", str(elsewhere))
    monkeypatch.setenv("TBA_QUEUE_DEPTH", "32")
    offload = tba_ds.TbaDeepSpeed(FakeEngine(nvme_config(str(nvme), backend="threads")))
    config = offload.offloader.config
    assert (config.directory, config.queue_depth, config.block_size_bytes) == (str(elsewhere), 32, 1 << 20)
    assert offload._check_pending, "the shared-disk check is of the directory tba writes to, on nvme_path's disk here"
    offload.close()
    given = tba_ds.parse_config(nvme_config(str(nvme), directory=str(nvme / "mine"), queue_depth=2))
    assert given.directory == str(nvme / "mine") and given.offloader_options["queue_depth"] == 2


def test_a_staging_pool_that_holds_the_aio_block_is_taken(tmp_path):
    """The block was checked alone, beside the schema's 4 MiB block size: "staging_bytes": "2M" was refused ("must hold
    at least one block of block_size_bytes (4194304)") though with NVMe offload the block size is DeepSpeed's
    aio.block_size, 1 MiB by default; and an aio.block_size of 512 MiB was blamed on aio beside a block's 1 GiB pool."""
    nvme = str(tmp_path / "nvme")
    for aio, staging, block_size in (({}, "2M", 1 << 20), ({"block_size": 512 << 20}, "1G", 512 << 20)):
        offload = tba_ds.TbaDeepSpeed(FakeEngine(nvme_config(nvme, aio=aio, backend="threads", staging_bytes=staging,
                                                             check_bandwidth=False)))
        assert (offload.offloader.config.block_size_bytes, offload.offloader.config.staging_bytes) == \
            (block_size, OffloadConfig(staging_bytes=staging, block_size_bytes=4096).staging_bytes)
        offload.close()
    with pytest.raises(TbaConfigError, match=r"^DeepSpeed config \"tba\" block: staging_bytes \(2097152\) must hold"):
        tba_ds.TbaDeepSpeed(FakeEngine({"tba": {"staging_bytes": "2M"}}))  # no NVMe offload: the schema's 4 MiB block
