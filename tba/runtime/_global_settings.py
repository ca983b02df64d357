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


_SDPA_FLAGS = ("flash", "mem_efficient", "math", "cudnn", "overrideable")
"""The attention kernels ``sdpa_kernel`` switches, those this torch has (``_get_<name>_sdp_enabled``)."""
_SDPA_PRESENT = tuple(name for name in _SDPA_FLAGS
                      if hasattr(_C, f"_get_{name}_sdp_enabled") and hasattr(_C, f"_set_sdp_use_{name}"))


def _sdpa_enabled() -> tuple[bool, ...]:
    return tuple(getattr(_C, f"_get_{name}_sdp_enabled")() for name in _SDPA_PRESENT)


def _set_sdpa_enabled(enabled: tuple[bool, ...]) -> None:
    for name, value in zip(_SDPA_PRESENT, enabled):
        getattr(_C, f"_set_sdp_use_{name}")(value)


def _deterministic() -> tuple[bool, bool]:
    return _C._get_deterministic_algorithms(), _C._get_deterministic_algorithms_warn_only()


def _set_deterministic(mode: tuple[bool, bool]) -> None:
    torch.use_deterministic_algorithms(mode[0], warn_only=mode[1])


def _torch_pair(name: str) -> tuple[Callable[[], Any], Callable[[Any], None]] | None:
    """``torch._C``'s ``_get_<name>`` and ``_set_<name>``, or None where this torch lacks either.

    Note: [Settings this torch does not have are not replayed]
    These are torch's private bindings, and the device machines run other torch versions than the CPU
    wheel pinned here (2.11 on the H200 runs): a getter missing there made ``import tba`` fail. Each setting
    is taken only where both of its functions exist.
    """
    get, put = getattr(_C, f"_get_{name}", None), getattr(_C, f"_set_{name}", None)
    return (get, put) if get is not None and put is not None else None


_SETTINGS: tuple[tuple[Callable[[], Any], Callable[[Any], None]], ...] = tuple(pair for pair in (
    (torch.get_default_dtype, torch.set_default_dtype),
    _torch_pair("mkldnn_enabled"),
    _torch_pair("mkldnn_deterministic"),
    _torch_pair("cudnn_enabled"),
    _torch_pair("cudnn_benchmark"),
    _torch_pair("cudnn_deterministic"),
    _torch_pair("cudnn_allow_tf32"),
    _torch_pair("cublas_allow_tf32"),
    (torch.get_float32_matmul_precision, torch.set_float32_matmul_precision),
    (_deterministic, _set_deterministic) if _torch_pair("deterministic_algorithms") else None,
    (_sdpa_enabled, _set_sdpa_enabled),
    _torch_pair("sdp_priority_order"),
) if pair is not None)
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
