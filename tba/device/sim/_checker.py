"""Happens-before checking of device memory accesses with vector clocks.

Participants are the simulated streams, the host (every host thread together: host threads order
their own work with locks and queues, which this checker does not see) and one participant per
kvikio transfer. Each keeps a vector clock, as PyTorch's CUDA sanitizer does:

* an access on participant ``p`` ticks ``p``'s own entry and is stamped with it;
* recording an event copies the stream's clock into the event; ``wait_event`` merges it into the
  waiting stream, host ``synchronize`` merges it into the host;
* a launch from the host merges the host's clock into the stream (work queued after the host saw
  an event complete runs after that event).

Two accesses to overlapping byte ranges, at least one a write, by different participants, race
unless the earlier one's stamp is covered by the later one's clock. Unlike
``torch.cuda._sanitizer.EventHandler``, which keys accesses by exact data pointer, accesses here are
byte ranges: a staged copy reads a slice of a storage, and a pooled block is a slice of a slab.

Note: [Superseded records]
A write that covers older records replaces them: if it raced with one of them that was reported
then; if not, everything ordered after the write is ordered after them too. A read replaces only
a read of the same bytes by the same participant.

Note: [A read keeps the write it follows]
A read of the same bytes by the same participant replaced that participant's write too, so a
tensor a kernel produced and the next kernel read (nearly every saved activation: the output of
``linear`` read by ``gelu``) was left with a read record only: a copy on the side stream that did
not wait for the producer's event then met a read, not a write, and no race was reported (a review
removed ``wait_event(after)`` from ``CudaOps._queue_copies``: the simulator passed,
tests/device/test_sim_checker.py). A read is ordered after the write only for those ordered after
the read, not for everyone: the write stays.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass

HOST = "host"


@dataclass
class _Access:
    start: int
    end: int
    write: bool
    who: str
    stamp: int
    what: str


class HappensBefore:
    """Vector clocks per participant and the last accesses per byte range; collects races."""

    def __init__(self, max_races: int = 20) -> None:
        self._lock = threading.RLock()
        self._clocks: dict[str, dict[str, int]] = {HOST: {HOST: 0}}
        self._starts: list[int] = []
        self._records: list[_Access] = []
        self._longest = 0
        self._free_names: list[str] = []
        self.races: list[str] = []
        self.accesses = 0
        self._max_races = max_races

    def _clock(self, who: str) -> dict[str, int]:
        clock = self._clocks.get(who)
        if clock is None:
            clock = self._clocks[who] = {who: 0}
        return clock

    def snapshot(self, who: str) -> dict[str, int]:
        """``who``'s clock after one tick (what an event recorded now carries)."""
        with self._lock:
            clock = self._clock(who)
            clock[who] = clock.get(who, 0) + 1
            return dict(clock)

    def merge(self, who: str, other: dict[str, int] | None) -> None:
        """``who`` now happens after everything ``other`` covers."""
        if not other:
            return
        with self._lock:
            clock = self._clock(who)
            for name, stamp in other.items():
                if clock.get(name, 0) < stamp:
                    clock[name] = stamp

    def quiesce(self, streams: list[str]) -> None:
        """The device ran its last work on ``streams``: every participant is now ordered after all of it
        (a broken context, Note [A broken context] in ``tba/device/sim/_faults.py``)."""
        with self._lock:
            for stream in streams:
                done = dict(self._clock(stream))
                for who in list(self._clocks):
                    self.merge(who, done)

    def launch(self, stream: str) -> None:
        """Work queued on ``stream`` by the host runs after what the host has seen complete."""
        with self._lock:
            self.merge(stream, self._clocks[HOST])

    def spawn(self, prefix: str) -> str:
        """A participant that starts where the host is now (an asynchronous host-side transfer).

        Names of retired participants are reused (as threads are), so clocks do not grow with the
        number of transfers; a reused name starts from the host's entry for it, past its old stamps.
        """
        with self._lock:
            name = self._free_names.pop() if self._free_names else f"{prefix}{len(self._clocks)}"
            host = self._clocks[HOST]
            self._clocks[name] = dict(host)
            self._clocks[name][name] = host.get(name, 0)
            return name

    def retire(self, name: str) -> dict[str, int]:
        """End participant ``name``; returns its last clock (to merge into whoever waited for it)."""
        with self._lock:
            self._free_names.append(name)
            return self._clocks.pop(name, {})

    def _overlapping(self, start: int, end: int) -> list[tuple[int, _Access]]:
        """Index and record of each recorded access that overlaps ``[start, end)``, in order (the lock held)."""
        low = bisect.bisect_left(self._starts, start - self._longest)
        high = bisect.bisect_left(self._starts, end)
        return [(index, old) for index, old in enumerate(self._records[low:high], low) if old.end > start]

    def _race(self, head: str, old: _Access) -> None:
        """Note that ``head`` (what happens now, and where) is not ordered after ``old`` (the lock held)."""
        if len(self.races) < self._max_races:
            self.races.append(f"{head} is not ordered after {old.what} ({'write' if old.write else 'read'} of "
                              f"[{old.start:#x}, {old.end:#x}) on {old.who})")

    def _drop(self, indices: list[int]) -> None:
        """Forget the records at ``indices`` (ascending; the lock held)."""
        for index in reversed(indices):
            del self._starts[index]
            del self._records[index]

    def last_writer(self, start: int, nbytes: int, among: set[str]) -> str | None:
        """The participant in ``among`` whose write of bytes in ``[start, start + nbytes)`` is the latest recorded."""
        with self._lock:
            writes = [old for _, old in self._overlapping(start, start + nbytes) if old.write and old.who in among]
            return max(writes, key=lambda old: old.stamp).who if writes else None

    def free(self, who: str, start: int, nbytes: int, what: str, of: tuple[str, ...]) -> None:
        """``[start, start + nbytes)`` is freed to ``who`` (the next kernel there may overwrite it): every access
        whose description starts with one of ``of`` by another participant must be ordered before; the bytes are then
        fresh (their records go)."""
        end = start + nbytes
        with self._lock:
            clock = self._clock(who)
            gone = []
            for index, old in self._overlapping(start, end):
                if old.who != who and old.what.startswith(of) and old.stamp > clock.get(old.who, 0):
                    self._race(f"{what} (of [{start:#x}, {end:#x}) to {who})", old)
                if start <= old.start and old.end <= end:
                    gone.append(index)
            self._drop(gone)

    def access(self, who: str, start: int, nbytes: int, write: bool, what: str) -> None:
        """Record an access of ``[start, start + nbytes)`` by ``who``; notes a race with any unordered one."""
        if nbytes <= 0:
            return
        end = start + nbytes
        with self._lock:
            self.accesses += 1
            clock = self._clock(who)
            stamp = clock[who] = clock.get(who, 0) + 1
            superseded = []
            for index, old in self._overlapping(start, end):
                if old.who != who and (write or old.write) and old.stamp > clock.get(old.who, 0):
                    self._race(f"{what} ({'write' if write else 'read'} of [{start:#x}, {end:#x}) on {who})", old)
                # Note [Superseded records]: a read never supersedes a write (Note [A read keeps the write it follows])
                if (write and start <= old.start and old.end <= end) or (
                        old.who == who and not old.write and old.start == start and old.end == end):
                    superseded.append(index)
            self._drop(superseded)
            at = bisect.bisect_right(self._starts, start)
            self._starts.insert(at, start)
            self._records.insert(at, _Access(start, end, write, who, stamp, what))
            self._longest = max(self._longest, nbytes)
