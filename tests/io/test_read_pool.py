"""The read buffer pool: reuse by exact size, and large buffers on huge-page mappings (Note [Read
buffers on huge pages] in tba/io/_read_pool.py)."""

from __future__ import annotations

import gc
import mmap
import os
import signal
import threading
import time

import pytest
import torch

from tba import _control
from tba.defaults import ALIGN_BYTES, HUGE_PAGE_BYTES, MIB
from tba.io import BufferPool, Op, Request, ThreadEngine, _memory, _read_pool

SMAPS = "/proc/self/smaps"
needs_smaps = pytest.mark.skipif(not os.path.exists(SMAPS) or not hasattr(mmap, "MADV_HUGEPAGE"),
                                 reason="needs /proc/self/smaps and madvise(MADV_HUGEPAGE)")


def mapping_of(address: int) -> dict[str, str] | None:
    """The /proc/self/smaps fields of the mapping holding ``address``, or None."""
    found = None
    with open(SMAPS) as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                start, end = (int(part, 16) for part in head.split("-"))
                if found is not None:
                    break
                if start <= address < end:
                    found = {"range": head, "start": str(start), "end": str(end)}
            elif found is not None:
                key, _, value = line.partition(":")
                found[key] = value.strip()
    return found


@needs_smaps
def test_a_large_buffer_is_its_own_huge_page_mapping_and_goes_back_to_the_kernel():
    pool = BufferPool(0)  # keeps nothing idle: a given-back buffer is freed
    buffer = pool.take(4 * MIB)
    assert buffer.numel() == 4 * MIB and buffer.data_ptr() % ALIGN_BYTES == 0
    mapping = mapping_of(buffer.data_ptr())
    assert mapping is not None and "hg" in mapping["VmFlags"].split(), mapping  # madvise(MADV_HUGEPAGE)
    assert int(mapping["start"]) == buffer.data_ptr() and int(mapping["end"]) - int(mapping["start"]) >= 4 * MIB
    view = buffer[MIB:]
    del buffer
    gc.collect()
    assert mapping_of(view.data_ptr()) is not None  # a view keeps the mapping
    address = view.data_ptr()
    del view
    gc.collect()
    after = mapping_of(address)
    assert after is None or after["range"] != mapping["range"] or "hg" not in after["VmFlags"].split()


def test_only_buffers_of_a_huge_page_or_more_are_mapped(monkeypatch):
    mapped = []
    real = _read_pool.mapped_empty
    monkeypatch.setattr(_read_pool, "mapped_empty", lambda nbytes: mapped.append(nbytes) or real(nbytes))
    small = BufferPool(0).take(HUGE_PAGE_BYTES - ALIGN_BYTES)
    assert small.data_ptr() % ALIGN_BYTES == 0 and mapped == []
    BufferPool(0).take(HUGE_PAGE_BYTES)
    assert mapped == [HUGE_PAGE_BYTES]


def test_without_huge_pages_every_buffer_comes_from_malloc(monkeypatch):
    # Note [Reads reuse what kept layers free]: the plans that keep layers read into malloc's memory.
    mapped = []
    monkeypatch.setattr(_read_pool, "mapped_empty", lambda nbytes: mapped.append(nbytes))
    pool = BufferPool(0)
    pool.huge_pages = False
    buffer = pool.take(4 * HUGE_PAGE_BYTES)
    assert mapped == [] and buffer.numel() == 4 * HUGE_PAGE_BYTES and buffer.data_ptr() % ALIGN_BYTES == 0
    assert buffer._base is not None  # a view of a torch.empty block: malloc's memory


def test_buffers_are_reused_by_exact_size_up_to_the_budget():
    pool = BufferPool(8 * MIB)
    first = pool.take(4 * MIB)
    address = first.data_ptr()
    pool.give(first)
    del first
    assert pool.idle_bytes == 4 * MIB
    again = pool.take(4 * MIB)
    assert again.data_ptr() == address and pool.reused == 1 and pool.idle_bytes == 0
    other = pool.take(6 * MIB)  # another size: a new buffer
    pool.give(again)
    pool.give(other)  # 4 + 6 MiB exceed the 8 MiB budget: the second is not kept
    assert pool.idle_bytes == 4 * MIB and pool.allocated == 2


def test_a_leased_buffer_returns_when_its_last_view_dies():
    pool = BufferPool(8 * MIB)
    buffer = pool.take(4 * MIB)
    view = pool.lease(buffer, ALIGN_BYTES, MIB)
    del buffer
    assert pool.idle_bytes == 0
    del view
    gc.collect()
    _control.settle()
    assert pool.idle_bytes == 4 * MIB


def test_direct_read_into_a_huge_page_buffer_is_exact(tmp_path):
    nbytes = 6 * MIB
    payload = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    path = tmp_path / "data"
    path.write_bytes(payload.numpy().tobytes())
    flags = os.O_RDONLY | getattr(os, "O_DIRECT", 0)
    try:
        fd = os.open(path, flags)
    except OSError:  # a file system without O_DIRECT (tmpfs): a buffered read checks the same bytes
        fd = os.open(path, os.O_RDONLY)
    engine = ThreadEngine()
    try:
        buffer = BufferPool(0).take(nbytes)
        engine.submit_many([Request(Op.READ, fd, buffer.data_ptr(), nbytes, 0, buffer)])[0].result()
        assert torch.equal(buffer, payload)
    finally:
        engine.close()
        os.close(fd)


def test_a_kernel_without_huge_pages_leaves_ordinary_pages():
    class NoHugePages:
        def madvise(self, advice: int) -> None:
            raise OSError(22, "Invalid argument")  # what a kernel without CONFIG_TRANSPARENT_HUGEPAGE answers

    assert _memory.advise_huge_pages(NoHugePages()) is False
    region = mmap.mmap(-1, HUGE_PAGE_BYTES)
    assert _memory.advise_huge_pages(region) is hasattr(mmap, "MADV_HUGEPAGE")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_after_a_fork_the_parent_lets_go_of_its_idle_mapped_buffers():
    pool = BufferPool(64 * MIB)
    big, small = pool.take(4 * MIB), pool.take(MIB)
    pool.give(big)
    pool.give(small)
    assert pool.idle_bytes == 5 * MIB
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    assert pool.idle_bytes == MIB  # the mapped buffer went; the small one, from malloc, stays
    assert pool.take(MIB).data_ptr() == small.data_ptr()
    allocated = pool.allocated
    pool.take(4 * MIB)
    assert pool.allocated == allocated + 1  # a fresh mapping, not the copy-on-write one


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_pool_whose_lock_another_thread_held_at_a_fork_serves_the_child():
    """Buffers come back on the control thread (Note [Asynchronous exceptions]): a fork while it held the pool's lock
    left the child's first read of a reusable offloader waiting for ever (Note [A pool's lock held at a fork])."""
    pool = BufferPool(4 * MIB)
    pool.give(pool.take(MIB))
    held = threading.Event()

    def hold() -> None:  # for a while: the parent's own hook after the fork waits for the lock too
        with pool._lock:
            held.set()
            time.sleep(0.5)

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait()
    try:
        pid = os.fork()
        if pid == 0:
            code = 2
            try:
                signal.signal(signal.SIGALRM, signal.SIG_DFL)
                signal.alarm(10)  # ends the child: a wait that never ends
                buffer = pool.take(MIB)
                pool.give(buffer)
                code = 0 if buffer.numel() == MIB and pool.idle_bytes == MIB else 1
            finally:
                os._exit(code)
    finally:
        holder.join()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, f"the child's take() hung or miscounted ({status})"
