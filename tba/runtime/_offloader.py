"""The offload context: saved-tensor hooks that move activations to a file and back.

This module holds the offloader's options, fork handling and ``close``; its steps (entering and
leaving the ``with`` block) are in ``tba/runtime/_step_cycle.py``, its hooks, the per-tensor hot
path, in ``tba/runtime/_hooks.py``, what its store runs on and reports in
``tba/runtime/_store_owner.py``, and the one-shot context
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

import itertools
import logging
import os
import threading
import weakref
from collections.abc import Sequence
from typing import Any

from torch import nn

from tba import _control
from tba.allocator import detect as detect_allocator
from tba.config import OffloadConfig, env_name, signature_with_options
from tba.defaults import DEFER_WAKE_UNPACK_BYTES, DEFER_WAKE_UNPACK_JOBS
from tba.device import DeviceOps, cuda_api, host_engine_backend
from tba.errors import TbaConfigError
from tba.io import Engine, load_crc32c, resolve_backend
from tba.runtime import _shared
from tba.runtime._discover import LayerDiscovery
from tba.runtime._hooks import SavedTensorHooks
from tba.runtime._layers import LayerTracker, StateKeys, resolve_layers, searched_in_vain
from tba.runtime._prefetch import PrefetchWindow
from tba.runtime._shared_runners import shared_runner
from tba.runtime._stats import OffloadStats
from tba.runtime._step_cycle import StepCycle
from tba.runtime._store import StorageStore
from tba.runtime._store_owner import StoreOwner
from tba.runtime._unpack_hooks import Phase

logger = logging.getLogger("tba")

_serials = itertools.count()
"""Offloaders' serial numbers, never reused in the process."""


class Offloader(StepCycle, SavedTensorHooks, StoreOwner):
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
        policy_variable = (env_name("policy") if config is None and "policy" not in options
                           and os.environ.get(env_name("policy"), "") != "" else None)
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
        self._finder = LayerDiscovery() if layers is None or searched_in_vain(layers, self.layers, config.policy) else None
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
        self._keep_caps: tuple[int, ...] | None = None
        """Per layer, the most bytes a kept layer keeps this step (a step following a larger shape's plan), else None."""
        self._kept_this_step: dict[int, int] = {}
        self._kept_storages: set[int] = set()
        """The storages kept under ``_keep_caps`` this step (alive while it runs), and their bytes per layer."""
        self._deferred_bytes = 0
        """Bytes of storages whose save was deferred, ever (written by the training thread only)."""
        self._saves_at_entry = (0, 0)
        """What the last with block's entry found saved so far (Note [A block that saved nothing saved nothing] in
        ``tba/runtime/_step_cycle.py``)."""
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
        self._tracker = LayerTracker(self.layers, given=layers)
        self._state_keys = StateKeys(self.layers)
        try:
            self.policy_runner = shared_runner(self.layers, config.policy, shared=not _reusable, directory=self.directory,
                                               memory_budget_bytes=config.memory_budget_bytes,
                                               overhead_bound=config.overhead_bound, profile_steps=config.profile_steps,
                                               prefetch_depth_layers=config.prefetch_depth_layers,
                                               prefetch_budget_bytes=config.prefetch_budget_bytes)
        except TbaConfigError as err:
            if policy_variable is not None:  # the program passed no policy: name the variable it came from
                err.args = (f"{err} (policy from ${policy_variable}={os.environ[policy_variable]}: or unset "
                            f"{policy_variable})", *err.args[1:])
            raise
        self._policy = self.policy_runner.policy
        """The runner's policy object, which a shared runner holds weakly (Note [A policy object in one-shot contexts])."""
        self._note_unpack = self.policy_runner.note_unpack
        self._serial = next(_serials)  # Note [A view is unpacked by its own offloader] in tba/runtime/_unpack_hooks.py
        self._store = StorageStore(self._stats, PrefetchWindow(config.prefetch_depth_layers,
                                                               config.prefetch_budget_bytes))
        self._store.verify = config.verify
        self._waker = _control.Waker()
        self._unpack_waker = _control.Waker(DEFER_WAKE_UNPACK_JOBS, DEFER_WAKE_UNPACK_BYTES)
        self._kept_layer: int | None = None
        self._backward_task = -1
        self._phase = Phase.IDLE
        self._entered = [0]
        self._entering_thread: weakref.ref[threading.Thread] | None = None
        self._ended_elsewhere: dict[int, weakref.ref[threading.Thread]] = {}
        self._claim: object | None = None
        self._runner_claim: object | None = None
        """The claim of the entry whose ``policy_runner.enter`` has run (what an undone entry undoes)."""
        self._forked_mid_block = False
        self._enter_lock = threading.Lock()

    @property
    def discovered_layers(self) -> list[nn.Module]:
        """The repeated blocks found during the last forward when ``layers`` was not given (else empty)."""
        return self._finder.layers if self._finder is not None else []

    @property
    def plan(self) -> Any:
        """The :class:`tba.Plan` in force (None while profiling, or without a placement policy)."""
        return self.policy_runner.plan

    def __repr__(self) -> str:
        direct = self.resolved_direct_io
        layers = (f"layers={len(self.layers)}" if self.layers else f"discovered_layers={len(self.discovered_layers)}")
        plan = self.plan
        return (f"{type(self).__name__}(directory={self.directory!r}, backend={self.backend!r} -> "
                f"{self.resolved_backend}, direct_io={self.config.direct_io!r}"
                f"{'' if direct is None else f' -> {direct}'}, {layers}, policy={self.policy_runner.name}"
                f"{'' if plan is None else f' -> {plan.code}'}, "
                f"{'reusable' if self.reusable else 'one-shot'}, {self._phase.value})")

    def _after_fork_in_child(self) -> None:
        """In a forked child: forget the parent's file, engine and entries (see ``tba/runtime/_at_fork.py``)."""
        self._enter_lock = threading.Lock()
        if self._phase in (Phase.ENTERING, Phase.ACTIVE):
            self._forked_mid_block = True
        self._runtime = None
        self._store.forget_after_fork()

    def close(self) -> None:
        """Wait for in-flight I/O, then close the engine and the spill file. Idempotent.

        A one-shot context gives its file, engine and read pool back to the shared runtime instead
        (``tba/runtime/_shared.py``); ``tba.shutdown()`` closes those. Saved tensors that were not
        read back yet can no longer be unpacked afterwards.
        """
        _control.call_whole(self._close_job)

    def _close_job(self) -> None:
        if self._phase is not Phase.DISCARDED:
            self._phase = Phase.CLOSED
        self._close_store()


Offloader.__init__.__signature__ = signature_with_options(Offloader.__init__)  # type: ignore[attr-defined]
