"""One spill file, engine and read-buffer pool per directory, shared by successive one-shot contexts.

``with tba.offload_activations():`` around every step builds a new one-shot :class:`tba.Offloader`
each time. Were each one to open its own file and engine, every step would pay what a reusable
offloader pays once: a probe and an open, a ring and its thread, a file that grows from nothing
(extending writes), and read buffers that fault in fresh pages. This module keeps those pieces in
a :class:`Runtime` and hands it from one context to the next:

* :func:`checkout` gives a context an idle runtime of the same directory and options, or opens
  one. A runtime belongs to one context at a time, so two contexts running at once (threads, or
  one nested in another) each get their own file and never see each other's data.
* :func:`checkin` takes it back once the context's backward has released everything (or its block
  raised). The runtime keeps its self-sizing prefetch window, its file space and its read buffers
  for the next context.
* An idle runtime's file gives its space back after :data:`tba.defaults.RUNTIME_IDLE_RELEASE_S`
  (Note [Idle space is kept for the next step]). Idle runtimes are closed after
  :data:`tba.defaults.RUNTIME_IDLE_CLOSE_S` unused, at interpreter exit, or by :func:`shutdown`
  (``tba.shutdown()``).
* A forked child drops every runtime it inherited, without any I/O (see ``_at_fork.py``).
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import threading
import time
from typing import Any

from tba import _control, defaults
from tba.device import Routes
from tba.io import BufferPool, Engine, OutOfDescriptorsError, SpillFile, resolve_directory
from tba.runtime._window import WindowController

logger = logging.getLogger("tba")


@dataclasses.dataclass(eq=False)
class Runtime:
    """What successive one-shot contexts on one directory share."""

    key: tuple[Any, ...]
    spill: SpillFile
    engine: Engine
    routes: Routes
    read_pool: BufferPool
    controller: WindowController
    idle_since_s: float = 0.0
    """``time.monotonic()`` when it was last checked in."""
    uses: int = 0
    """Contexts that have used it so far."""
    generation: int = 0
    """:func:`shutdown` calls before it was opened; one opened before the last shutdown is closed at checkin."""
    space_kept: bool = False
    """Idle, and its file still holds the space the last context used (given back by the reaper)."""

    def close(self) -> None:
        """Finish in-flight I/O, then close routes, engine and file, and free the read buffers."""
        self.routes.stop()
        self.engine.close()
        self.routes.close()
        self.spill.close()
        self.read_pool.clear()


_lock = threading.Lock()
_idle: dict[tuple[Any, ...], list[Runtime]] = {}
_busy: set[Runtime] = set()
_reaper: threading.Timer | None = None
_reaper_due_s = 0.0
_generation = 0


def runtime_key(directory: str | None, backend: str, direct_io: bool | None, queue_depth: int, block_size_bytes: int,
                staging_bytes: int, staged_devices: Any) -> tuple[Any, ...]:
    """Contexts whose options give the same key can share a runtime.

    ``staged_devices`` includes the CUDA implementation in use: a runtime made on one simulated
    device never serves another.
    """
    return (resolve_directory(directory), backend, direct_io, queue_depth, block_size_bytes, staging_bytes,
            staged_devices)


def checkout(key: tuple[Any, ...], opener: Any) -> Runtime:
    """An idle runtime for ``key``, else a new one from ``opener()`` -> ``(spill, engine, routes, pool)``."""
    with _lock:
        idle = _idle.get(key)
        if idle:
            runtime = idle.pop()
            runtime.uses += 1
            runtime.space_kept = False
            _busy.add(runtime)
            return runtime
    try:
        spill, engine, routes, pool = opener()
    except OutOfDescriptorsError:
        if not close_idle():
            raise
        logger.info("tba: out of file descriptors; closed idle shared runtimes and opened again")
        spill, engine, routes, pool = opener()
    with _lock:
        runtime = Runtime(key, spill, engine, routes, pool, WindowController(), uses=1, generation=_generation)
        _busy.add(runtime)
    logger.debug("tba: opened a shared runtime in %s", spill.directory)
    return runtime


def checkin(runtime: Runtime) -> None:
    """Take ``runtime`` back from its context; kept for the next one, or closed if enough are idle.

    Note: [Idle space is kept for the next step]
    Giving the file's space back at every checkin (Note [Idle spill files hold no disk space]) made
    every step reserve it again, and on tmpfs allocate fresh pages: a 1 MiB write into a truncated
    tmpfs file took 374 us here against 174 us overwriting, and on ext4 every write converted an
    unwritten extent. So an idle file keeps its space for :data:`~tba.defaults.RUNTIME_IDLE_RELEASE_S`
    (a training loop's next step comes sooner) and the reaper gives it back then. On a nearly full
    file system (:meth:`tba.io.SpillFile.short_of_space`: less free than twice what the file holds,
    or than a tenth of the disk) it goes back at once, and a file that tba itself preallocates (a
    checkpoint) and finds the disk full takes it back first (``tba.io.create_preallocated``). What
    is left: a writer outside tba that, within that second, needs more than the free space and less
    than the free space plus the idle file's can fail with ENOSPC where it would not have before;
    ``tba.shutdown()`` (or ``tba.io.release_idle_space()``) before such a write gives the space back.
    """
    with _lock:
        if runtime not in _busy:
            return
        _busy.discard(runtime)
        idle = _idle.setdefault(runtime.key, [])
        extra = None
        oldest = None
        # Note: [A spill file in memory is not kept idle]
        # A spill file made in memory (Note [A disk too full for the spill file spills into memory] in
        # tba/io/_directory.py) kept idle served every later step, after the disk had room again: offloading saved
        # no memory for the rest of the training. It is closed instead; the next context tries the disk again.
        if (len(idle) >= defaults.RUNTIME_IDLE_PER_KEY or runtime.spill.closed or runtime.spill.in_memory
                or runtime.generation != _generation):
            extra = runtime
        else:
            if sum(len(runtimes) for runtimes in _idle.values()) >= defaults.RUNTIME_IDLE_MAX:
                oldest = min((r for runtimes in _idle.values() for r in runtimes), key=lambda r: r.idle_since_s)
                _idle[oldest.key].remove(oldest)
            runtime.space_kept = not runtime.spill.short_of_space()
            if not runtime.space_kept:
                runtime.spill.release_space(when_idle=True)
            runtime.idle_since_s = time.monotonic()
            idle.append(runtime)
            _schedule_reaper_locked(runtime.idle_since_s)
    if extra is not None:
        extra.close()
    if oldest is not None:
        oldest.close()


def close_idle() -> int:
    """Close every idle runtime now (their descriptors and threads); returns how many were closed."""
    with _lock:
        idle = [runtime for runtimes in _idle.values() for runtime in runtimes]
        _idle.clear()
    for runtime in idle:
        runtime.close()
    return len(idle)


REAPER_JOIN_S = 5.0
"""Most seconds :func:`shutdown` waits for the reaper it cancelled to end (Note [Shutdown waits for the reaper it
cancels]); it ends at once unless the machine is starved."""


def _due_s(runtime: Runtime) -> float:
    """When the reaper next has work on idle ``runtime``: give its space back, or close it."""
    wait_s = defaults.RUNTIME_IDLE_CLOSE_S
    if runtime.space_kept:
        wait_s = min(wait_s, defaults.RUNTIME_IDLE_RELEASE_S)
    return runtime.idle_since_s + wait_s


def _schedule_reaper_locked(now: float) -> None:
    """Have the reaper run when the first idle runtime is due (and no later); call with ``_lock`` held."""
    global _reaper, _reaper_due_s
    due_s = min((_due_s(r) for idle in _idle.values() for r in idle), default=None)
    if due_s is None or (_reaper is not None and _reaper_due_s <= due_s):
        return
    if _reaper is not None:
        _reaper.cancel()
    timer = threading.Timer(max(0.01, due_s - now), _reap)
    timer.daemon = True
    timer.start()
    _reaper, _reaper_due_s = timer, due_s


def _reap() -> None:
    """Give back the space of runtimes idle for :data:`~tba.defaults.RUNTIME_IDLE_RELEASE_S` and close
    those idle for :data:`~tba.defaults.RUNTIME_IDLE_CLOSE_S`; come back while any is left."""
    global _reaper
    now = time.monotonic()
    stale: list[Runtime] = []
    spent: list[Runtime] = []
    with _lock:
        if _reaper is not threading.current_thread():
            return
        _reaper = None
        for key, idle in list(_idle.items()):
            keep = [r for r in idle if now - r.idle_since_s < defaults.RUNTIME_IDLE_CLOSE_S]
            stale += [r for r in idle if r not in keep]
            if keep:
                _idle[key] = keep
            else:
                del _idle[key]
            spent += [r for r in keep if r.space_kept and now - r.idle_since_s >= defaults.RUNTIME_IDLE_RELEASE_S]
        for runtime in spent:
            runtime.space_kept = False
            runtime.spill.release_space(when_idle=True)
        _schedule_reaper_locked(now)
    for runtime in stale:
        runtime.close()
    if stale:
        logger.debug("tba: closed %d idle shared runtime(s)", len(stale))


def idle_runtimes() -> int:
    """Runtimes open and unused now, once the releases queued before the call have run."""
    _control.settle()
    with _lock:
        return sum(len(idle) for idle in _idle.values())


def idle_pool_bytes() -> int:
    """Bytes of read buffers that idle runtimes keep for the next context (memory tba holds)."""
    with _lock:
        return sum(r.read_pool.idle_bytes for idle in _idle.values() for r in idle)


def shutdown() -> None:
    """Close every idle shared runtime now: its file, engine and read buffers. Idempotent.

    Contexts still running keep theirs until their backward ends; it is closed when they give it
    back. Training may go on afterwards: the next context opens a new runtime. Releases already
    queued (graphs just freed) are finished first, so a context whose backward has ended counts as
    idle.
    """
    _control.settle()
    _control.call_whole(_shutdown_job)


def _shutdown_job() -> None:
    """:func:`shutdown`'s closes, on the control thread: idempotent, and never cut short.

    Note: [Shutdown closes on the control thread]
    Run in the caller's thread, a signal handler's exception (Ctrl-C) landing between taking the
    idle runtimes out of ``_idle`` and closing them (or inside ``Runtime.close``, between the engine
    and the file) left spill file descriptors open, referenced by nothing, until the process ended.
    """
    global _reaper, _generation
    with _lock:
        _generation += 1
        stale = [r for idle in _idle.values() for r in idle]
        _idle.clear()
        reaper, _reaper = _reaper, None
    if reaper is not None:
        reaper.cancel()
        # Note: [Shutdown waits for the reaper it cancels]
        # A cancelled Timer's thread ends on its own a moment later, and under load that moment outlasted shutdown():
        # a thread of tba's left after it. The reaper never waits for the control thread: past its cancel it only
        # takes ``_lock`` (free here) to find that it is no longer the reaper, and returns.
        if reaper is not threading.current_thread():
            reaper.join(REAPER_JOIN_S)
    for runtime in stale:
        runtime.close()


def _after_fork_in_child() -> None:
    """Forget (without I/O) every runtime of the parent: its descriptor is closed here, its engine dropped."""
    global _lock, _reaper
    _lock = threading.Lock()
    _reaper = None
    for runtime in [r for idle in _idle.values() for r in idle] + list(_busy):
        runtime.spill.forget_after_fork()
    _idle.clear()
    _busy.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(shutdown)
