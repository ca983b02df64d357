"""The race checker keeps a write its own participant then read (Note [A read keeps the write it follows]).

A deliberately racy variant of tba's device path, a side stream that copies saved tensors out without
waiting for their producers' events, must be reported: on a GPU the copy may read before the kernel
that produced the tensor ran.
"""

from __future__ import annotations

import torch
from torch import nn
from utils import run_step, steps_equal

import tba
from tba.device import CudaOps
from tba.device.sim import simulate
from tba.device.sim._checker import HappensBefore


def test_a_read_by_the_producer_keeps_its_write_for_the_others():
    checker = HappensBefore()
    checker.access("compute", 0x1000, 64, True, "producer")
    checker.access("compute", 0x1000, 64, False, "consumer")
    checker.access("side", 0x1000, 64, False, "copy on side")
    assert len(checker.races) == 1 and "not ordered after producer" in checker.races[0], checker.races


def test_a_read_ordered_after_the_write_is_no_race():
    checker = HappensBefore()
    checker.access("compute", 0x1000, 64, True, "producer")
    checker.access("compute", 0x1000, 64, False, "consumer")
    checker.merge("side", checker.snapshot("compute"))
    checker.access("side", 0x1000, 64, False, "copy on side")
    assert checker.races == []


def _copies_without_waiting(self, stream, copies):
    """``CudaOps._queue_copies`` without ``stream.wait_event(after)``: racy on a GPU."""
    with self.cuda.stream(stream):
        for src, dst, _after in copies:
            self.cuda.copy_(dst, src)
        return self._event_after_copies(stream), len(copies), None


def test_a_side_copy_that_skips_the_producers_event_is_reported(tmp_path, monkeypatch):
    torch.manual_seed(0)
    # Every saved tensor is read by the compute stream after it was produced (linear -> gelu -> linear).
    net = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))
    x = torch.randn(32, 64)

    def forward(m):
        return m(x).sum()

    reference = run_step(net, forward)
    monkeypatch.setattr(CudaOps, "_queue_copies", _copies_without_waiting)
    with simulate(seed=1) as sim:
        offloader = tba.Offloader(tmp_path, min_offload_bytes=0, block_size_bytes=8192, staging_bytes=8 * 8192)
        try:
            for _ in range(2):
                assert steps_equal(reference, run_step(net, forward, offloader, flush=True))
        finally:
            offloader.close()
            tba.shutdown()
        assert any("is not ordered after aten::" in problem for problem in sim.problems()), sim.problems()
