"""CUDA tensors through the staged route and kvikio: exact gradients, no leaks, reads hidden.

Runs only where CUDA is available; everything here is skipped on CPU-only machines, where the
staged route's ordering is tested with a fake device instead (tests/device/test_staged.py).
"""

from __future__ import annotations

import gc
import os

import pytest
import torch
from model_cases import SharedStorage, ViewsModel
from torch import nn
from torch.nn import functional as F
from utils import assert_exact

import tba
from tba.bench.models import PRESETS, make_batch, make_gpt
from tba.device._router import kvikio_unavailable_reason

pytestmark = pytest.mark.requires_cuda

CUDA_BACKENDS = ["threads"] + (["kvikio"] if kvikio_unavailable_reason() is None else [])


@pytest.fixture(autouse=True)
def deterministic():
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(False)


def gpt_on_cuda(dtype: torch.dtype):
    config = PRESETS["tiny"]
    model = make_gpt(config).cuda().to(dtype)
    tokens, targets = (t.cuda() for t in make_batch(config))
    return model, lambda m: m(tokens, targets)


@pytest.mark.parametrize("backend", CUDA_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("flush", [True, False], ids=["written-first", "racing-writes"])
def test_gpt_exact(spill_dir, backend, dtype, flush):
    model, forward = gpt_on_cuda(dtype)
    offloader = assert_exact(model, forward, spill_dir, backend, layers=model, flush=flush)
    assert offloader.stats.tensors_offloaded > 10
    if flush:
        assert offloader.stats.bytes_read > 0


@pytest.mark.parametrize("backend", CUDA_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("make, shape", [(ViewsModel, (64, 48)), (SharedStorage, (32, 128))])
def test_views_and_shared_storages_exact(spill_dir, backend, dtype, make, shape):
    torch.manual_seed(0)
    model = make().cuda().to(dtype)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(3)).cuda().to(dtype)
    assert_exact(model, lambda m: m(x).float(), spill_dir, backend)


@pytest.mark.parametrize("backend", CUDA_BACKENDS)
def test_cnn_exact(spill_dir, backend):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10)).cuda()
    images = torch.randn(8, 3, 32, 32).cuda()
    labels = (torch.arange(8) % 10).cuda()
    assert_exact(model, lambda m: F.cross_entropy(m(images), labels), spill_dir, backend)


def _active_blocks() -> dict[tuple[int, int], list]:
    """(address, size) -> the allocation's Python frames, of every block allocated now (frames
    recorded only while ``torch.cuda.memory._record_memory_history`` runs)."""
    blocks = {}
    for segment in torch.cuda.memory._snapshot()["segments"]:
        for block in segment["blocks"]:
            if block["state"] == "active_allocated":
                blocks[(block["address"], block["size"])] = block.get("frames", [])
    return blocks


def _describe(blocks: dict[tuple[int, int], list], keys) -> str:
    lines = []
    for key in sorted(keys, key=lambda k: -k[1])[:24]:
        frames = [f"{f['filename'].rsplit('/', 1)[-1]}:{f.get('line', '?')} {f.get('name', '?')}"
                  for f in blocks[key] if f.get("filename", "").endswith(".py") and "/torch/" not in f["filename"]][:8]
        lines.append(f"  {key[1]} bytes at {key[0]:#x}: {' <- '.join(frames) or 'no Python frames'}")
    return "\n".join(lines)


def _owners(model: torch.nn.Module) -> dict[str, int]:
    """Name -> data_ptr of the model's parameters, their gradients and its buffers."""
    owners = {name: p.data_ptr() for name, p in model.named_parameters()}
    owners.update({f"{name}.grad": p.grad.data_ptr() for name, p in model.named_parameters() if p.grad is not None})
    owners.update({name: b.data_ptr() for name, b in model.named_buffers()})
    return owners


