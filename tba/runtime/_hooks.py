"""The saved-tensor hooks of an offloader: what happens to each tensor autograd saves, and at unpack.

:class:`SavedTensorHooks` is the hot half of :class:`tba.Offloader` (``tba/runtime/_offloader.py``
holds its options and ``close``, ``tba/runtime/_step_cycle.py`` its entry and exit). ``pack`` runs
once per saved tensor during forward, ``unpack`` once per saved tensor during backward, both on
the training thread; every microsecond spent here is host time a GPU's queue waits for (``docs/host-cost.md``).

* :meth:`SavedTensorHooks.keep_reason` says why a tensor stays in memory (None: it goes to disk);
  the decision is :class:`~tba.runtime._keep.KeepDecision`'s, in ``tba/runtime/_keep.py``.
* ``pack`` of a tensor that goes to disk hands the storage to the store
  (``tba/runtime/_store.py``) as a job of the control thread and returns a :class:`SavedView`.
* ``unpack`` returns the saved tensor bit for bit: from memory when its bytes are resident, else
  after a read.
* ``drop_view`` runs on the control thread when autograd frees a view; the last one closes a
  one-shot offloader.
"""

from __future__ import annotations

import enum
import logging
from typing import TYPE_CHECKING, Any

import torch

from tba import _control
from tba._trace import nvtx_enabled, nvtx_range
from tba._untrack import untrack
from tba.device import is_device_tensor
from tba.errors import EngineClosedError, TbaError
from tba.runtime._compile import COMPILED_AUTOGRAD_MESSAGE, never_traced
from tba.runtime._keep import KeepDecision, KeepReason, kept_after_block
from tba.runtime._trim import note_host_offload
from tba.runtime._views import Kept, SavedView, StorageEntry

if TYPE_CHECKING:
    from collections.abc import Callable

    from tba.runtime._discover import LayerDiscovery
    from tba.runtime._layers import LayerTracker
    from tba.runtime._stats import OffloadStats
    from tba.runtime._store import StorageStore

logger = logging.getLogger("tba")

_is_compiling = torch.compiler.is_compiling
_graph_task_id = torch._C._current_graph_task_id


class _Phase(enum.Enum):
    """Where an :class:`Offloader` is in its life."""

    IDLE = "idle"
    """Not entered, or between steps of a reusable offloader."""
    ENTERING = "entering"
    """One thread is entering the ``with`` block; any other entry raises."""
    ACTIVE = "active"
    """Inside the ``with`` block: saved tensors go through the hooks."""
    EXITED = "exited"
    """A one-shot offloader after its block: waits for backward to release everything, then closes."""
    DISCARDED = "discarded"
    """The block raised: its saved tensors were dropped."""
    CLOSED = "closed"


