"""The offload context: saved-tensor hooks that move activations to a file and back.

This module holds the offloader's life (options, entry, exit, close); its hooks, the per-tensor
hot path, are in ``tba/runtime/_hooks.py``, and the one-shot context
:func:`~tba.runtime._oneshot.offload_activations` in ``tba/runtime/_oneshot.py``.
``with offload_activations(...)`` installs :func:`torch.autograd.graph.saved_tensors_hooks`.
Autograd calls :meth:`Offloader.pack` for every tensor it saves during forward and
:meth:`Offloader.unpack` when backward needs it again. The data path:

1. ``pack`` decides whether the tensor stays in memory (parameters, buffers, small or non-plain
   tensors, layers a policy keeps) or goes to disk. For the disk path the :class:`StorageStore`
   (``tba/runtime/_store.py``) finds or creates the entry of the tensor's storage (Note [Dedup by storage
   identity]) and starts its write: host storages straight from their own memory, CUDA storages
   through a route (``tba/device/_router.py``: pinned staging blocks, or kvikio). ``pack`` returns a
   :class:`SavedView`, the recipe to rebuild the tensor from the storage's bytes.
2. When a storage's write completes, tba drops its reference, so the memory is freed as soon as
   nothing else in the program uses it.
3. During backward each ``unpack`` moves the prefetch window (``tba/runtime/_prefetch.py``) and queues reads
   of the storages that backward will need next; ``unpack`` itself is served from memory when the
   bytes are still resident (write in flight, prefetched, or kept) and waits for a read otherwise.
4. When the last view of a storage is released by autograd, its file extent is freed for reuse;
   when no storage is left and a one-shot context has exited, it gives its file, engine and read
   buffers back to the per-directory runtime (``tba/runtime/_shared.py``) for the next context.

Without ``layers=``, the repeated blocks are found during forward (``tba/runtime/_discover.py``)
until the placement policy has learned them (``tba/runtime/_runner.py``), which then tags by them;
without ``prefetch_budget_bytes=``, the read-ahead window sizes itself (``tba/runtime/_window.py``).

Backward usually runs after the ``with`` block exits; everything stays valid for as long as the
autograd graph holds the views.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import threading
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from tba import _control
from tba.allocator import detect as detect_allocator
from tba.config import OffloadConfig, signature_with_options
from tba.device import DeviceOps, Routes, cuda_api, host_engine_backend
from tba.errors import TbaConfigError, TbaError
from tba.io import BufferPool, Engine, SpillFile, load_crc32c, make_engine, resolve_backend
from tba.runtime import _at_fork, _shared
from tba.runtime._compile import warn_whole_model_compile
from tba.runtime._discover import LayerDiscovery
from tba.runtime._hooks import SavedTensorHooks, Waker, _Phase
from tba.runtime._layers import LayerTracker, resolve_layers, state_storage_keys
from tba.runtime._prefetch import PrefetchWindow
from tba.runtime._runner import StepCounters, StepPlacement, shared_runner
from tba.runtime._stats import OffloadStats
from tba.runtime._store import StorageStore

logger = logging.getLogger("tba")


class Offloader(SavedTensorHooks):
    """Offloads saved activations to a file while active; see :func:`offload_activations`.

    An ``Offloader`` built directly can be entered once per training step: its spill file and
    engine stay open between steps, so the file space freed by one step's backward is reused by
    the next step's forward. Call :meth:`close` when training ends. ``offload_activations()``
    builds a one-shot offloader instead, which closes itself once backward has released
    everything.
    """

    def __init__(
        self,
        directory: str | os.PathLike | None = None,
        *,
        layers: nn.Module | Sequence[nn.Module] | None = None,
        config: OffloadConfig | None = None,
        _reusable: bool = True,
        _device_ops: DeviceOps | None = None,
        _staged_devices: tuple[str, ...] | None = None,
        **options: Any,
    ) -> None:
        if _staged_devices is None:
            _staged_devices = (cuda_api().device_type,)
        if config is not None and not isinstance(config, OffloadConfig):
            raise TbaConfigError(f"config must be a tba.OffloadConfig, got {type(config).__name__}")
        if directory is not None:
            options["directory"] = directory
        config = OffloadConfig.from_env(**options) if config is None else config.replace(**options)
        self.config = config
        """The options in force (:class:`tba.OffloadConfig`), validated."""
        if config.verify:
            load_crc32c()
        self.resolved_backend: str = (config.backend.name if isinstance(config.backend, Engine) else
                                      resolve_backend(host_engine_backend(config.backend)))
        """The host I/O engine that runs (``"io_uring"`` or ``"threads"`` for ``backend="auto"``)."""
        self.directory = config.directory
        self.backend = config.backend
        self.min_offload_bytes = config.min_offload_bytes
        self.block_size_bytes = config.block_size_bytes
        self.queue_depth = config.queue_depth
        self.direct_io = config.direct_io
        self.staging_bytes = config.staging_bytes
        self.prefetch_depth_layers = config.prefetch_depth_layers
        self.prefetch_budget_bytes = config.prefetch_budget_bytes
        self.reusable = _reusable
        self.layers = resolve_layers(layers)
        self._finder = LayerDiscovery() if layers is None else None
        self._discovery = self._finder
        """The finder while it runs in this step (it stops once the placement policy has learned the layers)."""
        self._shared_key = (None if _reusable or isinstance(self.backend, Engine) or _device_ops is not None else
                            _shared.runtime_key(self.directory, self.backend, self.direct_io, self.queue_depth,
                                                self.block_size_bytes, self.staging_bytes,
                                                (_staged_devices, cuda_api())))
        self._runtime: _shared.Runtime | None = None
        self.keep_layers: set[int | None] = set()
        """Indices of layers whose saved tensors stay in memory (set by a placement policy)."""
        self._write_caps: tuple[int, ...] | None = None
        """Per layer, the most bytes forward may hold unwritten (a memory budget's plan), else None."""
        self._deferred_bytes = 0
        """Bytes of storages whose save was deferred, ever (written by the training thread only)."""
        self._save_jobs_bytes = 0
        """Bytes of storages whose deferred save has run, ever (written by the control thread only)."""
        self.layer_saved_bytes: dict[int | None, int] = {}
        """Bytes of distinct storages saved per layer, summed over steps: keys are indices into ``layers``
        (given) or :attr:`discovered_layers` (found at the end of each forward), None for storages
        saved outside every layer (embeddings, the loss)."""
        self._device_ops = _device_ops
        self._staged_devices = _staged_devices
        self._stats = OffloadStats(allocator=detect_allocator().name)
        self._stats_base: OffloadStats | None = None
        self._tracker = LayerTracker(self.layers)
        self._state_keys = state_storage_keys(self.layers)
        self.policy_runner = shared_runner(self.layers, config.policy, shared=not _reusable, directory=self.directory,
                                           memory_budget_bytes=config.memory_budget_bytes,
                                           overhead_bound=config.overhead_bound, profile_steps=config.profile_steps,
                                           prefetch_depth_layers=config.prefetch_depth_layers,
                                           prefetch_budget_bytes=config.prefetch_budget_bytes)
        self._store = StorageStore(self._stats, PrefetchWindow(config.prefetch_depth_layers,
                                                               config.prefetch_budget_bytes))
        self._store.verify = config.verify
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        self._waker = Waker()
        self._phase = _Phase.IDLE
        self._claim: object | None = None
        self._forked_mid_block = False
        self._enter_lock = threading.Lock()

    @property
    def discovered_layers(self) -> list[nn.Module]:
        """The repeated blocks found during the last forward when ``layers`` was not given (else empty)."""
        return self._finder.layers if self._finder is not None else []

    @property
    def prefetch_window_bytes(self) -> int:
        """The prefetch budget in force: ``prefetch_budget_bytes`` when given, else the self-sized window."""
        return self._store.window.budget_bytes

    @property
    def plan(self) -> Any:
        """The :class:`tba.Plan` in force (None while profiling, or without a placement policy)."""
        return self.policy_runner.plan

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

    def __repr__(self) -> str:
        direct = self.resolved_direct_io
        layers = (f"layers={len(self.layers)}" if self.layers else f"discovered_layers={len(self.discovered_layers)}")
        return (f"{type(self).__name__}(directory={self.directory!r}, backend={self.backend!r} -> "
                f"{self.resolved_backend}, direct_io={self.config.direct_io!r}"
                f"{'' if direct is None else f' -> {direct}'}, {layers}, "
                f"{'reusable' if self.reusable else 'one-shot'}, {self._phase.value})")

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

    # ----------------------------------------------------------------- context
    def __enter__(self) -> Offloader:
        # The claim, opening and setup run on the control thread; only the saved-tensor hooks, which
        # are per thread, are pushed here. `claim` tells this entry's setup from another thread's.
        claim = object()
        try:
            _control.call(self._enter_job, claim, threading.get_ident())
        except BaseException:
            _control.call_whole(self._abandon_entry_job, claim)
            raise
        try:
            self._hooks.__enter__()
            self._phase = _Phase.ACTIVE
        except BaseException:
            if torch._C._autograd._top_saved_tensors_default_hooks(True) == (self.pack, self.unpack):
                torch._C._autograd._pop_saved_tensors_default_hooks()
            _control.call_whole(self._abandon_entry_job, claim)
            raise
        return self

    def _enter_job(self, claim: object, thread: int) -> None:
        # Note: [One entry at a time]
        # The phase check and the claim happen under one lock: two threads entering at once would
        # otherwise both see IDLE, open two spill files and share one store's extents.
        with self._enter_lock:
            if self._phase in (_Phase.ENTERING, _Phase.ACTIVE):
                raise TbaError("this Offloader cannot be entered now: it is already entered (in this or another thread); "
                               "build one Offloader per thread")
            if self._phase is not _Phase.IDLE:
                raise TbaError(f"this offloader cannot be entered now (it is {self._phase.value}): "
                               "tba.offload_activations() is one-shot, make a new one each step, or build one "
                               "tba.Offloader(...) and enter it every step")
            self._phase = _Phase.ENTERING
            self._claim = claim
        try:
            if self._store.live_entries:
                self._collect_leftovers()
            if not self._store.is_open:
                self._open()
            self._store.window.reset_cursor()
            self._apply(self.policy_runner.enter(self._counters, self._offload_all_but, thread=thread))
            self._tracker.attach()
            if self._discovery is not None:
                self._discovery.attach(thread)
        except BaseException:
            self._abandon_entry_job(claim)
            raise

    def _counters(self) -> StepCounters:
        _control.settle()
        self._store.update_stats()
        stats = self._stats
        return StepCounters(dict(self.layer_saved_bytes), stats.bytes_written, stats.write_busy_s,
                            stats.bytes_read, stats.read_busy_s, self._store.read_pool.idle_bytes,
                            self._store.window.budget_bytes)

    def _apply(self, placement: StepPlacement) -> None:
        if placement.layers is not None and self._finder is not None:
            if [id(layer) for layer in placement.layers] != [id(layer) for layer in self._tracker.layers]:
                self._tracker = LayerTracker(placement.layers)
                self._state_keys = state_storage_keys(placement.layers)
                self._finder.layers = list(placement.layers) or self._finder.layers
            self._discovery = None if placement.layers else self._finder
        if placement.keep_layers is not None:
            self.keep_layers = set(placement.keep_layers)
        if placement.window_bytes is not None:
            self._store.set_prefetch_budget(placement.window_bytes)
        self._write_caps = placement.write_caps

    def _offload_all_but(self, keep: frozenset[int | None]) -> None:
        """Mid-step, the runner's fallback to another placement (a new input shape): no plan's caps."""
        self.keep_layers = set(keep)
        self._write_caps = None

    def _abandon_entry_job(self, claim: object) -> None:
        """Undo an entry that did not reach the ``with`` body (idempotent: only this ``claim``'s).

        A one-shot offloader is closed: nobody could enter it again to use its file.
        """
        if self._claim is claim and self._phase in (_Phase.ENTERING, _Phase.ACTIVE):
            self._claim = None
            self._tracker.detach()
            if self._discovery is not None:
                self._discovery.detach()
            self._phase = _Phase.IDLE
            if not self.reusable:
                self._close_job()

    def _collect_leftovers(self) -> None:
        """Free entries of earlier steps whose graphs were dropped but are held by reference cycles.

        Graphs still referenced (a loss kept for a later backward) are untouched: only garbage goes.
        """
        before = self._store.live_entries
        gc.collect()
        _control.run_pending()
        if before != self._store.live_entries:
            logger.debug("tba: entering again freed %d entries of dropped graphs", before - self._store.live_entries)

    def _open(self) -> None:
        if self._shared_key is not None:
            self._runtime = runtime = _shared.checkout(self._shared_key, self._open_parts)
            self._store.window.controller = runtime.controller
            self._store.open(runtime.spill, runtime.engine, runtime.routes, runtime.read_pool)
            _at_fork.track(self)
            self._log_open(runtime.spill, runtime.engine)
            return
        spill, engine, routes, _ = self._open_parts()
        self._store.open(spill, engine, routes)
        _at_fork.track(self)
        self._log_open(spill, engine)

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
        try:
            engine = make_engine(self.backend if isinstance(self.backend, Engine) else host_engine_backend(self.backend),
                                 queue_depth=self.queue_depth)
        except BaseException:
            spill.close()
            raise
        pool = BufferPool(self._store.read_pool.prefetch_budget_bytes) if self._shared_key is not None else self._store.read_pool
        routes = Routes(self.backend, engine, pool, self.staging_bytes, self.block_size_bytes,
                        self._device_ops, self._staged_devices)
        return spill, engine, routes, pool

    def _after_fork_in_child(self) -> None:
        """In a forked child: forget the parent's file, engine and entries (see ``tba/runtime/_at_fork.py``)."""
        self._enter_lock = threading.Lock()
        if self._phase in (_Phase.ENTERING, _Phase.ACTIVE):
            self._forked_mid_block = True
        self._runtime = None
        self._store.forget_after_fork()

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: object) -> None:
        # The hooks come off first and in one C call; the rest runs whole even when an asynchronous
        # exception arrives meanwhile (Note [Asynchronous exceptions] in tba/_control.py).
        try:
            torch._C._autograd._pop_saved_tensors_default_hooks()
        finally:
            _control.call_whole(self._exit_job, exc_type is not None)

    def _exit_job(self, failed: bool) -> None:
        if self._phase is not _Phase.ACTIVE and not (self._phase is _Phase.CLOSED and self._claim is not None):
            return
        self._claim = None
        self._forked_mid_block = False
        self._tracker.detach()
        found = None
        if self._discovery is not None:
            self._discovery.detach()
            found = self._discovery.finish()
            self._discovery.retag(self.layer_saved_bytes)
        if self._tracker.in_whole_model_graph:
            warn_whole_model_compile(self.layers)
        self.policy_runner.exit(failed, self._store.largest_live_storage_bytes, found, self._tracker.current is not None,
                                self._store.window.budget_bytes, self._store.unwritten_layer_bytes)
        if self._phase is _Phase.CLOSED:
            return
        if failed:
            self._phase = _Phase.DISCARDED
            self.close()
            return
        self._phase = _Phase.IDLE if self.reusable else _Phase.EXITED
        self._store.end_forward()
        if self._phase is _Phase.EXITED and self._store.live_entries == 0:
            self.close()

    def flush(self) -> None:
        """Block until every write queued so far has completed (or failed over to memory).

        Views and read buffers dropped before the call are released first.
        """
        _control.settle()
        self._store.flush()

    def close(self) -> None:
        """Wait for in-flight I/O, then close the engine and the spill file. Idempotent.

        A one-shot context gives its file, engine and read pool back to the shared runtime instead
        (``tba/runtime/_shared.py``); ``tba.shutdown()`` closes those. Saved tensors that were not
        read back yet can no longer be unpacked afterwards.
        """
        _control.call_whole(self._close_job)

    def _close_job(self) -> None:
        if self._phase is not _Phase.DISCARDED:
            self._phase = _Phase.CLOSED
        if self._shared_key is None:
            self._store.close(engine_owned=not isinstance(self.backend, Engine))
            return
        runtime, self._runtime = self._runtime, None
        if runtime is not None:
            self._store.detach()
            self._store.window.end_backward()
            _shared.checkin(runtime)


Offloader.__init__.__signature__ = signature_with_options(Offloader.__init__)  # type: ignore[attr-defined]
