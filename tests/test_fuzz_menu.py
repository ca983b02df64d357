"""The fuzzer's menu (``tba/bench/_fuzz_case.py``): older seeds draw what they drew, and the newer draws are live.

New parts of a case are drawn after every older field (a printed reproducer keeps working); the ops of
``tba/bench/_fuzz_ops.py`` and the step modes of ``tba/bench/_fuzz_steps.py`` must reach the training loop.
"""

from __future__ import annotations

import dataclasses
import hashlib

import torch

from tba.bench import _fuzz_parts
from tba.bench.fuzz import draw_case, run_case

OLDER_FIELDS = ("seed", "blocks", "width", "batch", "dtype", "source", "placement", "backend", "min_offload_bytes",
                "shared_weight", "events", "batches", "plans_in_turn", "retained", "late_writes", "states", "outside_norm",
                "functions", "hooks", "extra", "checkpoints", "autocast", "shared_noise")
"""The fields of a case before ``ops``, ``calls`` and ``modes`` were drawn (a new field is not added here)."""
OLDER_DIGEST = "75788035b87bef5ac54b31952b2bb04c81b1225c6388ffe4877e900d1fdaccfd"
"""sha256 of those fields' reprs for seeds 0-299, as drawn before ``ops``, ``calls`` and ``modes`` existed."""


def test_older_fields_draw_what_they_drew():
    text = "\n".join(repr([getattr(draw_case(seed), field) for field in OLDER_FIELDS]) for seed in range(300))
    assert hashlib.sha256(text.encode()).hexdigest() == OLDER_DIGEST


def test_the_fuzzer_sees_an_index_tensor_read_back_wrong(monkeypatch):
    """The "ops" draw is live: a tba that gives back zeros for every int64 saved tensor is caught by a case whose
    blocks max-pool (saving indices); the same case without its ops saves no int64 tensor and is not."""
    import tba

    original = tba.Offloader.unpack

    def unpack(self, packed):
        tensor = original(self, packed)
        return torch.zeros_like(tensor) if tensor.dtype == torch.int64 else tensor

    monkeypatch.setattr(tba.Offloader, "unpack", unpack)
    case = draw_case(35)
    assert "conv_pool" in case.ops
    assert run_case(case)
    assert not run_case(dataclasses.replace(case, ops=()))


def _forwards(monkeypatch) -> list[tuple[bool, bool]]:
    """Per call of the fuzzer's model, whether grad and inference mode were enabled."""
    calls = []
    original = _fuzz_parts.Stack.forward

    def forward(self, *args, **kwargs):
        calls.append((torch.is_grad_enabled(), torch.is_inference_mode_enabled()))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(_fuzz_parts.Stack, "forward", forward)
    return calls


def test_evaluation_forwards_and_accumulation_run(monkeypatch):
    """Case 21: a step, a raised step with an inference-mode forward, a step after a no-grad forward; case 8: a
    raised step, then one that accumulates two forwards. Each runs with and without tba."""
    calls = _forwards(monkeypatch)
    assert draw_case(21).modes == ("", "inference", "no_grad")
    assert not run_case(draw_case(21))
    assert [calls.count(kind) for kind in ((True, False), (False, True), (False, False))] == [6, 2, 2]
    calls.clear()
    assert draw_case(8).modes[1] == "accumulate" and draw_case(8).events == ("raise", "step")
    assert not run_case(draw_case(8))
    assert calls == [(True, False)] * 6


def test_a_double_step_takes_a_gradient_of_a_gradient(monkeypatch):
    """Case 172 (two of its blocks recomputed, one with its input offloaded): one step with a gradient penalty."""
    created = []
    original = torch.autograd.grad
    monkeypatch.setattr(torch.autograd, "grad",
                        lambda *a, **k: created.append(k.get("create_graph")) or original(*a, **k))
    case = draw_case(172)
    assert case.modes == ("double",) and "recompute" in case.placement
    assert not run_case(case)
    assert created == [True, True]