@pytest.mark.parametrize("backend", CUDA_BACKENDS)
def test_no_leak_over_twenty_steps(spill_dir, backend):
    # With TBA_TEST_MEMORY_HISTORY=1 the allocations' stacks go into the failure message. Off by default:
    # on torch 2.11 (H200) recording the history breaks non-reentrant checkpoint on CUDA, without tba too
    # (docs/gpu.md, the third run).
    try:
        if os.environ.get("TBA_TEST_MEMORY_HISTORY") == "1":
            torch.cuda.memory._record_memory_history(max_entries=100_000)
    except (AttributeError, RuntimeError, TypeError):
        pass
    model, forward = gpt_on_cuda(torch.float32)
    # Note: [Torch's per-thread state for a recomputed forward]
    # Torch makes per-thread state the first time a forward operator runs on autograd's device thread
    # and keeps it (a cuBLASLt workspace of 1 MiB on an H200: docs/gpu.md, "The fifth run"). A layer a
    # plan recomputes runs its forward there, first in the step the plan starts, and this test then saw
    # memory grow by that 1 MiB at step 2 on both routes. One step of torch's own checkpoint, without
    # tba, makes that state before any step is compared: without its early stop, which fails every step
    # under TORCH_CUDA_SANITIZER on torch 2.11 without tba (docs/gpu.md, the fourth and sixth runs).
    with torch.utils.checkpoint.set_checkpoint_early_stop(False):
        torch.utils.checkpoint.checkpoint(forward, model, use_reentrant=False).backward()
    plans = []
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    offloader = tba.Offloader(spill_dir, backend=backend, layers=model, min_offload_bytes=0)
    baseline = None
    try:
        for step in range(20):
            optimizer.zero_grad(set_to_none=False)
            with offloader:
                loss = forward(model)
            loss.backward()
            optimizer.step()
            del loss
            offloader.flush()  # read buffers whose tensors died are given back on tba's control thread
            # Garbage in reference cycles outside tba (an earlier test's optimizer and model, frames torch
            # keeps in a cycle at its first import of torch._dynamo) holds device memory until a collection,
            # which lands at any step; what tba itself holds is reachable, and counted.
            gc.collect()
            torch.cuda.synchronize()
            plans.append(offloader.plan.code if offloader.plan is not None else None)
            if step == 1:
                baseline, baseline_blocks = torch.cuda.memory_allocated(), _active_blocks()
                baseline_owners = _owners(model)
            elif step > 1 and torch.cuda.memory_allocated() != baseline:
                now, owners = _active_blocks(), _owners(model)
                gone = baseline_blocks.keys() - now.keys()
                moved = {name: (address, owners.get(name)) for name, address in baseline_owners.items()
                         if owners.get(name) != address}
                pytest.fail(f"GPU memory changed at step {step} (plans by step {plans}): {torch.cuda.memory_allocated()} "
                            f"bytes against {baseline} at step 1\nallocated at step 1 only:\n"
                            f"{_describe(baseline_blocks, gone)}\n"
                            f"allocated at step {step} only:\n{_describe(now, now.keys() - baseline_blocks.keys())}\n"
                            f"model tensors whose address changed since step 1 (name: then, now): {moved}")
    finally:
        try:
            torch.cuda.memory._record_memory_history(enabled=None)
        except (AttributeError, RuntimeError, TypeError):
            pass
    assert offloader.stats.resident_bytes == 0
    assert offloader.stats.staging_blocks_in_use == 0, "a pinned staging block was not returned"
    offloader.close()


def test_prefetch_serves_most_unpacks_from_memory(spill_dir):
    config = PRESETS["small"]
    model = make_gpt(config).cuda()
    tokens, targets = (t.cuda() for t in make_batch(config))
    offloader = tba.offload_activations(spill_dir, layers=model)
    with offloader:
        loss = model(tokens, targets)
    offloader.flush()
    loss.backward()
    stats = offloader.stats
    assert stats.bytes_read > 0
    assert stats.unpacks_from_memory > stats.unpacks_waited


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_failed_page_lock_leaves_no_error_for_the_next_kernel():
    """Note [A failed page-lock leaves CUDA's last error set] in tba/device/_cuda.py."""
    from tba.device._cuda import TorchCuda

    cuda = TorchCuda()
    slab = torch.empty(1 << 20, dtype=torch.uint8)
    cuda.pin(slab)
    try:
        with pytest.raises(RuntimeError, match="cudaHostRegister"):
            cuda.pin(slab)  # registered already: cudaErrorHostMemoryAlreadyRegistered
        assert (torch.ones(4, device="cuda") * 2).sum().item() == 8  # raised the stale error before the fix
    finally:
        cuda.unpin(slab)
