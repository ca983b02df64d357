"""The simulated caching allocator frees as CUDA's does: what is safe on a GPU passes, what races is reported.

A tensor whose last reference dies while a copy on its allocation stream is still queued is safe on a
GPU: the block goes back to that stream's pool, and whatever gets it next is queued there behind the
copy. A tensor used on another stream and marked with ``record_stream`` is safe too: the allocator
holds its block until that stream passed the point of the free. The simulator reported both as a use
after free and dropped the copy (its destination kept stale bytes), so tba could not rely on either;
only the unmarked use on another stream is a race (Note [A freed block's pending copies] in
``tba/device/sim/_allocator.py``).
"""

from __future__ import annotations

import time

import torch

from tba.device.sim import simulate
from tba.device.sim._streams import Token

NBYTES = 4096


def gate(sim, stream):
    """Hold ``stream`` at this point until the returned token is fired."""
    token = Token(sim.scheduler, None)
    sim.scheduler.launch(stream, token)
    return token


def copy_out_then_free(record: bool):
    """A side-stream copy of a compute-stream tensor, the tensor dropped while the copy waits; returns
    (what the copy brought, the problems)."""
    with simulate(seed=0) as sim:
        side = sim.Stream()
        src = sim.empty(NBYTES)
        src.fill_(7)
        out = torch.zeros(NBYTES, dtype=torch.uint8)
        ready = sim.Event()
        ready.record(sim.current_stream())
        side.wait_event(ready)
        held = gate(sim, side)
        with sim.stream(side):
            sim.copy_(out, src)
        if record:
            sim.record_stream(src, side)
        del src
        sim.empty(NBYTES).fill_(2)  # the next allocation on the compute stream, and its kernel
        held.fire()
        sim.synchronize()
        return out, sim.problems()


def test_a_block_marked_with_record_stream_serves_the_pending_copy():
    out, problems = copy_out_then_free(record=True)
    assert problems == []
    assert torch.equal(out, torch.full((NBYTES,), 7, dtype=torch.uint8))


def test_a_freed_block_used_on_another_stream_without_record_stream_is_reported():
    _, problems = copy_out_then_free(record=False)
    assert any("not ordered after copy" in p for p in problems), problems


def test_a_copy_queued_on_the_allocation_stream_may_outlive_its_destination():
    with simulate(seed=0) as sim:
        side = sim.Stream()
        source = torch.full((NBYTES,), 5, dtype=torch.uint8)
        written = sim.Event()
        written.record(sim.current_stream())
        side.wait_event(written)
        with sim.stream(side):
            dst = sim.empty(NBYTES)
        held = gate(sim, side)
        with sim.stream(side):
            sim.copy_(dst, source)
        del dst
        with sim.stream(side):
            again = sim.empty(NBYTES)  # the same block, behind the copy and the allocator's poison on side
        with sim.stream(side):
            sim.copy_(again, source)
        held.fire()
        sim.synchronize()
        assert sim.problems() == []
        assert torch.equal(again, source)


def test_a_tensor_dying_while_another_thread_holds_the_allocator_waits_for_nothing():
    """Note [A device tensor's death takes no lock] in tba/device/sim/_allocator.py: its finalizer took the allocator's
    lock, so a tensor freed by the cycle collector on the scheduler thread, inside the scheduler's lock, waited for a
    thread holding the allocator's lock that was launching the next poison, which waits for the scheduler's lock: a
    deadlock (a CI run hung ten minutes in tests/device/test_sim_faults.py, whose failed backward leaves read buffers
    in traceback cycles). Here another thread holds the allocator's lock while the last reference dies."""
    import threading

    with simulate(seed=0) as sim:
        box = [sim.empty(NBYTES)]
        holding, let_go = threading.Event(), threading.Event()

        def hold():
            with sim.allocator._lock:
                holding.set()
                let_go.wait(30)

        holder = threading.Thread(target=hold)
        holder.start()
        holding.wait(10)
        dropper = threading.Thread(target=box.clear)
        dropper.start()
        dropper.join(5)
        waited = dropper.is_alive()
        let_go.set()
        holder.join(30)
        dropper.join(30)
        assert not waited, "the tensor's death waited for the allocator's lock"
        assert sim.memory_stats()["allocated_bytes"] == 0  # counted once the allocator is next used
        again = sim.empty(NBYTES)  # the freed block serves the next request of its size and stream
        assert sim.allocator.reserved_bytes == again.numel() and sim.problems() == []


def test_a_block_freed_before_a_synchronize_is_ordered_before_the_host():
    """Note [A device tensor's death takes no lock]: the block of a tensor that died is given back at the next call.
    The synchronize's event took its clock before that call gave the block back, so the poison was not covered by
    it: a host write into the block's next allocation after a full synchronize, safe on a GPU, was reported."""
    with simulate(seed=0) as sim:
        first = sim.empty(NBYTES)
        first.fill_(1)
        del first
        sim.synchronize()
        again = sim.empty(NBYTES)
        sim.host_access(again.data_ptr(), NBYTES, True, "a host write after a synchronize")
        sim.synchronize()
        assert sim.problems() == []


def test_a_race_with_the_poison_is_reported_without_a_later_call():
    """A side-stream copy read a compute-stream tensor (no record_stream) and ran; the tensor died with the host not
    ordered after the copy: the block's next owner on the compute stream may overwrite it while the copy reads.
    ``problems()`` right after the death reports it (the queued block was given back only at the next CUDA call)."""
    out = torch.zeros(NBYTES, dtype=torch.uint8)
    with simulate(seed=0) as sim:
        side = sim.Stream()
        src = sim.empty(NBYTES)
        src.fill_(7)
        ready = sim.Event()
        ready.record(sim.current_stream())
        side.wait_event(ready)
        with sim.stream(side):
            sim.copy_(out, src)
        deadline = time.monotonic() + 30
        while (not sim.scheduler.idle() or sim.scheduler.running is not None) and time.monotonic() < deadline:
            time.sleep(0.005)  # the copy ran, and the host learned nothing of it
        del src
        problems = sim.problems()
    assert any("the next kernel on a freed block" in p and "not ordered after copy" in p for p in problems), problems
