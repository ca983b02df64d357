"""The unpack half of an offloader's saved-tensor hooks, and the phases of an offloader's life.

:class:`UnpackHooks` is mixed into :class:`~tba.runtime._hooks.SavedTensorHooks` (the pack half), which
:class:`tba.Offloader` is. ``unpack`` runs once per saved tensor during backward, on the thread autograd runs the
node on, and returns the tensor bit for bit: from memory when its bytes are resident (the bookkeeping deferred to
the control thread), else after a read. It also tells the store where backward is: the first unpack of a new
backward pass (Note [Each backward pass reads ahead] in ``tba/runtime/_unpacked.py``) and the layer of each kept
tensor (Note [Backward through kept layers] in ``tba/runtime/_prefetch.py``).
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any

import torch

from tba import _control
from tba._trace import traced
from tba.errors import EngineClosedError, TbaError
from tba.runtime._compile import COMPILED_AUTOGRAD_MESSAGE, check_compiled_autograd_backend, never_traced
from tba.runtime._compiling import compiling
from tba.runtime._entry import StorageEntry
from tba.runtime._views import Kept, SavedView

if TYPE_CHECKING:
    from collections.abc import Callable

    from tba.runtime._layers import LayerTracker
    from tba.runtime._store import StorageStore

_is_compiling = compiling
_graph_task_id = torch._C._current_graph_task_id


class Phase(enum.Enum):
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


class UnpackHooks:
    """The unpack hook of :class:`tba.Offloader`, which sets every attribute it reads."""

    _phase: Phase
    _store: StorageStore
    _tracker: LayerTracker
    reusable: bool
    _serial: int
    """This offloader's number, unique in the process: what its views record as their owner."""
    _unpack_waker: _control.Waker
    """Wakes the control thread for backward's deferred bookkeeping, less often than forward's (Note [Backward wakes
    the control thread less often] in ``tba/defaults.py``)."""
    _kept_layer: int | None
    """The layer of the last kept tensor unpacked since this block was entered, or since the backward pass began."""
    _backward_task: int
    """The autograd graph task of the last unpack in backward (Note [Each backward pass reads ahead] in
    ``tba/runtime/_unpacked.py``)."""
    _note_unpack: Callable[[object, int | None], None]
    """The policy runner's (Note [A saved tensor unpacked twice in one backward] in ``tba/runtime/_profiled_step.py``)."""

    def unpack(self, packed: Any) -> torch.Tensor:
        """Saved-tensor unpack hook: the saved tensor, bit for bit (Note [Dynamo never runs tba's hooks]; Note
        [Compiled autograd traces the unpack hook] and [Compiled autograd under a backend not known exact] in
        ``tba/runtime/_compile.py``)."""
        if _is_compiling():
            raise TbaError(COMPILED_AUTOGRAD_MESSAGE)
        check_compiled_autograd_backend()
        if type(packed) is Kept:
            self._note_unpack(packed, packed.layer)
            if packed.layer is not None:
                self._note_pass()
                if packed.layer != self._kept_layer:
                    self.reached_layer(packed.layer)
            return packed.get()
        if not isinstance(packed, SavedView):
            return packed
        return traced("unpack", self._unpack, packed)  # Note [No range without nvtx] in tba/_trace.py

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
        if self._phase is Phase.DISCARDED:
            raise TbaError(self._discarded_message(entry))
        store = self._store
        if entry.seq < store.fork_seq:
            raise TbaError(f"cannot unpack {entry.describe()}: it was saved before this process was forked and "
                           "its bytes belong to the parent; run forward again in the child")
        if self._phase is Phase.CLOSED:
            raise TbaError(f"cannot unpack {entry.describe()}: the offloader was closed before backward; "
                           "call close() only after the last backward")
        packed.check_version()
        task = _graph_task_id()  # _note_pass, inline: one call fewer per unpack
        if task != self._backward_task and task != -1:
            self._new_pass(task)
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
            finally:
                reading = None  # Note [A failed outcome is no local of the frames it is raised through] in tba/_outcome.py
            self._unpack_waker.note(_control.defer(store.note_unpacked, entry, id(packed)), entry.nbytes)
        tensor = packed.rebuild(data)
        if entry.route is not store.route_without_consume:  # the host route's consume does nothing
            entry.route.consume(event, tensor)
        return tensor

    def _note_pass(self) -> None:
        """Tell the store when this unpack is the first of a new backward pass (Note [Each backward pass reads ahead]
        in ``tba/runtime/_unpacked.py``); unpacks outside backward (a node's ``_saved_self`` read from Python) are none."""
        task = _graph_task_id()
        if task != self._backward_task and task != -1:
            self._new_pass(task)

    def _new_pass(self, task: int) -> None:
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


never_traced(UnpackHooks.unpack)
