"""Process-wide settings a recomputed layer's forward runs under, taken at its first call and put back for its recomputation.

Note: [A recomputation runs under the first call's global settings]
A recomputed layer runs its forward again in backward, under whatever process-wide settings hold then. Torch's
checkpoint replays autocast and the generators, not the rest: the default dtype (Note [A recomputation runs under
the first call's default dtype] in ``tba/runtime/_recompute.py``), the math backends (``torch.backends.mkldnn.flags``,
``torch.backends.cudnn.flags``, TF32 and the float32 matmul precision, with their ``fp32_precision`` per backend and
operation: Note [Two APIs for one float32 precision], deterministic algorithms) and the attention
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


MIXED = object()
"""What a legacy float32-precision getter reads while the ``fp32_precision`` API set another value
(Note [Two APIs for one float32 precision]); never set back."""


def _legacy(name: str) -> tuple[Callable[[], Any], Callable[[Any], None]] | None:
    """``_torch_pair(name)`` with a getter that reads :data:`MIXED` where torch refuses to read it.

    Note: [Two APIs for one float32 precision]
    Torch 2.9 added ``fp32_precision`` per backend and operation (``torch.backends.cuda.matmul.fp32_precision =
    "tf32"``, ``torch.backends.mkldnn.flags(fp32_precision="bf16")``, ``torch.backends.fp32_precision``), the API its
    docs now recommend, beside the legacy ``allow_tf32`` flags and ``set_float32_matmul_precision``. A legacy setter
    updates the new values too, but once the new API set a value the legacy one does not imply, the legacy getters raise
    RuntimeError ('you have used mix of the legacy and new APIs'): taken at every first call, they made every call of a
    recomputed layer fail in a program that set TF32 the recommended way, under a pinned plan or once the adaptive
    default planned a recomputation. Nor do the legacy values say what the kernels read of the new ones: with oneDNN's
    float32 matmuls in bf16 (``torch.backends.mkldnn.matmul.fp32_precision = "bf16"``, on a CPU with AVX512-BF16)
    around forward or backward alone, a recomputation replaying the legacy values only ran the other precision, its
    gradients silently other than training without tba. So a legacy getter that raises reads :data:`MIXED`, which is
    never set back, and the new values are taken as stored for each (backend, operation) this torch has, set after the
    legacy ones (which update them), in order (a backend's ``all`` sets its operations), each where it differs then.
    """
    pair = _torch_pair(name)
    if pair is None:
        return None
    get, put = pair

    def read() -> Any:
        try:
            return get()
        except RuntimeError:
            return MIXED

    return read, put


def _precision_pairs() -> tuple[tuple[str, str], ...]:
    """The (backend, operation) pairs whose ``fp32_precision`` this torch stores, the ``all`` of each backend first."""
    found = []
    if hasattr(_C, "_get_fp32_precision_getter") and hasattr(_C, "_set_fp32_precision_setter"):
        for backend in ("generic", "cuda", "mkldnn"):
            for op in ("all", "matmul", "conv", "rnn"):
                try:
                    _C._get_fp32_precision_getter(backend, op)
                except Exception:  # noqa: BLE001 - a pair this torch lacks ('Invalid (backend, op) pair'), however told
                    continue
                found.append((backend, op))
    return tuple(found)


_PRECISION_PAIRS = _precision_pairs()


def _precisions() -> tuple[str, ...]:
    return tuple(_C._get_fp32_precision_getter(backend, op) for backend, op in _PRECISION_PAIRS)


def _set_precisions(values: tuple[str, ...]) -> None:
    for (backend, op), value in zip(_PRECISION_PAIRS, values):
        if _C._get_fp32_precision_getter(backend, op) != value:  # read now: setting a backend's "all" sets the others
            _C._set_fp32_precision_setter(backend, op, value)


_SETTINGS: tuple[tuple[Callable[[], Any], Callable[[Any], None]], ...] = tuple(pair for pair in (
    (torch.get_default_dtype, torch.set_default_dtype),
    _torch_pair("mkldnn_enabled"),
    _torch_pair("mkldnn_deterministic"),
    _torch_pair("cudnn_enabled"),
    _torch_pair("cudnn_benchmark"),
    _torch_pair("cudnn_deterministic"),
    _legacy("cudnn_allow_tf32"),
    _legacy("cublas_allow_tf32"),
    _legacy("float32_matmul_precision"),
    (_deterministic, _set_deterministic) if _torch_pair("deterministic_algorithms") else None,
    (_sdpa_enabled, _set_sdpa_enabled),
    _torch_pair("sdp_priority_order"),
    (_precisions, _set_precisions) if _PRECISION_PAIRS else None,
) if pair is not None)
"""``(getter, setter)`` of each setting, in the order they are set (TF32 before the matmul precision it implies, both
before the ``fp32_precision`` values they update)."""


def settings_now() -> tuple[Any, ...]:
    """The value of each setting now."""
    return tuple(get() for get, _ in _SETTINGS)


def switch_to(settings: tuple[Any, ...]) -> None:
    """Set each setting whose value in ``settings`` differs from its value now, read right before (a setter may change
    a later setting: Note [Two APIs for one float32 precision]); one read as :data:`MIXED` is left as it is. An empty
    ``settings`` (a first call that never started) sets nothing."""
    for (get, set_value), want in zip(_SETTINGS, settings):
        if want is not MIXED and get() != want:
            set_value(want)
