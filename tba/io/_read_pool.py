"""Reusable aligned read buffers.

Reading a storage back needs an aligned buffer of its size. A fresh buffer costs a page fault per
4 KiB the first time it is touched, which on small machines is slower than the disk itself. Layers
of one model save storages of the same sizes, so buffers freed by backward through layer ``i`` fit
the reads for layer ``i - 2``: this pool keeps freed buffers by exact size and hands them out again.

A buffer goes back to the pool when the last tensor that uses it dies: :meth:`BufferPool.lease`
wraps it in a storage whose owner is a token; the token's collection returns the buffer through a
finalizer run on the control thread (``_Returned``, made by :func:`tba._control.finalizer`), so no
Python code runs in the thread that drops the last tensor (Note [Asynchronous exceptions] in
``tba/_control.py``). The pool holds at most
``prefetch_budget_bytes`` of idle buffers (the prefetch budget, read from its one owner, the
offloader's prefetch window, each time a buffer comes back). A reusable offloader keeps them from one
step to the next, so steady-state steps touch no fresh memory for reads; they are freed on
``close()``, and ``Offloader.pool_idle_bytes`` reports them so that measurements count them as
memory tba holds.

Note: [Read buffers on huge pages]
A buffer of at least :data:`~tba.defaults.HUGE_PAGE_BYTES` is an anonymous mapping that asks for
transparent huge pages (:func:`tba.io._memory.mapped_empty`), not memory from malloc. An
``O_DIRECT`` request moves a list of physically contiguous segments, and block devices cap the
segments per request (virtio-blk: 254): on 4 KiB pages a 4 MiB read became five requests, on
2 MiB pages it is one. On the 2-core VM, where one kernel worker dispatches every request, that
worker preempted the training threads about 2,500 times per step of the ``bench`` preset; with
these buffers the training threads were preempted 2,560-2,760 times per offloaded step instead of
4,050-4,410, and the step took 1.05-1.06x keep-all's instead of 1.06-1.08x (jemalloc, alternating
steps in one process). Malloc could not give this: under a caching allocator the kernel only backs
``madvise``-d ranges with huge pages. A mapping's pages go back to the kernel as soon as its last
view dies, so a buffer the pool does not keep never lingers in the allocator's free lists.

Note: [Reads reuse what kept layers free]
A mapping never reuses memory malloc holds. Under a plan that keeps or recomputes layers, backward
first frees the kept layers' activations (or a recomputation's), and the reads of the offloaded
layers below come after: a caching allocator (tcmalloc, jemalloc) keeps the freed memory for its
next allocations, so reads into fresh mappings came on top of it. A pinned ``OKK`` plan on a
3-layer test model peaked at keep-all's 32.0 MiB in 12 of 12 steps under tcmalloc (its reads, 8 MiB,
allocated above memory backward had just freed), where the planner predicted 28.6 MiB for it from a
model that assumes reads fit into freed memory: a budget of 28.8 MiB was missed now and then
(``tests/cli/test_rok.py``, helper-42). So a pool whose ``huge_pages`` is off takes every buffer
from malloc (:func:`~tba.io._memory.aligned_empty`), which hands such plans' reads the blocks the
kept layers freed. The offloader turns it off for the steps of such plans
(``StepPlacement.release_idle_reads``, Note [Idle read buffers and kept layers] in
``tba/policy/_memory.py``); plans that offload every layer keep huge pages, and reuse their buffers
from step to step. Measured under tcmalloc (the ``small`` GPT, pinned ``OOKKKK``: 56-57 MiB above a
warm process before, 22-25 after); under jemalloc (``dirty_decay_ms:-1``) the same probe gave 107 MiB
either way, for a reason not yet known.

Note: [Huge pages do not survive a fork]
``fork()`` makes every private page copy-on-write, huge ones included. The parent's next
``O_DIRECT`` read into a shared huge page breaks the sharing 4 KiB at a time, and the buffer stays
on small pages after the child is gone (measured: 4096 kB of huge pages before a fork, 0 after a
read, 0 once the child had exited). A ``DataLoader`` with workers forks every epoch. So after a
fork the parent's pools let go of their idle mapped buffers (:func:`_after_fork_in_parent`), and
the next reads get fresh ones; buffers in use are left alone, whatever pages they are on.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

import torch

from tba._control import Finalizer, finalizer
from tba._untrack import untrack
from tba._weak import WeakRegistry
from tba.defaults import HUGE_PAGE_BYTES
from tba.io._memory import aligned_empty, mapped_empty, storage_view


class _Token:
    """Lives exactly as long as the storage of one lease."""

    __slots__ = ("__weakref__",)


class _Returned(Finalizer):
    """Gives a lease's buffer back to its pool once the lease's token died (:meth:`BufferPool.lease`).

    Its own slots instead of :func:`tba._control.on_death`'s arguments tuple, as a view's finalizer
    (``_ViewDied`` in ``tba/runtime/_hooks.py``): one object and one call fewer per read back.
    """

    __slots__ = ("pool", "buffer")

    def fire(self) -> None:
        self.pool.give(self.buffer)


class BufferPool:
    """Aligned ``uint8`` CPU buffers, reused by exact size.

    Args:
        prefetch_budget_bytes: Most bytes of idle buffers kept; more are freed. 0 disables reuse.
            A callable is asked each time (the prefetch window's budget, which changes).
    """

    def __init__(self, prefetch_budget_bytes: int | Callable[[], int]) -> None:
        self.prefetch_budget_bytes = prefetch_budget_bytes
        self.huge_pages = True
        """New buffers from :data:`~tba.defaults.HUGE_PAGE_BYTES` up are mappings on huge pages; False: every
        new buffer comes from malloc (Note [Reads reuse what kept layers free])."""
        self.idle_bytes = 0
        self.reused = 0
        self.allocated = 0
        self._idle: dict[int, list[torch.Tensor]] = {}
        self._lock = threading.Lock()
        _pools.add(self)

    def take(self, nbytes: int) -> torch.Tensor:
        """An aligned buffer of ``nbytes``: an idle one of that size, else a new one (on huge pages from
        :data:`~tba.defaults.HUGE_PAGE_BYTES` up while :attr:`huge_pages`, Note [Read buffers on huge pages])."""
        with self._lock:
            idle = self._idle.get(nbytes)
            if idle:
                self.idle_bytes -= nbytes
                self.reused += 1
                return idle.pop()
            self.allocated += 1
        return mapped_empty(nbytes) if self.huge_pages and nbytes >= HUGE_PAGE_BYTES else aligned_empty(nbytes)

    @property
    def capacity_bytes(self) -> int:
        """Most bytes of idle buffers kept now."""
        budget = self.prefetch_budget_bytes
        return budget() if callable(budget) else budget

    def trim(self) -> None:
        """Free every idle buffer when they exceed the capacity in force (it shrank)."""
        if self.idle_bytes > self.capacity_bytes:
            self.clear()

    def give(self, buffer: torch.Tensor) -> None:
        """Return ``buffer``; kept for reuse while the pool is under capacity."""
        nbytes = buffer.numel()
        budget = self.prefetch_budget_bytes  # capacity_bytes, inline: once per buffer that comes back
        capacity = budget() if callable(budget) else budget
        with self._lock:
            if self.idle_bytes + nbytes <= capacity:
                self._idle.setdefault(nbytes, []).append(buffer)
                self.idle_bytes += nbytes

    def clear(self) -> None:
        """Free every idle buffer."""
        with self._lock:
            self._idle.clear()
            self.idle_bytes = 0

    def drop_mapped(self) -> None:
        """Free the idle buffers that are mappings of their own (Note [Huge pages do not survive a fork])."""
        with self._lock:
            for nbytes in [n for n in self._idle if n >= HUGE_PAGE_BYTES]:
                self.idle_bytes -= nbytes * len(self._idle.pop(nbytes))

    def lease(self, buffer: torch.Tensor, start_bytes: int, nbytes: int) -> torch.Tensor:
        """Like :func:`tba.io._memory.storage_view`, but ``buffer`` returns here when the view's storage dies."""
        token = _Token()
        returned = finalizer(_Returned, token)
        returned.pool, returned.buffer = self, buffer
        # Note [Objects the cycle collector need not see] in tba/_untrack.py: the token first, so that the
        # finalizer is never untracked while its referent is tracked.
        untrack(token, returned)
        return storage_view(buffer, start_bytes, nbytes, owner=token)


_pools = WeakRegistry()
"""Every pool made, weakly (:mod:`tba._weak`)."""


def _after_fork_in_parent() -> None:
    """Note [Huge pages do not survive a fork]."""
    for pool in _pools.alive():
        pool.drop_mapped()


def _after_fork_in_child() -> None:
    """Note: [A pool's lock held at a fork]
    Buffers come back on the control thread (``_Returned``): a fork while it held a pool's
    lock left the child's first read through that pool (a reusable offloader's) waiting for ever. Each
    pool gets a new lock, and lets go of its idle buffers, which a half-finished ``give`` may have left
    miscounted and which are the parent's pages anyway (Note [A lock held at a fork] in ``tba/_fork_lock.py``).
    """
    for pool in _pools.alive():
        pool._lock = threading.Lock()
        pool._idle = {}
        pool.idle_bytes = 0


os.register_at_fork(after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child)
