"""tba beside DeepSpeed's real NVMe optimizer swap (ZeRO-3, ``offload_optimizer: {device: nvme}``) on CPU.

DeepSpeed swaps optimizer states through its ``async_io`` op, which needs ``libaio-dev`` and a JIT
build (a few minutes the first time, then cached under ``$TORCH_EXTENSIONS_DIR``, which ``make``
sets to ``.venv/torch_extensions``). Where the
op is not available this module is skipped with the reason and the fix; ``make deepspeed-aio``
builds it, and CI does so.

The model is the tiny GPT widened to 128 so that its optimizer partition (about 1.7 MB of fp32)
exceeds DeepSpeed's smallest swappable tensor (``aio`` block size, 1 MiB); smaller partitions
stay in memory. One run without and one with tba, from the same weights and batches: losses
``torch.equal``. The shared-disk check that tba runs after the first optimizer step is compared
with the traffic the kernel measured (``/proc/self/io``) on the shared disk during a step: its
estimate of DeepSpeed's swap bytes, and its decision to warn, which is also exercised with the
measured bandwidth scaled down until the disk cannot keep up.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib

import pytest
import torch
from utils import load_script

deepspeed = pytest.importorskip("deepspeed")

from tba.bench.models import PRESETS, make_batch, make_gpt  # noqa: E402
from tba.integrations import shared_disk  # noqa: E402
from tba.integrations.deepspeed import TbaDeepSpeed  # noqa: E402

CONFIG = dataclasses.replace(PRESETS["tiny"], width=128)
STEPS = 3
ESTIMATE_TOLERANCE = 0.10
"""DeepSpeed's swap files are padded to its alignment; its traffic is within a few % of the estimate."""


def async_io_skip_reason() -> str | None:
    """Why DeepSpeed's async_io op cannot be used here (None when it can), naming the fix."""
    from deepspeed.git_version_info import installed_ops
    from deepspeed.ops.op_builder import AsyncIOBuilder
    from torch.utils.cpp_extension import _get_build_directory

    builder = AsyncIOBuilder()
    if installed_ops.get(builder.NAME):
        return None
    if not builder.is_compatible(verbose=False):
        return "DeepSpeed's async_io op cannot build: libaio is missing (apt-get install libaio-dev)"
    built = os.path.join(_get_build_directory(builder.NAME, verbose=False), f"{builder.NAME}.so")
    if not os.path.exists(built):
        return f"DeepSpeed's async_io op is not built yet ({built}); `make deepspeed-aio` builds it (about 2 minutes, cached)"
    return None


_reason = async_io_skip_reason()
pytestmark = [pytest.mark.skipif(_reason is not None, reason=_reason or ""),
              pytest.mark.usefixtures("single_process_group")]


def disk_io_bytes() -> int:
    """Bytes this process read from and wrote to block devices so far (``/proc/self/io``)."""
    with open("/proc/self/io") as io:
        fields = dict(line.split(": ") for line in io.read().splitlines() if line)
    return int(fields["read_bytes"]) + int(fields["write_bytes"])


def train(nvme_path: str, directory: str | None):
    """STEPS ZeRO-3 steps with the optimizer on NVMe; (losses, per-step disk bytes, per-step tba bytes, offload)."""
    model = make_gpt(CONFIG, seed=0)
    config = {
        "train_micro_batch_size_per_gpu": CONFIG.batch_size,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": nvme_path}},
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 1 << 30,
    }
    if directory is not None:
        config["tba"] = {"directory": directory, "backend": "threads", "min_offload_bytes": 16 << 10}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    assert engine.optimizer.optimizer_swapper is not None, "DeepSpeed did not set up its NVMe optimizer swap"
    offload = TbaDeepSpeed(engine)
    losses, disk_bytes, tba_bytes = [], [], []
    for index in range(STEPS):
        tokens, targets = make_batch(CONFIG, seed=index)
        torch.manual_seed(index)
        with offload:
            disk_before = disk_io_bytes()
            tba_before = 0 if offload.stats is None else offload.stats.bytes_written + offload.stats.bytes_read
            loss = engine(tokens, targets)
        if offload.offloader is not None:
            offload.offloader.flush()
        engine.backward(loss)
        engine.step()
        disk_bytes.append(disk_io_bytes() - disk_before)
        tba_bytes.append(0 if offload.stats is None else offload.stats.bytes_written + offload.stats.bytes_read - tba_before)
        losses.append(loss.detach())
    return losses, disk_bytes, tba_bytes, offload