class SavedTensorHooks(KeepDecision):
    """The pack and unpack hooks of :class:`tba.Offloader`, which sets every attribute they read (those of
    the keep decision too, :class:`~tba.runtime._keep.KeepDecision`)."""

    _phase: _Phase
    _claim: object | None
    _forked_mid_block: bool
    _store: StorageStore
    _stats: OffloadStats
    _tracker: LayerTracker
    _discovery: LayerDiscovery | None
    _staged_devices: tuple[str, ...]
    layer_saved_bytes: dict[int | None, int]
    _note_unpack: Callable[[object, int | None], None]
    """The policy runner's (Note [A saved tensor unpacked twice in one backward] in ``tba/runtime/_profiled_step.py``)."""

    reusable: bool
    _serial: int
    """This offloader's number, unique in the process: what its views record as their owner."""
    _waker: _control.Waker
    """Wakes the control thread for forward's deferred saves."""
    _unpack_waker: _control.Waker
    """Wakes it for backward's deferred bookkeeping, less often (Note [Backward wakes the control thread less often]
    in ``tba/defaults.py``)."""
    _kept_layer: int | None
    """The layer of the last kept tensor unpacked since this block was entered, or since the backward pass began."""
    _backward_task: int
    """The autograd graph task of the last unpack in backward (Note [Each backward pass reads ahead] in
    ``tba/runtime/_reads.py``)."""

    def close(self) -> None:
        """Overridden by :class:`tba.Offloader`."""
        raise NotImplementedError

    def pack(self, tensor: torch.Tensor) -> Any:
        """Saved-tensor pack hook: a :class:`SavedView` for the disk path, else the tensor itself.

        Note: [Dynamo never runs tba's hooks]
        After a graph break, the eager rest of a compiled forward runs with Dynamo's frame callback set,
        and a pack hook called there was compiled as any other Python frame: Dynamo traced tba's
        bookkeeping, mistraced the version watch's ``set_data`` (``AssertionError: torch.int64 !=
        torch.float32`` for a 64 KiB batch of token ids saved by the embedding) and graph-broke at
        each lock (helper-56: ``torch.compile(model)`` passed as ``layers=``, whose layer hooks break
        the graph). So both hooks' code, and every frame they call, is marked for Dynamo to skip
        (:func:`tba.runtime._compile.never_traced`): they run eagerly, at no cost per call.
        """
        if not nvtx_enabled():
            return self._pack(tensor)
        with nvtx_range("pack"):
            return self._pack(tensor)

    def _pack(self, tensor: torch.Tensor) -> Any:
        if self._phase is not _Phase.ACTIVE:
            if self._claim is None and torch._C._autograd._top_saved_tensors_default_hooks(True) == (self.pack, self.unpack):
                return kept_after_block(tensor)
            raise TbaError(self._not_active_message())
        if self._forked_mid_block:
            raise TbaError("this with block of tba was entered before os.fork(): its spill file belongs to the "
                           "parent; in the child, leave the block and enter the offloader again")
        self._tracker.note_save()
        reason = self.keep_reason(tensor)
        if reason is not None:
            with self._store.lock:
                self._stats.count_kept(reason, 0 if reason.is_state else tensor.numel() * tensor.element_size())
            if self._write_caps is not None and reason is KeepReason.LAYER_KEPT:
                self._hold_back(self._tracker.current)
            # Note [Kept tensors are returned detached] in tba/runtime/_views.py
            return Kept(tensor.detach() if tensor.grad_fn is not None else tensor, tensor._version, self._tracker.current)
        layer = self._tracker.current
        stack = self._discovery.stack if self._discovery is not None else None
        view = SavedView(None, tensor, self._serial)
        device_type = "cpu" if tensor.is_cpu else tensor.device.type
        if is_device_tensor(tensor, device_type) or device_type in self._staged_devices:
            # Note: [A device save is deferred too]
            # A device storage's copy must start after the kernel that produced it, which is queued
            # on the caller's current stream, not on the control thread's. The route marks that
            # point here, on the training thread (an event recorded on the current stream), and
            # the deferred save orders its copy after the mark. The pack used to make a
            # synchronous hop to the control thread instead, per saved tensor: a GIL round trip
            # on the thread that keeps the GPU's queue full (docs/host-cost.md). Only the first
            # tensor on a device still hops: the control thread builds the route (its threads,
            # streams and pinned pool), as every other piece of tba's state is built there.
            try:
                routes = self._store.routes
                route = routes.existing(tensor.device) or _control.call(routes.for_device, tensor.device)
                ready = route.mark_ready()
            except Exception as err:  # noqa: BLE001 - kept in memory instead, with a warning
                self._keep_unsaved(view, tensor, err)
                return view
        else:
            note_host_offload()
            ready = None
        # Note: [A save is deferred]
        # The save runs on the control thread later, in order with every other job (Note [Deferred
        # jobs] in tba/_control.py); the job holds the tensor, so its bytes stay alive until the write
        # starts, and the view, so the view cannot die before its entry exists. The version checked
        # at unpack is the one recorded here.
        # Note [A save writes the storage its tensor had at pack] in tba/runtime/_views.py
        nbytes = tensor.nbytes
        self._waker.note(_control.defer(self._save_job, view, tensor, tensor.untyped_storage(), nbytes, layer, stack,
                                        ready), nbytes)
        self._deferred_bytes += nbytes
        if self._write_caps is not None:
            self._hold_back(layer)
        return view

    def _hold_back(self, layer: int | None) -> None:
        """Wait while more is unwritten than the plan's cap for ``layer`` (Note [A budget holds back
        forward's writes] in ``tba/policy/_model.py``); the saves deferred so far are started first."""
        caps = self._write_caps
        cap = caps[layer] if layer is not None and 0 <= layer < len(caps) else caps[0]
        # Two running totals, each written by one thread only: bytes deferred (training thread)
        # and bytes whose save job has run (control thread); the difference waits to be saved.
        waiting = self._deferred_bytes - self._save_jobs_bytes
        if self._store.unwritten_bytes + waiting <= cap:
            return
        if waiting > 0:
            _control.settle()
        self._store.hold_back_writes(cap)

    def _save_job(self, view: SavedView, tensor: torch.Tensor, storage: torch.UntypedStorage, nbytes: int,
                  layer: int | None, stack: Any, ready: Any) -> None:
        self._save_jobs_bytes += nbytes
        view.error = view.uncovered(storage)  # Note [A save writes the storage its tensor had at pack] in tba/runtime/_views.py
        if view.error is not None:
            return
        try:
            entry, fresh = self._store.save(tensor, storage, layer, view.version, ready)
        except Exception as err:  # noqa: BLE001 - kept in memory instead, with a warning
            self._keep_unsaved(view, tensor, err)
            return
        if fresh and self._discovery is not None:
            self._discovery.note_saved(entry, stack)
        if fresh:
            self.layer_saved_bytes[entry.layer] = self.layer_saved_bytes.get(entry.layer, 0) + entry.nbytes
        view.entry = entry
        died = _control.finalizer(_ViewDied, view)
        died.owner, died.entry, died.view_id = self, entry, id(view)
        untrack(died)  # Note [Objects the cycle collector need not see] in tba/_untrack.py

    @staticmethod
    def _keep_unsaved(view: SavedView, tensor: torch.Tensor, error: Exception) -> None:
        view.keep(tensor)
        logger.warning("tba: could not start writing a saved tensor (%s); it stays in memory", error)

    def _not_active_message(self) -> str:
        if self._phase is _Phase.CLOSED:
            return ("Offloader.pack: the offloader was closed inside its with block; call close() only "
                    "after the last backward, outside the block")
        return (f"Offloader.pack is only valid inside 'with offloader:' (it is {self._phase.value}); enter the "
                "offloader instead of calling pack directly")

    def unpack(self, packed: Any) -> torch.Tensor:
        """Saved-tensor unpack hook: the saved tensor, bit for bit (Note [Dynamo never runs tba's hooks]; Note
        [Compiled autograd traces the unpack hook] in ``tba/runtime/_compile.py``)."""
        if _is_compiling():
            raise TbaError(COMPILED_AUTOGRAD_MESSAGE)
        if type(packed) is Kept:
            self._note_unpack(packed, packed.layer)
            if packed.layer is not None:
                self._note_pass()
                if packed.layer != self._kept_layer:
                    self.reached_layer(packed.layer)
            return packed.get()
        if not isinstance(packed, SavedView):
            return packed
        if not nvtx_enabled():
            return self._unpack(packed)
        with nvtx_range("unpack"):
            return self._unpack(packed)

    def _unpack(self, packed: SavedView) -> torch.Tensor:
        if packed.owner != self._serial:
            # Note: [A view is unpacked by its own offloader]
            # Autograd pairs each pack with its own unpack, but both are public and callable alone. An entry
            # names an extent of its own store's spill file: read through another offloader's store, a view
            # got that file's bytes at the same offset (another tensor's, or none: helper-84). A view holds its
            # offloader's serial number, not the offloader: that reference would close cycles through autograd's
            # graph, which the cycle collector cannot see (an offloader holds the model, which may hold a loss).
            raise TbaError("Offloader.unpack was given what another offloader's pack returned; unpack it with the "
                           "offloader whose pack made it")
        if packed.entry is None and packed.kept is None:
            _control.settle()  # its save was deferred (Note [A save is deferred])
        entry = packed.entry
        if entry is None:
            if packed.error is not None:
                packed.check_version()
                raise TbaError(packed.error)  # a fresh one: Note [A save writes the storage its tensor had at pack]
            if packed.kept is None:
                # Its deferred save never ran: the process forked while it was queued (the child has
                # none of the parent's control thread), or the save job itself failed (logged).
                raise TbaError("cannot unpack a saved tensor whose save never ran: the process was forked inside "
                               "the with block, before tba's control thread had saved it, or the save failed "
                               "(see the log); run forward again")
            packed.check_version()
            return packed.kept
        self._note_unpack(packed, entry.layer)  # its entry exists now: a deferred save has run
        if self._phase is _Phase.DISCARDED:
            raise TbaError(self._discarded_message(entry))
        store = self._store
        if entry.seq < store.fork_seq:
            raise TbaError(f"cannot unpack {entry.describe()}: it was saved before this process was forked and "
                           "its bytes belong to the parent; run forward again in the child")
        if self._phase is _Phase.CLOSED:
            raise TbaError(f"cannot unpack {entry.describe()}: the offloader was closed before backward; "
                           "call close() only after the last backward")
        packed.check_version()
        self._note_pass()
        data, event = store.resident(entry)
        if data is not None:
            # Served from memory: the bookkeeping (window, stats, release) is deferred.
            self._unpack_waker.note(_control.defer(store.served_from_memory, entry, id(packed)), entry.nbytes)
        else:
            try:
                data, event, reading = _control.call(store.start_load, entry)
                if reading is not None:
                    data, event = store.wait_read(entry, reading)
            except EngineClosedError:
                raise TbaError(f"cannot unpack {entry.describe()}: the offloader was closed during backward; "
                               "call close() only after the last backward") from None
            self._unpack_waker.note(_control.defer(store.note_unpacked, entry, id(packed)), entry.nbytes)
        tensor = packed.rebuild(data)
        entry.route.consume(event, tensor)
        return tensor

    def _note_pass(self) -> None:
        """Tell the store when this unpack is the first of a new backward pass (Note [Each backward pass reads ahead]
        in ``tba/runtime/_reads.py``); unpacks outside backward (a node's ``_saved_self`` read from Python) are none."""
        task = _graph_task_id()
        if task != self._backward_task and task != -1:
            self._backward_task = task
            self._kept_layer = None
            _control.defer(self._store.new_pass)

    def _discarded_message(self, entry: StorageEntry) -> str:
        if not self.reusable:
            return f"{entry.describe()} was discarded because the offload context exited with an exception; run forward again"
        # A reusable offloader's failed block closes its store: the blocks before it lose their tensors too (helper-94).
        return (f"{entry.describe()} was discarded because a with block of this reusable Offloader exited with an "
                "exception, which drops every tensor the offloader holds, those of its earlier blocks too; run forward "
                "again (to keep earlier micro-batches when a later one may fail, give each its own "
                "tba.offload_activations())")

    @property
    def current_layer(self) -> int | None:
        """The layer whose forward is running (None outside every layer)."""
        return self._tracker.current

    def reached_layer(self, layer: int) -> None:
        """Backward is in ``layer``, which tba does not spill: read what the layers below need next (Note [Backward
        through kept layers] in ``tba/runtime/_prefetch.py``). Told by the unpack of a kept tensor and by a
        recomputation."""
        if layer != self._kept_layer:
            self._kept_layer = layer
            self._unpack_waker.note(_control.defer(self._store.backward_reached, layer), 0)

    def drop_view(self, entry: StorageEntry, view_id: int) -> None:
        """Called when autograd frees a :class:`SavedView`; closes a one-shot offloader after the last one."""
        if entry.seq < self._store.fork_seq:
            return
        if self._store.drop_view(entry, view_id) and self._phase is _Phase.EXITED:
            self.close()


class _ViewDied(_control.Finalizer):
    """Tells the offloader that autograd freed a :class:`SavedView` (:meth:`Offloader.drop_view`).

    Its own slots instead of :func:`tba._control.on_death`'s arguments tuple: one object less per
    saved storage for the cycle collector (docs/host-cost.md).
    """

    __slots__ = ("owner", "entry", "view_id")

    def fire(self) -> None:
        self.owner.drop_view(self.entry, self.view_id)


never_traced(SavedTensorHooks.pack, SavedTensorHooks.unpack)
