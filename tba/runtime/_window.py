"""A prefetch window that sizes itself from what backward measures.

A fixed read-ahead budget is wrong on almost every machine: too small and backward waits for the
disk, too large and read-back bytes pile up in memory long before they are used, which is the
memory tba exists to save. :class:`WindowController` replaces the fixed number with a feedback
loop, one decision per event:

* **An unpack waited** for its read: read-ahead was too shallow, unless the disk was reading all
  along (see Note [A window grows only when it held the disk back]). Beyond ``tolerated_waits``
  per pass, the window grows by ``grow_factor`` at once, so a first step that starts too small
  catches up within that step.
* **A backward pass ended with no more than ``tolerated_waits`` waits** while prefetched reads
  were served from memory: reads sat idle before use. The window shrinks by ``shrink_factor`` for
  the next pass, down to ``min_bytes``.
* The window is never above ``max_fraction`` of the bytes the current forward wrote (nor below
  ``min_bytes``), so read-ahead stays a fraction of what offloading saved.

Note: [A window grows only when it held the disk back]
A wait has two causes. The window may have held reads back: the engine had nothing in flight at
some moment, so a read issued earlier would have been ready. Or the disk reads slower than
backward consumes: reads were in flight all along, and a larger window would read no faster, only
hold more read-back bytes longer. The controller grows only after the first: the store reports
each moment the read engine runs out of reads (:meth:`WindowController.note_reads_idle`), counted
once the pass has unpacked something, and a grow uses that report up. A pass starts with none, so
a disk-bound backward does not grow the window once per step either (a review found it reaching
its cap of a quarter of forward's bytes after 13 such steps). On the ``deep`` preset at 185
samples (7 GB read back at about 1 GB/s, backward consuming faster) every wait used to grow the
window by 1.5x: 8 or 10 waits, depending on the disk's pace, left it at 134 or 301 MiB, and the
step's peak at 432 or 605-628 MiB, in otherwise identical runs.

The controller only computes a number of bytes; :class:`tba.runtime._prefetch.PrefetchWindow`
applies it. It is pure, and unit-tested without any file or clock.
"""

from __future__ import annotations

from tba import defaults


class WindowController:
    """Read-ahead budget in bytes, grown on waits and shrunk after idle passes.

    Args:
        initial_bytes: Budget before anything was measured. Default
            :data:`tba.defaults.PREFETCH_WINDOW_INITIAL_BYTES`.
        min_bytes: Smallest budget. Default :data:`tba.defaults.PREFETCH_WINDOW_MIN_BYTES`.
        max_fraction: Largest budget as a fraction of the bytes written by the current forward.
            Default :data:`tba.defaults.PREFETCH_WINDOW_MAX_FRACTION`.
        grow_factor: Budget multiplier after an unpack waited. Default 1.5.
        shrink_factor: Budget multiplier after a pass with no wait. Default 0.95.
        tolerated_waits: Waits per pass that neither grow nor prevent shrinking. Default 1.
    """

    def __init__(
        self,
        initial_bytes: int = defaults.PREFETCH_WINDOW_INITIAL_BYTES,
        min_bytes: int = defaults.PREFETCH_WINDOW_MIN_BYTES,
        max_fraction: float = defaults.PREFETCH_WINDOW_MAX_FRACTION,
        grow_factor: float = defaults.PREFETCH_WINDOW_GROW_FACTOR,
        shrink_factor: float = defaults.PREFETCH_WINDOW_SHRINK_FACTOR,
        tolerated_waits: int = defaults.PREFETCH_WINDOW_TOLERATED_WAITS,
    ) -> None:
        if not 0 < shrink_factor <= 1 <= grow_factor:
            raise ValueError(f"need 0 < shrink_factor <= 1 <= grow_factor, got {shrink_factor}, {grow_factor}")
        self.min_bytes = min_bytes
        self.max_fraction = max_fraction
        self.grow_factor = grow_factor
        self.shrink_factor = shrink_factor
        self.tolerated_waits = tolerated_waits
        self.target_bytes = max(initial_bytes, min_bytes)
        """The budget before the cap by forward bytes is applied."""
        self.forward_bytes = 0
        """Bytes written by the forward whose backward is running (set by :meth:`start_pass`)."""
        self.waits = 0
        """Unpacks that waited in the current pass."""
        self.reads_idled = False
        """The read engine ran out of reads, after this pass's first unpack, since the last grow: a
        wait may grow the window."""
        self.served_prefetched = 0
        """Unpacks served from prefetched memory in the current pass."""
        self.passes = 0

    @property
    def budget_bytes(self) -> int:
        """The read-ahead budget in force: the target, capped by ``max_fraction`` of forward's bytes."""
        cap = int(self.max_fraction * self.forward_bytes) if self.forward_bytes else self.target_bytes
        return max(self.min_bytes, min(self.target_bytes, cap))

    def start_pass(self, forward_bytes: int) -> None:
        """A forward has ended having written ``forward_bytes``; its backward is next."""
        self.forward_bytes = forward_bytes
        self.waits = 0
        self.served_prefetched = 0
        self.reads_idled = False

    def note_reads_idle(self) -> None:
        """The read engine has nothing in flight: once backward has unpacked something, the window,
        not the disk, is what holds reads back (before that, forward's last reads merely finished
        ahead of a backward that had not started)."""
        if self.waits or self.served_prefetched:
            self.reads_idled = True

    def note_wait(self) -> None:
        """An unpack had to wait for its read: grow now (within the cap), if reads idled since the last grow."""
        self.waits += 1
        if self.waits <= self.tolerated_waits or not self.reads_idled:
            return
        self.reads_idled = False
        grown = int(self.budget_bytes * self.grow_factor)
        self.target_bytes = max(self.target_bytes, grown)
        if self.forward_bytes:
            self.target_bytes = min(self.target_bytes, max(self.min_bytes, int(self.max_fraction * self.forward_bytes)))

    def note_served_prefetched(self) -> None:
        """An unpack found its bytes already read back."""
        self.served_prefetched += 1

    def end_pass(self) -> None:
        """Backward is over: a pass with prefetched reads served and no wait shrinks the window."""
        if self.forward_bytes == 0 and self.waits == 0 and self.served_prefetched == 0:
            return
        self.passes += 1
        if self.waits <= self.tolerated_waits and self.served_prefetched > 0:
            self.target_bytes = max(self.min_bytes, int(self.budget_bytes * self.shrink_factor))
        self.forward_bytes = 0
        self.waits = 0
        self.served_prefetched = 0