@pytest.fixture(autouse=True)
def op_flags_as_built(monkeypatch):
    """DeepSpeed loads the op with the flags and ``build.ninja`` that ``make deepspeed-aio`` built it with (Notes [The
    NVMe test loads the op built with these flags], [Files without torch compile without its header] in
    ``tools/deepspeed_aio.py``)."""
    import torch.utils.cpp_extension as cpp_extension
    from deepspeed.ops.op_builder import AsyncIOBuilder, PinMemoryBuilder

    for builder in (AsyncIOBuilder, PinMemoryBuilder):
        monkeypatch.setattr(builder, "cxx_args", builder.cxx_args)  # restored after the test
    script = load_script(pathlib.Path(__file__).resolve().parents[2] / "tools" / "deepspeed_aio.py")
    script.patch_flags(AsyncIOBuilder, PinMemoryBuilder)
    monkeypatch.setattr(cpp_extension, "_run_ninja_build",
                        script.build_hook(script.pch_header_path(), cpp_extension._run_ninja_build))
    built = object_times()
    yield
    assert object_times() == built, "DeepSpeed recompiled its ops at load: they were built with other flags or commands"


def object_times() -> dict[str, int]:
    """Modification times of the built ops' objects and libraries (none where DeepSpeed's ops came installed)."""
    from torch.utils.cpp_extension import _get_build_directory

    times = {}
    for name in ("async_io", "pin_memory"):
        directory = _get_build_directory(name, verbose=False)
        if os.path.isdir(directory):
            times.update({entry.path: entry.stat().st_mtime_ns for entry in os.scandir(directory)
                          if entry.name.endswith((".o", ".so"))})
    return times


SLOWDOWN = 10_000
"""The slow-disk case reports this disk's measured bandwidth divided by this, so that the warning fires."""


@pytest.mark.parametrize("slow_disk", [False, True], ids=["measured-disk", "slowed-disk"])
def test_zero3_nvme_optimizer_swap_beside_tba_is_exact_and_the_disk_check_matches_the_traffic(
        spill_dir, tmp_path, monkeypatch, caplog, slow_disk):
    checks = []
    real_check = shared_disk.check_shared_disk
    real_measure = shared_disk.measure_bandwidth

    def slowed_measure(*args, **kwargs):
        return tuple(rate / SLOWDOWN for rate in real_measure(*args, **kwargs))

    if slow_disk:
        monkeypatch.setattr(shared_disk, "measure_bandwidth", slowed_measure)

    def recording_check(**kwargs):
        checks.append((kwargs, real_check(**kwargs)))
        return checks[-1][1]

    monkeypatch.setattr(shared_disk, "check_shared_disk", recording_check)
    nvme = tmp_path / "nvme"
    reference, _, _, _ = train(str(nvme / "reference"), None)
    losses, disk_bytes, tba_bytes, offload = train(str(nvme / "tba"), spill_dir)
    assert all(torch.equal(a, b) for a, b in zip(reference, losses)), (reference, losses)
    assert offload.stats.bytes_written > 0 and offload.stats.bytes_read > 0
    swap_files = list((nvme / "tba").rglob("*.tensor.swp"))
    assert swap_files, "DeepSpeed wrote no swap file"
    offload.close()

    assert len(checks) == 1, "the shared-disk check should run once, after the first optimizer step"
    planned, warning = checks[0]
    assert planned["tba_bytes_per_step"] == tba_bytes[0], "the check should count the first step's tba traffic"
    measured_deepspeed = disk_bytes[-1] - tba_bytes[-1]
    if disk_bytes[-1] == 0:
        pytest.skip("/proc/self/io counts no block I/O for this directory (tmpfs?); traffic not compared")
    estimate = planned["deepspeed_bytes_per_step"]
    assert abs(measured_deepspeed - estimate) <= ESTIMATE_TOLERANCE * estimate, (measured_deepspeed, estimate)
    from_measured = real_check(**{**planned, "deepspeed_bytes_per_step": measured_deepspeed})
    assert (warning is None) == (from_measured is None), (planned, measured_deepspeed)
    logged = [r for r in caplog.records if r.name == "tba" and "shared with DeepSpeed" in r.getMessage()]
    assert len(logged) == (warning is not None)
    if slow_disk:
        assert warning is not None, planned
        assert f"DeepSpeed an estimated {estimate / 1e6:.1f} MB" in logged[0].getMessage()
