"""An offloader's steps: entering its ``with`` block, leaving it, and undoing an entry that failed.

:class:`StepCycle` is a base of :class:`tba.Offloader` (``tba/runtime/_offloader.py`` holds its
options, its fork handling and ``close``), which sets every attribute declared here. Entering
claims the offloader on the control thread (Note [One entry at a time]), opens the store on the
first entry, asks the placement policy's runner (``tba/runtime/_runner.py``) for the step's
placement and applies it, then pushes the saved-tensor hooks on the entering thread. Leaving pops
them and runs the rest whole (Note [Asynchronous exceptions] in ``tba/_control.py``): the layer
finder's results, the runner's step end, and the store's end of forward, or, after an exception,
the discarding of what the block saved. An entry that fails before the body is undone
(``_abandon_entry_job``), and a one-shot offloader is closed then.
"""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING, TypeVar

import torch

from tba import _control
from tba._whole_exit import WholeExit, is_calling_thread, pop_own, still_runs
from tba.defaults import DEFER_WAKE_BYTES, DEFER_WAKE_UNPACK_BYTES
from tba.errors import TbaError
from tba.runtime._block_entries import note_entered
from tba.runtime._compile import warn_whole_model_compile
from tba.runtime._layers import LayerTracker, StateKeys
from tba.runtime._pairs import context_below
from tba.runtime._trim import trimmer
from tba.runtime._unpack_hooks import Phase

if TYPE_CHECKING:
    from tba.runtime._discover import LayerDiscovery
    from tba.runtime._runner import PolicyRunner, StepPlacement
    from tba.runtime._stats import OffloadStats
    from tba.runtime._store import StorageStore

_Self = TypeVar("_Self", bound="StepCycle")


