"""Process-wide settings a recomputed layer's forward runs under, taken at its first call and put back for its recomputation.

Note: [A recomputation runs under the first call's global settings]
A recomputed layer runs its forward again in backward, under whatever process-wide settings hold then. Torch's
checkpoint replays autocast and the generators, not the rest: the default dtype (Note [A recomputation runs under
the first call's default dtype] in ``tba/runtime/_recompute.py``), the math backends (``torch.backends.mkldnn.flags``,
``torch.backends.cudnn.flags``, TF32 and the float32 matmul precision, deterministic algorithms) and the attention
kernels ``torch.nn.attention.sdpa_kernel`` allows. A program that runs its forward, or its backward, inside such a
context had the recomputation use other kernels: with ``mkldnn.flags(enabled=False)`` around forward (or backward),
a convolutional model recomputed under a pinned ``RR`` or ``SS`` plan got gradients 1e-4 apart from training
without tba, silently; with ``sdpa_kernel(SDPBackend.MATH)`` around forward, the recomputation ran CPU flash
attention and torch's checkpoint refused its saved tensors in backward (another shape), where the adaptive default
had planned the recomputation. Plain checkpoint does the same; tba recomputes where the program did not ask for
it. So the first call takes them (a dozen getters, 1.5 us per call of a recomputed layer), and
those that differ in backward are set around the recomputation, then set back to the program's. What a setting
does not cover (``torch.backends.opt_einsum``, the reduced-precision reductions of half-precision GEMMs) is not
replayed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

_C = torch._C


def _sdpa_enabled() -> tuple[bool, ...]:
    return (_C._get_flash_sdp_enabled(), _C._get_mem_efficient_sdp_enabled(), _C._get_math_sdp_enabled(),
            _C._get_cudnn_sdp_enabled(), _C._get_overrideable_sdp_enabled())


def _set_sdpa_enabled(enabled: tuple[bool, ...]) -> None:
    flash, efficient, math, cudnn, overrideable = enabled
    _C._set_sdp_use_flash(flash)
    _C._set_sdp_use_mem_efficient(efficient)
    _C._set_sdp_use_math(math)
    _C._set_sdp_use_cudnn(cudnn)
    _C._set_sdp_use_overrideable(overrideable)


def _deterministic() -> tuple[bool, bool]:
    return _C._get_deterministic_algorithms(), _C._get_deterministic_algorithms_warn_only()


def _set_deterministic(mode: tuple[bool, bool]) -> None:
    torch.use_deterministic_algorithms(mode[0], warn_only=mode[1])


_SETTINGS: tuple[tuple[Callable[[], Any], Callable[[Any], None]], ...] = (
    (torch.get_default_dtype, torch.set_default_dtype),
    (_C._get_mkldnn_enabled, _C._set_mkldnn_enabled),
    (_C._get_mkldnn_deterministic, _C._set_mkldnn_deterministic),
    (_C._get_cudnn_enabled, _C._set_cudnn_enabled),
    (_C._get_cudnn_benchmark, _C._set_cudnn_benchmark),
    (_C._get_cudnn_deterministic, _C._set_cudnn_deterministic),
    (_C._get_cudnn_allow_tf32, _C._set_cudnn_allow_tf32),
    (_C._get_cublas_allow_tf32, _C._set_cublas_allow_tf32),
    (torch.get_float32_matmul_precision, torch.set_float32_matmul_precision),
    (_deterministic, _set_deterministic),
    (_sdpa_enabled, _set_sdpa_enabled),
    (_C._get_sdp_priority_order, _C._set_sdp_priority_order),
)
"""``(getter, setter)`` of each setting, in the order they are set (TF32 before the matmul precision it implies)."""


def settings_now() -> tuple[Any, ...]:
    """The value of each setting now."""
    return tuple(get() for get, _ in _SETTINGS)


def switch_to(settings: tuple[Any, ...], current: tuple[Any, ...]) -> None:
    """Set each setting whose value in ``settings`` differs from ``current`` (its value now). An empty ``settings``
    (a first call that never started) sets nothing."""
    for (_, set_value), want, now in zip(_SETTINGS, settings, current):
        if want != now:
            set_value(want)
