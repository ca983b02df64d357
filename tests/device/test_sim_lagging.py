"""The simulated compute stream lags the host (Note [The compute stream lags too] in tba/device/sim/_device.py).

With a synchronous compute stream, memory freed on it had already met "the next kernel" when the
host got it back, so a writer outside stream order that skips waiting for its allocation's point on
the stream went unseen: ``CudaOps.empty_for_host`` without its ``synchronize()`` (kvikio then reads
into a block whose previous users may still be running) passed every kvikio test; on the lagging
compute stream the randomized kvikio steps failed with it in 3 runs of 4 (wrong gradients or the
race), and the test below fails every time.
"""

from __future__ import annotations

import ctypes
import threading

import torch

from tba.device import CudaOps
from tba.device.sim import simulate

NBYTES = 4096
WRITTEN = 7


def host_write_after_allocation(empty_for_host) -> torch.Tensor:
    """A block freed on the lagging compute stream, taken by ``empty_for_host`` and written by the host at once."""
    with simulate(seed=0) as sim:
        ops = CudaOps(torch.device("cpu"))
        try:
            sim.stall()  # the compute stream has not reached the free yet
            threading.Timer(0.3, sim.stall, args=(False,)).start()
            del_me = sim.empty(NBYTES)
            del del_me  # the allocator queues "the next kernel" on the freed block
            buffer = empty_for_host(ops, NBYTES, torch.device("cpu"))
            ctypes.memset(buffer.data_ptr(), WRITTEN, NBYTES)  # kvikio's DMA, outside stream order
            sim.synchronize()
            return bytes(memoryview(buffer.numpy()))
        finally:
            ops.close()


def test_a_host_writer_gets_a_block_whose_previous_users_are_done():
    assert host_write_after_allocation(CudaOps.empty_for_host) == bytes([WRITTEN]) * NBYTES


def test_a_host_writer_that_skips_the_allocation_wait_is_overwritten():
    def without_wait(ops, nbytes, device):
        return ops._allocate(nbytes, device)[0]

    assert host_write_after_allocation(without_wait) != bytes([WRITTEN]) * NBYTES


def test_a_step_run_on_another_thread_is_reported_not_passed_for_checked(tmp_path):
    """Note [Operators of another thread are not simulated] in tba/device/sim/_device.py.

    The compute-stream dispatch mode is the entering thread's: a step run in a worker thread read tba's read
    buffers before their queued copies ran (NaN or stale gradients, 4 runs in 10 of this one) with
    ``problems()`` empty.
    """
    import tba

    with simulate(seed=1) as sim:
        layer = torch.nn.Linear(128, 128)
        x = torch.randn(64, 128)

        def step():
            for _ in range(2):
                with tba.offload_activations(tmp_path, min_offload_bytes=0):
                    loss = layer(x).tanh().square().sum()
                loss.backward()

        worker = threading.Thread(target=step, name="user-worker")
        worker.start()
        worker.join()
        tba.shutdown()
    assert any("'user-worker'" in problem and "entered simulate()" in problem for problem in sim.problems()), sim.problems()