class StepCycle:
    """Entry and exit of :class:`tba.Offloader`'s ``with`` block, which sets every attribute."""

    reusable: bool
    layers: list
    keep_layers: set[int | None]
    layer_saved_bytes: dict[int | None, int]
    policy_runner: PolicyRunner
    _phase: Phase
    _entered: list[int]
    """The identity of the thread that entered the active block, else 0 (Note [A block's hooks come off only on its
    thread] in tba/_whole_exit.py)."""
    _entering_thread: weakref.ref[threading.Thread] | None
    """The thread that entered the active block (its identity is ``_entered[0]``), weakly: a thread holding its offloader
    made a cycle, which outlived both's last reference until a collection (Note [Dropping an offloader frees it])."""
    _ended_elsewhere: dict[int, weakref.ref[threading.Thread]]
    """Threads whose block an exit on another thread ended, by identity: their own exit, later, ends nothing more
    (Note [A block's hooks come off only on its thread] in tba/_whole_exit.py). The thread itself is kept with its
    identity (weakly, as above), which the system hands to a new thread once it has ended: that one's exits are its
    own. Threads that ended are dropped as another is added."""
    _claim: object | None
    _runner_claim: object | None
    _forked_mid_block: bool
    _enter_lock: threading.Lock
    _store: StorageStore
    _tracker: LayerTracker
    _state_keys: StateKeys
    _finder: LayerDiscovery | None
    _discovery: LayerDiscovery | None
    _kept_layer: int | None
    _unpack_waker: _control.Waker
    _write_caps: tuple[int, ...] | None
    _keep_caps: tuple[int, ...] | None
    _kept_this_step: dict[int, int]
    _kept_storages: set[int]
    _deferred_bytes: int
    _saves_at_entry: tuple[int, int]
    _stats: OffloadStats

    def __enter__(self: _Self) -> _Self:
        if not torch._C._autograd._saved_tensors_hooks_is_enabled():
            # Before anything opens: the push below would raise the program's own message, not naming tba.
            reason = torch._C._autograd._saved_tensors_hooks_get_disabled_error_message()
            raise TbaError(f"tba cannot offload here: this region disables saved-tensor hooks ({reason!r}, "
                           "torch.autograd.graph.disable_saved_tensors_hooks); enter the offload context outside it")
        refused = context_below(torch._C._autograd._top_saved_tensors_default_hooks(True))
        if refused is not None:
            raise TbaError(refused)
        # The claim, opening and setup run on the control thread; only the saved-tensor hooks, which
        # are per thread, are pushed here. `claim` tells this entry's setup from another thread's.
        claim = object()
        entered = False
        # One try around all of it, the return included: an exception raised at any line after the
        # entry job (a trace function's, at the line between two separate trys or at the return) left
        # the offloader entering for good, or active with its hooks pushed and no exit to pop them.
        # ``entered`` is set once the job has run: before that the pair on top, were it this
        # offloader's, is a block already active (the job refused a second entry), not this entry's.
        try:
            _control.call(self._enter_job, claim, threading.get_ident())
            entered = True
            # Note: [Dropping an offloader frees it]
            # The hooks are pushed here, not held in a saved_tensors_hooks object: the offloader holding
            # one that holds its bound pack and unpack is a reference cycle, and the offloader, with the
            # layers it was given (their parameters and gradients), outlived its user's last reference
            # until a garbage collection. On an H200 a later test's device memory fell by a dropped
            # offloader's 790 KiB whenever one ran. Exit pops what was pushed (``WholeExit``).
            torch._C._autograd._push_saved_tensors_default_hooks(self.pack, self.unpack)
            self._entered[0] = threading.get_ident()
            self._entering_thread = weakref.ref(threading.current_thread())
            self._ended_elsewhere.pop(self._entered[0], None)
            self._phase = Phase.ACTIVE
            note_entered()  # Note [A layer that enters a tba block is not recomputed] in tba/runtime/_block_entries.py
            return self
        except BaseException:
            if entered:  # not a refused second entry's: the block already active keeps its record
                self._entered[0] = 0  # this entry's, set or not (an exception at the line after it left it set)
            if entered and torch._C._autograd._top_saved_tensors_default_hooks(True) == (self.pack, self.unpack):
                torch._C._autograd._pop_saved_tensors_default_hooks()
            _control.call_whole(self._abandon_entry_job, claim)
            raise

    def _enter_job(self, claim: object, thread: int) -> None:
        # Note: [One entry at a time]
        # The phase check and the claim happen under one lock: two threads entering at once would
        # otherwise both see IDLE, open two spill files and share one store's extents.
        with self._enter_lock:
            if self._phase in (Phase.ENTERING, Phase.ACTIVE):
                raise TbaError("this Offloader cannot be entered now: it is already entered (in this or another thread); "
                               "build one Offloader per thread")
            if self._phase is not Phase.IDLE:
                raise TbaError(self._not_idle_message())
            self._phase = Phase.ENTERING
            self._claim = claim
        try:
            if self._store.live_entries:
                self._collect_leftovers()
            if not self._store.is_open:
                self._open()
            self._store.start_forward()  # Note [A new forward lets go of what backward did not use]
            trimmer.refresh()  # Note [The trim interval is read once per with block] in tba/runtime/_trim.py
            self._kept_layer = None
            self._saves_at_entry = self._saves_so_far()
            placement = self.policy_runner.enter(self._counters(), self._reapply, thread=thread, owner=claim)
            self._runner_claim = claim
            self._apply(placement)
            # Note [Backward wakes the control thread less often] in tba/defaults.py
            self._unpack_waker.nbytes = min(DEFER_WAKE_UNPACK_BYTES,
                                            max(DEFER_WAKE_BYTES, self._store.window.budget_bytes // 4))
            self._tracker.attach()
            if self._discovery is not None:
                self._discovery.attach(thread)
        except BaseException:
            self._abandon_entry_job(claim)
            raise

    def _saves_so_far(self) -> tuple[int, int]:
        """Bytes deferred to the disk path and tensors kept, since this offloader was built: what a block saved moves it."""
        return self._deferred_bytes, self._stats.tensors_kept

    def _apply(self, placement: StepPlacement) -> None:
        if placement.layers is not None and self._finder is not None:
            if [id(layer) for layer in placement.layers] != [id(layer) for layer in self._tracker.layers]:
                self._tracker = LayerTracker(placement.layers)
                self._state_keys = StateKeys(placement.layers)
                self._finder.layers = list(placement.layers) or self._finder.layers
            self._discovery = None if placement.layers else self._finder
        if placement.keep_layers is not None:
            self.keep_layers = set(placement.keep_layers)
        if placement.window_bytes is not None:
            self._store.set_prefetch_budget(placement.window_bytes)
        if placement.release_idle_reads:
            self._store.read_pool.clear()
        # Note [Reads reuse what kept layers free] in tba/io/_read_pool.py
        self._store.read_pool.huge_pages = not placement.release_idle_reads
        self._write_caps = placement.write_caps
        self._keep_caps = placement.keep_caps
        self._kept_this_step, self._kept_storages = {}, set()

    def _reapply(self, placement: StepPlacement) -> None:
        """Mid-step, from the first layer's pre-hook, the runner's change of placement (a new input shape)."""
        _control.call(self._apply, placement)

    def _abandon_entry_job(self, claim: object) -> None:
        """Undo an entry that did not reach the ``with`` body (idempotent: only this ``claim``'s).

        A one-shot offloader is closed: nobody could enter it again to use its file.
        """
        if self._claim is claim and self._phase in (Phase.ENTERING, Phase.ACTIVE):
            self._claim = None
            entered, self._runner_claim = self._runner_claim is claim, None
            try:
                self._tracker.detach()
                if self._discovery is not None:
                    self._discovery.detach()
                # The runner's per-step changes (recomputed layers' wrapped forwards, the shape hook,
                # a profiled step's timer) come off as after a failed block, once its enter has run
                # for this entry: before, they belong to the previous step (a profiled step's sample
                # waits for this entry to collect it), or to another context sharing the runner.
                if entered:
                    self.policy_runner.exit(True, self._store.largest_live_storage_bytes, owner=claim)
            finally:
                self._phase = Phase.IDLE
                if not self.reusable:
                    self._close_job()

    def _exit_in_python(self, exc_type: type | None, exc: BaseException | None, tb: object) -> None:
        # The hooks come off first, on the entering thread only (Note [A block's hooks come off only on its
        # thread] in tba/_whole_exit.py; ``pop_top`` in native/tba_shield.c says why only the top pair); the
        # rest runs whole even when an asynchronous exception arrives meanwhile (Note [Asynchronous
        # exceptions] in tba/_control.py).
        me, entered = threading.get_ident(), self._entered[0]
        ended = self._ended_elsewhere.pop(me, None)
        if entered != me and ended is not None and is_calling_thread(ended()):  # this thread's block was ended elsewhere
            if torch._C._autograd._top_saved_tensors_default_hooks(True) == (self.pack, self.unpack):
                torch._C._autograd._pop_saved_tensors_default_hooks()
            return
        if entered not in (0, me):  # the entering thread's own exit, in C or in Python, then takes the branch above
            self._ended_elsewhere = {ident: ref for ident, ref in self._ended_elsewhere.items() if still_runs(ref)}
            if self._entering_thread is not None:
                self._ended_elsewhere[entered] = self._entering_thread
            self._entered[0] = 0
        try:
            pop_own(self._entered, torch._C._autograd._pop_saved_tensors_default_hooks,
                    torch._C._autograd._top_saved_tensors_default_hooks)
        finally:
            _control.call_whole(self._exit_job, exc_type is not None)

    # The same in C where the extension is built: Note [An exit that always runs] in tba/_whole_exit.py.
    __exit__ = WholeExit(_exit_in_python, torch._C._autograd._pop_saved_tensors_default_hooks,
                         torch._C._autograd._top_saved_tensors_default_hooks, "_exit_job", "_entered")

    def _not_idle_message(self) -> str:
        """Why an offloader that is not idle cannot be entered, and what to do instead."""
        if self._phase is Phase.DISCARDED and self.reusable:
            return ("this offloader cannot be entered again: an exception left its previous with block, so the "
                    "tensors that block saved were dropped and its spill file closed; build a new tba.Offloader(...) "
                    "(or tba.offload_activations()) for the next step")
        if self._phase is Phase.CLOSED and self.reusable:
            return "this offloader is closed; build a new tba.Offloader(...) to offload again"
        return (f"this offloader cannot be entered now (it is {self._phase.value}): tba.offload_activations() is "
                "one-shot, make a new one each step, or build one tba.Offloader(...) and enter it every step")

    def _exit_job(self, failed: bool) -> None:
        if self._phase is not Phase.ACTIVE and not (self._phase is Phase.CLOSED and self._claim is not None):
            return
        claim, self._claim = self._claim, None
        self._forked_mid_block = False
        self._tracker.detach()
        found = None
        if self._discovery is not None:
            self._discovery.detach()
            found = self._discovery.finish()
            self._discovery.retag(self.layer_saved_bytes)
        if self._tracker.in_whole_model_graph:
            warn_whole_model_compile(self.layers, self._tracker.wrapped_after_given)
        # Note: [A block that saved nothing saved nothing]
        # A with block that only runs the backward of an earlier block's loss (1F1B micro-batches) saves no tensor, but
        # the earlier block's storages are still alive: asked for the largest live storage, the runner took this block
        # for a forward that saved tensors and ran none of its layers, and warned that the plan was not followed.
        saved = self._saves_so_far() != self._saves_at_entry
        largest = self._store.largest_live_storage_bytes if saved else _nothing_saved
        self.policy_runner.exit(failed, largest, found, self._tracker.current is not None,
                                self._store.window.budget_bytes, self._store.unwritten_layer_bytes, owner=claim)
        if self._phase is Phase.CLOSED:
            return
        if failed:
            self._phase = Phase.DISCARDED
            self.close()
            return
        self._phase = Phase.IDLE if self.reusable else Phase.EXITED
        self._store.end_forward(self._tracker.current)
        if self._phase is Phase.EXITED and self._store.live_entries == 0:
            self.close()


def _nothing_saved() -> int:
    """The largest storage a with block that saved nothing saved (Note [A block that saved nothing saved nothing])."""
    return 0
