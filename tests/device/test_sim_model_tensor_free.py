"""A model tensor (not from the simulated arena) freed while a copy of it is not ordered before the free.

On a GPU the model's activations come from the caching allocator: when the last reference dies, the
block goes back to its stream's pool and the next kernel there may overwrite it, whether or not a copy
on another stream already ran in wall-clock time. The simulator caught such a free only when the copy
had not yet run (a use after free), so the check depended on the scheduler's timing (Note [A freed model
tensor is the next kernel's] in ``tba/device/sim/_allocator.py``).
"""

from __future__ import annotations

import time

import torch

from tba.device.sim import simulate

NBYTES = 4096


def copy_on(sim, side, dst, src):
    """Copy ``src`` into ``dst`` on ``side``, after what the compute stream queued so far; the event after the copy."""
    ready = sim.Event()
    ready.record(sim.current_stream())
    side.wait_event(ready)
    with sim.stream(side):
        sim.copy_(dst, src)
        done = sim.Event()
        done.record(side)
    return done


def copy_then_free(synchronize: bool, record: bool = False) -> list[str]:
    with simulate(seed=0, lag_probability=0.0) as sim:
        side = sim.Stream()
        src = torch.full((NBYTES,), 7, dtype=torch.uint8)  # a model tensor, written on the compute stream
        out = sim.host_empty(NBYTES)
        done = copy_on(sim, side, out, src)
        deadline = time.monotonic() + 10
        while not sim.scheduler.idle() and time.monotonic() < deadline:
            time.sleep(0.001)  # the copy ran: only the host's ordering with it is missing
        time.sleep(0.01)
        if synchronize:
            done.synchronize()
        if record:
            sim.record_stream(src, side)
        del src
        problems = sim.problems()
        sim.synchronize()
        return problems


def test_a_model_tensor_freed_after_its_copy_ran_but_unordered_is_reported():
    problems = copy_then_free(synchronize=False)
    assert any("the free of a storage" in p for p in problems), problems


def test_a_model_tensor_freed_after_the_host_synchronized_with_its_copy_is_no_race():
    assert copy_then_free(synchronize=True) == []


def test_a_model_tensor_marked_with_record_stream_may_be_freed_before_its_copy_is_synchronized():
    """CUDA's allocator holds a block marked with ``record_stream`` until that stream passed the free."""
    assert copy_then_free(synchronize=False, record=True) == []


def unpin_during_copy(synchronize: bool) -> list[str]:
    with simulate(seed=0, lag_probability=0.0) as sim:
        side = sim.Stream()
        slab = torch.zeros(NBYTES, dtype=torch.uint8)
        sim.pin(slab)
        src = sim.empty(NBYTES)
        done = copy_on(sim, side, slab, src)
        if synchronize:
            done.synchronize()
        sim.unpin(slab)
        sim.synchronize()
        return sim.problems()


def test_unpinning_host_memory_a_copy_still_uses_is_reported():
    """``cudaHostUnregister`` is not documented to wait for the DMA into the range: a copy must be ordered before."""
    problems = unpin_during_copy(synchronize=False)
    assert any("unpinning" in p for p in problems), problems


def test_unpinning_after_the_copy_was_synchronized_is_no_race():
    assert unpin_during_copy(synchronize=True) == []
