"""A recomputed layer runs under the process-wide settings its first call ran under (Note [A recomputation runs under
the first call's global settings] in tba/runtime/_global_settings.py): a forward or backward run inside
``torch.backends.mkldnn.flags(enabled=False)`` got gradients 1e-4 apart from training without tba, silently, and one
inside ``sdpa_kernel(SDPBackend.MATH)`` failed in backward with torch's checkpoint error."""

from __future__ import annotations

import contextlib
import importlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import tba
from tba.runtime import _global_settings
from tba.runtime._global_settings import settings_now, switch_to


class ConvBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Conv2d(8, 8, 3, padding=1)
        self.second = nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.second(torch.tanh(self.first(x)))


class AttentionBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(32, 96)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(2, 64, 3, 4, 8).permute(2, 0, 3, 1, 4)
        return x + F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(2, 64, 32)


class MatmulBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(256, 256)  # as large as oneDNN takes a float32 matmul in bf16 here
        self.second = nn.Linear(256, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.second(torch.tanh(self.first(x)))


@contextlib.contextmanager
def _fp32_precision(backend: str, value: str):
    """``torch.backends.<backend>.matmul.fp32_precision`` set, the API torch's docs recommend since 2.9 (the legacy
    getters then refuse to read TF32: 'mix of the legacy and new APIs'); bf16 on oneDNN runs float32 matmuls in bf16
    on a CPU with AVX512-BF16."""
    matmul = getattr(torch.backends, backend).matmul
    before = matmul.fp32_precision
    matmul.fp32_precision = value
    try:
        yield
    finally:
        matmul.fp32_precision = before


CASES = {
    "mkldnn-off-in-forward": (ConvBlock, (4, 8, 16, 16), lambda: torch.backends.mkldnn.flags(enabled=False), None),
    "mkldnn-off-in-backward": (ConvBlock, (4, 8, 16, 16), None, lambda: torch.backends.mkldnn.flags(enabled=False)),
    "math-attention-in-forward": (AttentionBlock, (2, 64, 32), lambda: sdpa_kernel(SDPBackend.MATH), None),
    "new-api-tf32-in-forward": (MatmulBlock, (64, 256), lambda: _fp32_precision("cuda", "tf32"), None),
    "mkldnn-bf16-in-forward": (MatmulBlock, (64, 256), lambda: _fp32_precision("mkldnn", "bf16"), None),
    "mkldnn-bf16-in-backward": (MatmulBlock, (64, 256), None, lambda: _fp32_precision("mkldnn", "bf16")),
}
NEW_API = {"new-api-tf32-in-forward", "mkldnn-bf16-in-forward", "mkldnn-bf16-in-backward"}


def _grads(directory, case: str, decision: str | None) -> list[torch.Tensor]:
    make, shape, around_forward, around_backward = CASES[case]
    torch.manual_seed(0)
    model = nn.Sequential(make(), make())
    x = torch.randn(*shape, requires_grad=True)
    offload = contextlib.nullcontext() if decision is None else tba.offload_activations(
        directory, layers=list(model), policy=tba.Plan((decision,) * 2, window_bytes=1 << 20), min_offload_bytes=0)
    with offload, around_forward() if around_forward else contextlib.nullcontext():
        loss = model(x).pow(2).sum()
    with around_backward() if around_backward else contextlib.nullcontext():
        loss.backward()
    return [x.grad, *(p.grad for p in model.parameters())]


@pytest.mark.parametrize("decision", ["recompute", "offloaded_recompute"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_recomputation_runs_under_the_first_calls_settings(spill_dir, case, decision):
    """The new-API cases: Note [Two APIs for one float32 precision] in tba/runtime/_global_settings.py (the first
    raised torch's 'mix of the legacy and new APIs' RuntimeError at the first call, the second's gradients differed)."""
    if case in NEW_API and not hasattr(torch._C, "_get_fp32_precision_getter"):
        pytest.skip("this torch has no fp32_precision API")
    before = settings_now()
    want = _grads(None, case, None)
    got = _grads(spill_dir, case, decision)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), "gradients differ: recomputed under other settings"
    assert settings_now() == before


def test_switch_to_sets_what_differs_and_back():
    before = settings_now()
    with torch.backends.mkldnn.flags(enabled=not before[1]), sdpa_kernel(SDPBackend.MATH):
        inside = settings_now()
    assert inside != before
    switch_to(inside)
    try:
        assert settings_now() == inside
    finally:
        switch_to(before)
    assert settings_now() == before
    switch_to(())  # a first call that never started: nothing to set
    assert settings_now() == before


def test_a_setting_this_torch_lacks_is_left_out(monkeypatch):
    """Note [Settings this torch does not have are not replayed] in tba/runtime/_global_settings.py."""
    full = len(_global_settings._SETTINGS)
    monkeypatch.delattr(torch._C, "_get_sdp_priority_order")
    monkeypatch.delattr(torch._C, "_get_cudnn_sdp_enabled")
    try:
        module = importlib.reload(_global_settings)
        assert "cudnn" not in module._SDPA_PRESENT and len(module._SETTINGS) == full - 1
        module.switch_to(module.settings_now())
    finally:
        monkeypatch.undo()
        importlib.reload(_global_settings)
    assert len(_global_settings._SETTINGS) == full


def test_a_precision_pair_refused_in_another_way_is_left_out(monkeypatch):
    """Note [Settings this torch does not have are not replayed]: a torch telling a (backend, op) pair it lacks with
    another exception than RuntimeError must not make ``import tba`` fail."""
    if not hasattr(torch._C, "_get_fp32_precision_getter"):
        pytest.skip("this torch has no fp32_precision API")
    real = torch._C._get_fp32_precision_getter

    def getter(backend: str, op: str) -> str:
        if backend == "mkldnn" and op == "rnn":
            raise ValueError("unknown op")
        return real(backend, op)

    monkeypatch.setattr(torch._C, "_get_fp32_precision_getter", getter)
    try:
        module = importlib.reload(_global_settings)
        assert ("mkldnn", "rnn") not in module._PRECISION_PAIRS and ("mkldnn", "matmul") in module._PRECISION_PAIRS
    finally:
        monkeypatch.undo()
        importlib.reload(_global_settings)
