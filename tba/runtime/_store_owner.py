"""The half of an offloader that owns its storage store: what the store runs on, and what it reports.

:class:`StoreOwner` is a base of :class:`tba.Offloader` (``tba/runtime/_offloader.py`` holds its
options and ``close``, ``tba/runtime/_step_cycle.py`` its entry and exit), which sets every
attribute declared here. At the first entry ``_open`` opens the
:class:`~tba.runtime._store.StorageStore` on a spill file, an engine, the device routes and a read
pool: the offloader's own (``_open_parts``) when it is reusable or was given an engine or device
operations, else checked out from the per-directory runtime (``tba/runtime/_shared.py``), which
builds them with the same ``_open_parts`` when none is idle.
``_close_store`` closes its own, or checks the shared ones back in for the next context.

Note: [An offloader dropped without close]
A reusable offloader owns its spill file and engine (with its threads) until :meth:`~tba.Offloader.close`.
A training function that raises (a NaN check, an interrupted block: "build a new one") loses the
offloader before it gets there, and nothing could close them any more: each such offloader kept a
descriptor of a deleted file, with its disk space, and the engine's threads for the rest of the
process. So ``_open`` has the control thread close the store once the offloader is collected
(:func:`tba._control.on_death`), as a file object closes itself. Saved views refer to their
offloader, so that happens only once no graph can unpack from it any more.

The store's public reads are here too: the counters (``stats``, ``reset_stats``), the prefetch
window, the spill file and the idle read buffers, and ``flush``, which waits for its writes.
``_counters`` is what the placement policy's runner reads at each entry
(``tba/runtime/_runner.py``; Note [A profiled step holds the store, not the offloader]), and
``_collect_leftovers`` frees, at entry, the entries of graphs that were dropped but are held by
reference cycles.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
from typing import Any

from tba import _control
from tba.config import OffloadConfig
from tba.defaults import LEFTOVER_COLLECT_MAX_GAP
from tba.device import DeviceOps, Routes, host_engine_backend
from tba.io import BufferPool, Engine, SpillFile, make_engine
from tba.runtime import _at_fork, _shared
from tba.runtime._profiling import StepCounters
from tba.runtime._stats import OffloadStats
from tba.runtime._store import StorageStore

logger = logging.getLogger("tba")


def _close_abandoned(store: StorageStore, engine_owned: bool) -> None:
    """Close the store of an offloader collected without :meth:`~tba.Offloader.close` (unless it was closed)."""
    if store.spill is not None and not store.spill.closed:
        store.close(engine_owned)


class StoreOwner:
    """Opens, closes and reads the storage store of :class:`tba.Offloader`, which sets every attribute."""

    config: OffloadConfig
    directory: str | None
    backend: Any
    resolved_backend: str
    direct_io: bool | None
    queue_depth: int
    staging_bytes: int
    block_size_bytes: int
    layers: list
    layer_saved_bytes: dict[int | None, int]
    _store: StorageStore
    _stats: OffloadStats
    _stats_base: OffloadStats | None
    _shared_key: tuple | None
    _runtime: _shared.Runtime | None
    _device_ops: DeviceOps | None
    _staged_devices: tuple[str, ...]
    _leftover_gap: int = 1
    """Entries with live entries between two collections of dropped graphs (Note [Collecting dropped graphs
    costs a full collection])."""
    _leftover_skips: int = 0
    """Such entries left to pass before the next collection."""

    @property
    def prefetch_window_bytes(self) -> int:
        """The prefetch budget in force: ``prefetch_budget_bytes`` when given, else the self-sized window."""
        return self._store.window.budget_bytes

    def set_prefetch_budget(self, nbytes: int) -> None:
        """Bound on bytes read ahead or held for backward from now on (a plan's window)."""
        self._store.set_prefetch_budget(nbytes)

    def largest_live_storage_bytes(self) -> int:
        """Bytes of the largest storage held for backward now (the adaptive policy reads it after forward)."""
        return self._store.largest_live_storage_bytes()

    @property
    def stats(self) -> OffloadStats:
        """Counters since the offloader was built or :meth:`reset_stats` was last called (see
        :class:`OffloadStats`); bandwidths include transfers still running."""
        _control.settle()
        self._store.update_stats()
        return self._stats if self._stats_base is None else self._stats.since(self._stats_base)

    def reset_stats(self) -> OffloadStats:
        """Start counting afresh (for example once per step of a reusable offloader); returns the
        counters up to now. The peak of resident bytes restarts from what is resident now."""
        so_far = self.stats
        with self._store.lock:
            self._stats_base = dataclasses.replace(self._stats, kept_by_reason=dict(self._stats.kept_by_reason),
                                                   bytes_kept_by_reason=dict(self._stats.bytes_kept_by_reason))
            self._stats.peak_resident_bytes = self._stats.resident_bytes
        return so_far

    @property
    def resolved_direct_io(self) -> bool | None:
        """Whether the spill file uses ``O_DIRECT`` (None until the offloader is first entered)."""
        spill = self.spill
        return None if spill is None else spill.direct

    @property
    def pool_idle_bytes(self) -> int:
        """Bytes of read buffers kept for reuse while no tensor uses them (held by tba all the same)."""
        _control.settle()
        return self._store.read_pool.idle_bytes

    @property
    def spill(self) -> SpillFile | None:
        """The spill file, once the offloader has been entered."""
        _control.settle()
        return self._store.spill

    def flush(self) -> None:
        """Block until every write queued so far has completed (or failed over to memory).

        Views and read buffers dropped before the call are released first.
        """
        _control.settle()
        self._store.flush()

    def _counters(self) -> StoreCounters:
        """What the placement policy's runner reads at each entry (``tba/runtime/_runner.py``)."""
        return StoreCounters(self._store, self._stats, self.layer_saved_bytes)

    def _collect_leftovers(self) -> None:
        """Free entries of earlier steps whose graphs were dropped but are held by reference cycles.

        Graphs still referenced (a loss kept for a later backward) are untouched: only garbage goes.

        Note: [Collecting dropped graphs costs a full collection]
        ``gc.collect()`` walks every object of the process: 70 ms in one that has only imported torch,
        0.37 s with two million objects more. Entries whose earlier graphs are alive on purpose (the
        micro-batches of gradient accumulation summed before one backward, a pipeline's warm-up
        forwards) ran one at each entry and found nothing: 16 micro-batch forwards took 16 to 85 times
        as long as under one-shot contexts. So a collection that frees nothing doubles the number of
        such entries until the next one (up to :data:`~tba.defaults.LEFTOVER_COLLECT_MAX_GAP`), and one
        that frees something goes back to every entry. Dropped graphs held by cycles are still freed:
        by the collector's own passes as usual, and here within that many entries when it is off.
        """
        _control.run_pending()  # graphs freed as usual count as freed before the collection, not by it
        before = self._store.live_entries
        if not before:
            return
        if self._leftover_skips > 0:
            self._leftover_skips -= 1
            return
        gc.collect()
        _control.run_pending()
        freed = before - self._store.live_entries
        self._leftover_gap = 1 if freed else min(2 * self._leftover_gap, LEFTOVER_COLLECT_MAX_GAP)
        self._leftover_skips = self._leftover_gap - 1
        if freed:
            logger.debug("tba: entering again freed %d entries of dropped graphs", freed)

    def _open(self) -> None:
        if self._shared_key is not None:
            self._runtime = runtime = _shared.checkout(self._shared_key, self._open_parts)
            self._store.window.controller = runtime.controller
            self._store.open(runtime.spill, runtime.engine, runtime.routes, runtime.read_pool)
            _at_fork.track(self)
            self._note_engine(runtime.engine)
            self._log_open(runtime.spill, runtime.engine)
            return
        spill, engine, routes, _ = self._open_parts()
        self._store.open(spill, engine, routes)
        self._note_engine(engine)
        _at_fork.track(self)
        # Note [An offloader dropped without close]
        _control.on_death(self, _close_abandoned, self._store, not isinstance(self.backend, Engine))
        self._log_open(spill, engine)

    def _note_engine(self, engine: Engine) -> None:
        """``backend="auto"`` may run threads where io_uring was expected (Note [A ring the kernel refuses] in
        ``tba/io/_io_uring.py``): ``resolved_backend`` says the engine that runs."""
        if isinstance(self.backend, str) and self.backend in ("auto", "kvikio"):  # kvikio's host engine is auto's
            self.resolved_backend = engine.name

    def _log_open(self, spill: SpillFile, engine: Engine) -> None:
        if logger.isEnabledFor(logging.DEBUG):
            given = self.config.prefetch_budget_bytes
            logger.debug("tba: offloading to %s with %r (backend=%r), %s, prefetch window %s; layers: %s", spill.directory,
                         engine, self.backend, "O_DIRECT" if spill.direct else "buffered I/O (page cache)",
                         f"{given} bytes (prefetch_budget_bytes)" if given is not None else
                         f"self-sized from {self._store.window.budget_bytes} bytes",
                         f"{len(self.layers)} given" if self.layers else "found during the first forward")

    def _open_parts(self) -> tuple[SpillFile, Engine, Routes, Any]:
        """A new spill file, engine, routes and read pool (the pool is the store's unless shared)."""
        spill = SpillFile(self.directory, direct=self.direct_io)
        engine = None
        try:
            engine = make_engine(self.backend if isinstance(self.backend, Engine) else host_engine_backend(self.backend),
                                 queue_depth=self.queue_depth)
            pool = BufferPool(self._store.read_pool.prefetch_budget_bytes) if self._shared_key is not None \
                else self._store.read_pool
            # Note: [Parts opened before a failure are closed]
            # The routes allocate the CUDA staging slab (staging_bytes): one too large for the host failed
            # here, after the file and the engine had opened, and each failed entry kept a spill file's
            # descriptor (and an io_uring ring with its thread) for the rest of the process.
            routes = Routes(self.backend, engine, pool, self.staging_bytes, self.block_size_bytes,
                            self._device_ops, self._staged_devices)
        except BaseException:
            if engine is not None and not isinstance(self.backend, Engine):
                engine.close()
            spill.close()
            raise
        return spill, engine, routes, pool

    def _close_store(self) -> None:
        """Close the spill file and engine, or check the shared runtime's back in (a one-shot offloader's)."""
        if self._shared_key is None:
            self._store.close(engine_owned=not isinstance(self.backend, Engine))
            return
        runtime, self._runtime = self._runtime, None
        if runtime is not None:
            self._store.detach()
            self._store.window.end_backward()
            _shared.checkin(runtime)


class StoreCounters:
    """Called, the :class:`StepCounters` snapshot of one offloader's store, stats and bytes per layer.

    Note: [A profiled step holds the store, not the offloader]
    A profiled step keeps its counters until the next entry reads them, and a bare context's runner
    lives in a registry for the rest of the process. The counters were a bound method of the
    offloader, which holds the model's layers: the last profiled step of every model trained on a
    fresh directory (a sweep, a test suite) kept that model's blocks alive for good, with their
    parameters and gradients. These read the same numbers through the store and the stats alone.
    """

    __slots__ = ("_store", "_stats", "_layer_saved_bytes")

    def __init__(self, store: StorageStore, stats: OffloadStats, layer_saved_bytes: dict[int | None, int]) -> None:
        self._store, self._stats, self._layer_saved_bytes = store, stats, layer_saved_bytes

    def __call__(self) -> StepCounters:
        _control.settle()
        self._store.update_stats()
        stats = self._stats
        return StepCounters(dict(self._layer_saved_bytes), stats.bytes_written, stats.write_busy_s,
                            stats.bytes_read, stats.read_busy_s, self._store.read_pool.idle_bytes,
                            self._store.window.budget_bytes)
