"""Prefetch window: which storages to read back next during backward.

Backward visits layers in the reverse of forward order, so storages are needed roughly in the
reverse of the order in which they were first saved. The window keeps every storage saved in pack
order and a cursor that only moves down: the lowest pack position unpacked so far. After each
unpack it walks down from the cursor and picks storages to bring into memory:

* with layer tags, every storage of layers ``current-1 .. current-depth_layers`` (storages saved
  outside any layer, such as the embedding, ride along with their neighbours);
* always within the budget: bytes already resident for backward, plus bytes being read, never
  exceed it, except that the first storage below the cursor is always allowed so that a storage
  larger than the budget is still prefetched. The budget is ``prefetch_budget_bytes`` when one was
  given, else the self-sizing :class:`tba.runtime._window.WindowController`'s, which the window
  feeds with the bytes forward wrote, the unpacks that waited and those served from prefetched
  memory.

Note: [Backward through kept layers]
The window holds offloaded storages only; a kept layer's tensors never reach it. Its first walk,
when forward ends, took the layer backward starts in from the last storage it holds: with the last
layers kept (a plan ``OKKKKK``), that was the last offloaded layer's, so the walk read layer 0
back at once, and backward ran through five kept layers with it in memory: the step's peak was
keep-all's (0.94x on the demo's ``small`` preset under tcmalloc). Now the offloader tells the window
the last layer forward ran (:meth:`StorageStore.end_forward`), and each kept tensor carries its
layer: the first unpack of a kept tensor of another layer tells the window that backward is in that
layer (:meth:`StorageStore.backward_reached`), which then reads the layer below it, as an unpack of
an offloaded storage does. A recomputed layer's inputs bypass tba's unpack, so its recomputation
tells the window the same (``_backward_announcer`` in ``tba/runtime/_recompute.py``).

A storage whose write is still in flight is not read: it is marked *hold_for_backward*, which keeps its memory
after the write completes (forwarding). The window decides only; the offloader does the I/O. It is
pure book-keeping, unit-tested without any file.

Note: [The walk resumes where it stopped]
Walking down from the cursor at every unpack re-counted every storage already picked: with a
budget of thousands of storages, each unpack looked at thousands of entries, and backward grew
quadratically with the storages per step. The window keeps the walk's state instead: ``_scan`` is
where the last walk stopped and ``_held`` the bytes it counted below the cursor. The next walk
resumes at ``_scan``; a cursor that moves down subtracts the entries it passes, and an entry that
stops counting (every view unpacked, dead, kept after a failed write) is subtracted once by
:meth:`PrefetchWindow.discount`. Each entry is counted and subtracted at most once per walk
generation (a generation ends when the cursor jumps below the walk, the order is compacted, or a
new forward starts), so an unpack costs O(1) amortised.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator

from tba.defaults import PREFETCH_BUDGET_BYTES, PREFETCH_DEPTH_LAYERS
from tba.runtime._entry import State, StorageEntry
from tba.runtime._window import WindowController


class PrefetchWindow:
    """Pack order of live storages, a backward cursor, and the selection rule.

    Args:
        depth_layers: How many layers below the current one to prefetch. Default 1.
        prefetch_budget_bytes: Bound on bytes held or in flight for backward. Default None: the
            budget of ``controller``.
        controller: The self-sizing budget used while ``prefetch_budget_bytes`` is None (default:
            a fresh :class:`WindowController`); one-shot contexts pass the one their shared
            runtime keeps, so that what one step learnt holds for the next.
    """

    def __init__(
        self,
        depth_layers: int = PREFETCH_DEPTH_LAYERS,
        prefetch_budget_bytes: int | None = PREFETCH_BUDGET_BYTES,
        controller: WindowController | None = None,
    ) -> None:
        self.depth_layers = depth_layers
        self.prefetch_budget_bytes = prefetch_budget_bytes
        self.controller = controller or WindowController()
        self.forward_bytes = 0
        """Bytes of the storages saved since the last :meth:`reset_cursor` (this step's forward)."""
        self._order: list[StorageEntry] = []
        self._seqs: list[int] = []
        self._dead = 0
        self._cursor_seq: int | None = None
        self._in_backward = False
        self._gen = 0
        self._scan = 0
        self._walk_top = 0
        self._held = 0

    @property
    def budget_bytes(self) -> int:
        """Bytes that may be held or in flight for backward now."""
        if self.prefetch_budget_bytes is not None:
            return self.prefetch_budget_bytes
        return self.controller.budget_bytes

    def note_wait(self) -> None:
        """An unpack waited for its read (the self-sizing budget grows)."""
        self.controller.note_wait()

    def note_reads_idle(self) -> None:
        """No read is in flight (in backward, the self-sizing budget may grow on the next wait).

        Not in forward: unpacks inside the ``with`` block (a gradient penalty's ``autograd.grad``)
        would otherwise grow a window that no forward's bytes cap yet.
        """
        if self._in_backward:
            self.controller.note_reads_idle()

    def note_served_from_memory(self) -> None:
        """An unpack in backward found its bytes resident (the self-sizing budget may shrink after the pass)."""
        if self._in_backward:
            self.controller.served_prefetched += 1  # note_served_prefetched, inline: once per unpack

    @property
    def in_backward(self) -> bool:
        """Between the end of a forward and the start of the next one (or the end of its backward)."""
        return self._in_backward

    def __len__(self) -> int:
        return len(self._order) - self._dead

    def __iter__(self) -> Iterator[StorageEntry]:
        """The storages in pack order, dead ones not yet compacted away included."""
        return iter(self._order)

    def add(self, entry: StorageEntry) -> None:
        """Record a new storage; entries must arrive in increasing ``seq``."""
        self._order.append(entry)
        self._seqs.append(entry.seq)
        self.forward_bytes += entry.nbytes

    def forget(self, entry: StorageEntry) -> None:
        """Note that ``entry`` died; compacts the order once half of it is dead."""
        if entry.window_gen == self._gen:  # discount, inline: once per storage in backward (docs/host-cost.md)
            entry.window_gen = -1
            self._held -= entry.nbytes
        self._dead += 1
        if self._dead * 2 > len(self._order):
            self._order = [e for e in self._order if e.state is not State.DEAD]
            self._seqs = [e.seq for e in self._order]
            self._dead = 0
            self._gen += 1
            self._scan = self._walk_top = self._held = 0

    def clear(self) -> None:
        """Forget every storage (a forked child drops its parent's entries)."""
        self._order, self._seqs, self._dead, self._cursor_seq = [], [], 0, None
        self._gen += 1
        self._scan = self._walk_top = self._held = 0

    def reset_cursor(self) -> None:
        """A new forward starts: the last backward pass is over; the next one starts from the end."""
        if self._in_backward:
            self.controller.end_pass()
        self.forward_bytes = 0
        self._in_backward = False
        self.new_pass()

    def new_pass(self) -> None:
        """A backward pass begins (Note [Each backward pass reads ahead] in ``tba/runtime/_unpacked.py``): the cursor
        goes back to the end, wherever the last pass left it, and the walk starts again from there."""
        self._cursor_seq = None
        self._gen += 1
        self._scan = self._walk_top = self._held = 0

    def end_forward(self) -> None:
        """Forward is over: the window is sized for its backward from the bytes it wrote."""
        if not self._in_backward:
            self._in_backward = True
            self.controller.start_pass(self.forward_bytes)

    def end_backward(self) -> None:
        """Every storage of this window died: the pass is over (a one-shot context's last event)."""
        if self._in_backward:
            self._in_backward = False
            self.controller.end_pass()

    def discount(self, entry: StorageEntry) -> None:
        """``entry`` no longer counts against the budget (fully unpacked, dead, or kept in memory)."""
        if entry.window_gen == self._gen:
            entry.window_gen = -1
            self._held -= entry.nbytes

    def _restart(self, top: int) -> None:
        """Start a new walk generation at ``top``: nothing below it is counted yet."""
        self._gen += 1
        self._scan = self._walk_top = top
        self._held = 0

    def select(self, unpacked: StorageEntry | None, layer: int | None = None) -> tuple[list[StorageEntry], list[StorageEntry]]:
        """Move the cursor to ``unpacked`` (None: leave it, at the end before backward's first unpack) and pick work.

        ``layer`` (with ``unpacked`` None): the layer backward is in, known from outside the window (Note [Backward
        through kept layers]); storages of layers below ``layer - depth_layers`` are not picked yet.

        Returns:
            ``(to_read, to_hold)``: on-disk storages to read now, and storages whose write is in
            flight that should stay in memory when it completes.
        """
        if unpacked is not None and (self._cursor_seq is None or unpacked.seq < self._cursor_seq):
            self._cursor_seq = unpacked.seq
        order = self._order
        top = len(order) if self._cursor_seq is None else bisect.bisect_left(self._seqs, self._cursor_seq)
        if top > self._walk_top or top <= self._scan:
            self._restart(top)
        else:
            gen = self._gen
            for index in range(top, self._walk_top):
                entry = order[index]
                if entry.window_gen == gen:
                    entry.window_gen = -1
                    self._held -= entry.nbytes
            self._walk_top = top
        if unpacked is not None:
            layer = unpacked.layer
        elif layer is None:
            layer = self._last_layer(top)
            layer = None if layer is None else layer + 1
        to_read: list[StorageEntry] = []
        to_hold: list[StorageEntry] = []
        budget = self.budget_bytes
        floor = None if layer is None else layer - self.depth_layers
        gen = self._gen
        held = self._held
        index = self._scan
        while index > 0:
            entry = order[index - 1]
            state = entry.state
            if state is State.DEAD or entry.fully_unpacked or (state is State.KEPT and not entry.hold_for_backward):
                # A held storage whose write was skipped is KEPT but still in memory for backward: it counts.
                index -= 1
                continue
            if floor is not None and entry.layer is not None and entry.layer < floor:
                break
            if held and held + entry.nbytes > budget:
                break
            index -= 1
            held += entry.nbytes
            entry.window_gen = gen
            if entry.data is None and entry.read_done is None and state is State.ON_DISK:
                to_read.append(entry)
            elif state is State.WRITING and not entry.hold_for_backward:
                to_hold.append(entry)
        self._held = held
        self._scan = index
        return to_read, to_hold

    def _last_layer(self, top: int) -> int | None:
        for index in range(top - 1, -1, -1):
            if self._order[index].layer is not None:
                return self._order[index].layer
        return None
