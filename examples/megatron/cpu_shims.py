"""Run megatron-core on a CPU-only machine, for tests and ``pretrain_gpt.py --cpu``.

megatron-core builds a GPTModel on CPU once a process group exists (gloo, world size 1),
``initialize_model_parallel(1, 1)`` has run and the config has ``use_cpu_initialization=True``.
Its forward and its recompute still reach for CUDA in three places, each replaced here for the
duration of :func:`cpu_megatron` and restored on exit:

1. The global memory buffer (``parallel_state._GLOBAL_MEMORY_BUFFER``), used by unfused attention
   for its ``baddbmm`` output, allocates on ``torch.cuda.current_device()``. It is swapped for a
   :class:`CpuMemoryBuffer` that allocates on the CPU and otherwise behaves the same.
2. The model-parallel RNG tracker forks CUDA generator states around dropout. It is re-created
   with ``initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)``, whose ``fork``
   does nothing: dropout draws from the CPU generator, seeded by the caller.
3. Recompute (``CheckpointFunction``) saves and restores the CUDA generator state next to the CPU
   one. ``_get_cuda_rng_state`` / ``_set_cuda_rng_state`` in ``megatron.core.tensor_parallel.random``
   become no-ops on an empty state; the CPU state, which is the one dropout uses here, is still
   saved and restored by Megatron, so recomputed dropout masks match.

Megatron's default causal mask is also built on CUDA, so callers pass an explicit attention mask
(:func:`causal_mask`). None of this is part of the tba library, which never patches Megatron.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist


def causal_mask(seq_len: int, device: str | torch.device = "cpu") -> torch.Tensor:
    """Megatron's attention mask for causal attention: True where attention is not allowed, [1, 1, s, s]."""
    return torch.ones(1, 1, seq_len, seq_len, dtype=torch.bool, device=device).triu(diagonal=1)


def _cpu_memory_buffer_type() -> type:
    from megatron.core.utils import GlobalMemoryBuffer

    class CpuMemoryBuffer(GlobalMemoryBuffer):
        """Megatron's global memory buffer, allocating on the CPU."""

        def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context: Callable | None = None):
            numel = math.prod(tensor_shape)
            held = self.buffer.get((name, dtype))
            if held is None or held.numel() < numel:
                with (mem_alloc_context or contextlib.nullcontext)():
                    held = self.buffer[(name, dtype)] = torch.empty(numel, dtype=dtype)
            return held[:numel].view(*tensor_shape)

    return CpuMemoryBuffer


def _no_cuda_rng_state(*args, **kwargs) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8)


def _ignore_cuda_rng_state(*args, **kwargs) -> None:
    return None


@contextlib.contextmanager
def cpu_megatron() -> Iterator[None]:
    """A single-process megatron-core world on the CPU, with the stand-ins described above.

    Creates a gloo process group (world size 1) unless one exists, initializes model parallelism
    with tensor and pipeline size 1, installs the stand-ins, and undoes all of it on exit.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mp_random

    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    saved = {
        "tracker": (mp_random._CUDA_RNG_STATE_TRACKER, mp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED),
        "get": mp_random._get_cuda_rng_state,
        "set": mp_random._set_cuda_rng_state,
    }
    try:
        parallel_state.initialize_model_parallel(1, 1)
        parallel_state._GLOBAL_MEMORY_BUFFER = _cpu_memory_buffer_type()()
        mp_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
        mp_random._get_cuda_rng_state = _no_cuda_rng_state
        mp_random._set_cuda_rng_state = _ignore_cuda_rng_state
        yield
    finally:
        mp_random._get_cuda_rng_state = saved["get"]
        mp_random._set_cuda_rng_state = saved["set"]
        mp_random._CUDA_RNG_STATE_TRACKER, mp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = saved["tracker"]
        parallel_state.destroy_model_parallel()
        if own_group:
            dist.destroy_process_group()
