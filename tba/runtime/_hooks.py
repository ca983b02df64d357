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
  after a read (:class:`~tba.runtime._unpack_hooks.UnpackHooks`, in ``tba/runtime/_unpack_hooks.py``).
* ``drop_view`` runs on the control thread when autograd frees a view; the last one closes a
  one-shot offloader.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from tba import _control, _trace
from tba._trace import traced
from tba._untrack import untrack
from tba.device import is_device_tensor
from tba.errors import TbaError, error_summary
from tba.runtime._compile import never_traced
from tba.runtime._entry import StorageEntry
from tba.runtime._keep import KeepDecision, KeepReason, kept_after_block
from tba.runtime._trim import note_host_offload
from tba.runtime._unpack_hooks import Phase, UnpackHooks
from tba.runtime._views import Kept, SavedView
from tba.runtime._writes import EmptyStorage

if TYPE_CHECKING:

    from tba.runtime._discover import LayerDiscovery
    from tba.runtime._layers import LayerTracker
    from tba.runtime._stats import OffloadStats
    from tba.runtime._store import StorageStore

logger = logging.getLogger("tba")

class SavedTensorHooks(UnpackHooks, KeepDecision):
    """The pack and unpack hooks of :class:`tba.Offloader`, which sets every attribute they read (those of
    the keep decision too, :class:`~tba.runtime._keep.KeepDecision`)."""

    _phase: Phase
    _claim: object | None
    _forked_mid_block: bool
    _store: StorageStore
    _stats: OffloadStats
    _tracker: LayerTracker
    _discovery: LayerDiscovery | None
    _staged_devices: tuple[str, ...]
    layer_saved_bytes: dict[int | None, int]

    reusable: bool
    _serial: int
    """This offloader's number, unique in the process: what its views record as their owner."""
    _waker: _control.Waker
    """Wakes the control thread for forward's deferred saves."""

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
        if _trace._annotate() is None:  # Note [No range without nvtx] in tba/_trace.py: one Python call less
            return self._pack(tensor)
        return traced("pack", self._pack, tensor)

    def _pack(self, tensor: torch.Tensor) -> Any:
        if self._phase is not Phase.ACTIVE:
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
        error = view.uncovered(storage)  # Note [A save writes the storage its tensor had at pack] in tba/runtime/_views.py
        if error is not None:
            view.error = error
            return
        try:
            entry, fresh = self._store.save(tensor, storage, layer, view.version, ready)
        except EmptyStorage:  # Note [An empty storage is not saved] in tba/runtime/_writes.py
            view.keep(tensor)
            with self._store.lock:
                self._stats.count_kept(KeepReason.EMPTY_STORAGE, 0)
            return
        except Exception as err:  # noqa: BLE001 - kept in memory instead, with a warning
            self._keep_unsaved(view, tensor, err)
            return
        except BaseException as err:  # undone by the store (Note [A save that fails after its entry is registered])
            view.save_failed(err)
            raise
        layer_bytes, died = self.layer_saved_bytes.get(layer), None
        try:  # Note [A save job that fails after the store saved]
            if fresh:
                self.layer_saved_bytes[layer] = (layer_bytes or 0) + entry.nbytes  # entry.layer is layer
                if self._discovery is not None:
                    self._discovery.note_saved(entry, stack)
            view.entry = entry
            died = _control.finalizer(_ViewDied, view)
            died.owner, died.entry, died.view_id = self, entry, id(view)
            untrack(died)  # Note [Objects the cycle collector need not see] in tba/_untrack.py
        except BaseException as err:
            self._save_undone(view, tensor, entry, fresh, layer_bytes, died, err)
            if not isinstance(err, Exception):
                raise

    def _save_undone(self, view: SavedView, tensor: torch.Tensor, entry: StorageEntry, fresh: bool,
                     layer_bytes: int | None, died: _ViewDied | None, error: BaseException) -> None:
        """Take ``view`` off ``entry``, whose save returned, after the job's bookkeeping raised ``error``.

        Note: [A save job that fails after the store saved]
        The store's ``save`` counts the entry's new view (``live_views``, ``tensors_offloaded``); the job then
        books the layer's bytes, tells the discovery, points the view at the entry and makes the finalizer
        that drops the view when autograd frees it. An error there (a MemoryError, a bug in the discovery)
        left the entry with a live view that no finalizer would ever drop: counted live for good, a
        one-shot offloader never closed its spill file and engine, and a view left without its entry
        raised 'save never ran' at unpack. So what the store counted is undone (the view dropped as its
        death drops it, its finalizer, if made, unregistered so that it does not drop it again), and,
        for an Exception, the tensor stays in memory, counted as kept (``KeepReason.SAVE_FAILED``) like
        a save that could not start; anything else goes up, and the view's unpack says that this tensor's save
        failed, naming the error's type and text (``SavedView.save_failed``), not a fork that did not happen.
        The discovery keeps what it noted: the storage was saved there, and its bytes were written.
        """
        if died is not None:
            _control.unregister(died)
        view.entry = None
        if fresh:
            if layer_bytes is None:
                self.layer_saved_bytes.pop(entry.layer, None)
            else:
                self.layer_saved_bytes[entry.layer] = layer_bytes
        with self._store.lock:
            self._stats.tensors_offloaded -= 1
            if not fresh:
                self._stats.bytes_deduplicated -= entry.nbytes
        try:
            if isinstance(error, Exception):
                self._keep_unsaved(view, tensor, error)
            else:
                view.save_failed(error)
        finally:  # dropped whatever the warning does
            self.drop_view(entry, id(view))

    def _keep_unsaved(self, view: SavedView, tensor: torch.Tensor, error: Exception) -> None:
        """Keep ``tensor`` in memory because its save could not start (its route, or the store, raised ``error``),
        counted as kept (``stats.kept_by_reason["save failed"]``) and said once per call."""
        view.keep(tensor)
        with self._store.lock:
            self._stats.count_kept(KeepReason.SAVE_FAILED, tensor.numel() * tensor.element_size())
        # Note [A log record holds no failed save's frames] in tba/errors.py
        logger.warning("tba: could not start writing a saved tensor (%s); it stays in memory", error_summary(error))

    def _not_active_message(self) -> str:
        if self._phase is Phase.CLOSED:
            return ("Offloader.pack: the offloader was closed inside its with block; call close() only "
                    "after the last backward, outside the block")
        return (f"Offloader.pack is only valid inside 'with offloader:' (it is {self._phase.value}); enter the "
                "offloader instead of calling pack directly")

    def drop_view(self, entry: StorageEntry, view_id: int) -> None:
        """Called when autograd frees a :class:`SavedView`; closes a one-shot offloader after the last one."""
        if entry.seq < self._store.fork_seq:
            return
        if self._store.drop_view(entry, view_id) and self._phase is Phase.EXITED:
            self.close()


class _ViewDied(_control.Finalizer):
    """Tells the offloader that autograd freed a :class:`SavedView` (:meth:`Offloader.drop_view`).

    Its own slots instead of :func:`tba._control.on_death`'s arguments tuple: one object less per
    saved storage for the cycle collector (docs/host-cost.md).
    """

    __slots__ = ("owner", "entry", "view_id")

    def fire(self) -> None:
        self.owner.drop_view(self.entry, self.view_id)


never_traced(SavedTensorHooks.pack)
