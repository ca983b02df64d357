"""One Offloader entered from two threads at once: the second entry is refused with TbaError."""

from __future__ import annotations

import threading

import torch

import tba
from tba import TbaError


def test_second_concurrent_entry_is_refused(spill_dir, backend, open_fds):
    before = open_fds()
    x = torch.randn(64, 1024, requires_grad=True)
    (x * 2).sin().sum().backward()
    want = x.grad.clone()
    refused = 0
    for _ in range(5):
        off = tba.Offloader(spill_dir, backend=backend, min_offload_bytes=0)
        barrier = threading.Barrier(2)
        outcomes: list[object] = []

        def step(off: tba.Offloader = off, barrier: threading.Barrier = barrier,
                 outcomes: list[object] = outcomes) -> None:
            xs = x.detach().clone().requires_grad_(True)
            barrier.wait()
            try:
                with off:
                    loss = (xs * 2).sin().sum()
                loss.backward()
                outcomes.append(torch.equal(xs.grad, want))
            except TbaError as err:
                outcomes.append(err)

        threads = [threading.Thread(target=step) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        off.close()
        errors = [o for o in outcomes if isinstance(o, TbaError)]
        assert all("already entered" in str(e) for e in errors), outcomes
        assert len(errors) <= 1 and [o for o in outcomes if not isinstance(o, TbaError)] == [True] * (2 - len(errors))
        refused += len(errors)
    assert refused > 0, "the two threads never overlapped"
    assert open_fds() == before
