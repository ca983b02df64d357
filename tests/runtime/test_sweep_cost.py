"""Each save and unpack costs O(1) in the storages the program still holds (issue 21, item 10; issue 25).

A program that keeps its saved outputs (a list of per-sample results) left every written storage
"lingering" (tba may not discard pages the program still uses), and every save and unpack re-checked
all of them: quadratic in the tensors of a step (100,000 storages: 39.5 s of backward against 3.2 s).
The test counts the ownership checks, not time.

Note: [Counting the checks of one run, whatever the machine's speed]
The count used to depend on timing twice over. A view's death reaches tba through a finalizer that the
control thread runs a little later (``tba._control.on_death``): read right after backward, the count
of the 100-tensor run missed some of its own ``drop_view`` sweeps, and the 800-tensor run counted them
instead; and how many storages lingered at each save depended on how many writes had finished by then.
On a loaded machine (two pytest-xdist workers on two cores) that gave 4.7 checks per tensor at 100
against 9.1 at 800, and the growth check failed (once in three runs of tests/runtime with -n 2 beside
another such run). Now each save waits for its write (``flush``), so every storage lingers from the
next save on, the worst case this test is about, and ``settle`` runs the queued finalizers before the
count is read: 8.97 and 9.0 checks per tensor, run after run.
"""

from __future__ import annotations

import pytest
import torch

import tba
from tba import defaults
from tba._control import settle
from tba.runtime import _release
from tba.runtime._trim import hands_back_pages


def _checks_per_tensor(spill_dir, monkeypatch, count: int) -> float:
    calls = [0]
    original = _release.sole_owner

    def counting(ref):
        calls[0] += 1
        return original(ref)

    monkeypatch.setattr(_release, "sole_owner", counting)
    monkeypatch.setattr(defaults, "DISCARD_MIN_BYTES", 0)  # its 64 KiB storages would otherwise never be discarded
    leaves = [torch.randn(16384, requires_grad=True) for _ in range(count)]
    outs = []
    with tba.offload_activations(spill_dir, backend="threads") as off:
        for leaf in leaves:
            outs.append(torch.tanh(leaf))
            off.flush()  # Note [Counting the checks of one run, whatever the machine's speed]
    torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
    settle()  # the views' deaths, and the sweeps they make, are counted in this run
    for leaf in leaves[:3]:
        copy = leaf.detach().clone().requires_grad_(True)
        torch.tanh(copy).backward(torch.ones_like(copy))
        assert torch.equal(leaf.grad, copy.grad)
    return calls[0] / count


def test_ownership_checks_per_tensor_do_not_grow_with_the_tensors_held(spill_dir, monkeypatch):
    if not hands_back_pages():
        pytest.skip("a caching allocator: tba discards no pages, so nothing lingers")
    small = _checks_per_tensor(spill_dir, monkeypatch, 100)
    assert small >= 1, "no ownership check ran: the lingering path was not exercised"
    large = _checks_per_tensor(spill_dir, monkeypatch, 800)
    bound = 4 * 4 + 4  # save, unpack, view release: a few checks each (defaults.LINGER_SWEEP_PER_CALL = 2)
    assert large <= bound, f"{large:.1f} ownership checks per tensor at 800 tensors (bound {bound})"
    assert large <= 1.5 * small + 2, f"{small:.1f} per tensor at 100, {large:.1f} at 800: grows with the count"
