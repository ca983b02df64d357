"""Late writes for the differential fuzzer: an engine that queues tba's writes and starts them late, in random order.

On a fast disk and with small models, every write a fuzz case makes is done long before backward
asks for its storage, so the differential check never saw the paths where it is not (Note [Writes
that queue in the fuzzer]). A case may draw :class:`LateWrites`; :func:`late_engine` then wraps the
case's engine in a :class:`LateWriteEngine`, handed to tba as ``backend`` (an :class:`~tba.io.Engine`
instance, the public seam), which:

* asks tba to keep only ``write_ahead_bytes`` of writes in the engine (:attr:`tba.io.Engine.write_ahead_bytes`),
  so that the others wait in tba's queue and are asked, just before they go, whether anybody still
  needs them (Note [A write nobody needs is not started] in ``tba/device/_protocol.py``);
* holds every write it is handed, unstarted, in a list: a thread of its own starts them, a random
  number at a time, picked at random from the list, after a pause of ``pause_s`` each time, so that
  writes start and complete late and out of order, while forward saves more, while backward unpacks,
  after the storage died;
* sends reads on at once (backward's reads go ahead of the held writes, as tba sends them).

The picks come from a generator seeded by the case's seed, so they are the same on every run; which
writes are in the list when a pick is made depends on the machine's timing. Closing starts the writes
still held and waits for them.

Note: [Writes that queue in the fuzzer]
The paths that only a slow write reaches: a storage unpacked while its write waits in tba's queue or
is in flight (served from memory), a write skipped because its storage died, was fully unpacked or is
held by the prefetch window for backward (the storage then stays in memory, KEPT, for a second backward
through a retained graph), a write that completes after its storage died (its extent freed), and a
``flush()`` that waits for writes the engine starts late. Each of them once hid a defect that only a
hand-written test with a held engine found (``tests/runtime/test_unpack_race.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from tba.errors import EngineClosedError
from tba.io import Engine, Op, Request, make_engine

WRITE_AHEAD_CHOICES_BYTES = (1, 64 * 1024, 1 << 20)
"""Allowances drawn for writes in the engine: one storage at a time, a few, many."""
PAUSE_CHOICES_S = (0.0, 0.0002, 0.001)
"""Pauses drawn for the releasing thread before each start of held writes."""
MOST_STARTED_CHOICES = (1, 4)
"""Most held writes started at once, drawn."""

Callback = Callable[[BaseException | None], None]


@dataclasses.dataclass(frozen=True)
class LateWrites:
    """How a case's writes queue and start late (Note [Writes that queue in the fuzzer])."""

    write_ahead_bytes: int
    pause_s: float
    most_started: int


def draw_late_writes(rng: random.Random) -> LateWrites | None:
    """None (writes go at once) for half the draws, else a :class:`LateWrites` drawn from ``rng``."""
    if rng.random() < 0.5:
        return None
    return LateWrites(rng.choice(WRITE_AHEAD_CHOICES_BYTES), rng.choice(PAUSE_CHOICES_S), rng.choice(MOST_STARTED_CHOICES))


class LateWriteEngine(Engine):
    """``inner``, with its writes held and started late in random order (see the module's docstring)."""

    name = "late-writes"

    def __init__(self, inner: Engine, late: LateWrites, seed: int) -> None:
        self.inner = inner
        self.late = late
        self.vectored = inner.vectored
        self.write_ahead_bytes = late.write_ahead_bytes
        self.writes_held = 0
        """Writes handed to this engine (each waited in the list)."""
        self.reads_behind_held_writes = 0
        """Reads sent while a write was held: backward read back while writes were still to come."""
        self._rng = random.Random(seed)
        self._held: list[tuple[Request, Callback]] = []
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._release, name="tba-fuzz-late-writes", daemon=True)
        self._thread.start()

    def submit_many(self, requests: Sequence[Request]) -> list[Future]:
        futures = [Future() for _ in requests]
        self.submit_calls(requests, [_resolving(future, request.nbytes)
                                     for future, request in zip(futures, requests)])
        return futures

    def submit_calls(self, requests: Sequence[Request], on_done: Sequence[Callback]) -> None:
        reads, read_calls = [], []
        with self._cond:
            if self._closed:
                raise EngineClosedError("engine is closed")  # as tba's own engines refuse
            for request, callback in zip(requests, on_done):
                if request.op is Op.WRITE:
                    self._held.append((request, callback))
                    self.writes_held += 1
                else:
                    reads.append(request)
                    read_calls.append(callback)
            if reads and self._held:
                self.reads_behind_held_writes += len(reads)
            self._cond.notify()
        if reads:
            # Note: [A late engine that took writes never raises]
            # The writes of this batch are held already: raised, the inner engine's refusal of the reads
            # reached every callback of the batch (tba's ``HostBatch`` calls each one with the error of a
            # refused submission, in ``tba/runtime/_host_io.py``), and the held writes heard theirs a
            # second time when started. So the reads hear it alone, each through its callback.
            try:
                self.inner.submit_calls(reads, read_calls)
            except Exception as err:  # noqa: BLE001 - each read hears it, as from an engine that failed it
                for callback in read_calls:
                    callback(err)

    def _release(self) -> None:
        """Start held writes, a random number at a time, picked at random, until closed with none held."""
        while True:
            with self._cond:
                while not self._held and not self._closed:
                    self._cond.wait()
                if not self._held:
                    return
                pause_s = 0.0 if self._closed else self.late.pause_s
            if pause_s:
                time.sleep(pause_s)
            with self._cond:
                count = min(len(self._held), self._rng.randint(1, self.late.most_started))
                taken = [self._held.pop(self._rng.randrange(len(self._held))) for _ in range(count)]
            try:
                self.inner.submit_calls([request for request, _ in taken], [callback for _, callback in taken])
            except Exception as err:  # noqa: BLE001 - each write hears it, as from any engine that refuses
                for _, callback in taken:
                    callback(err)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()
        self.inner.close()


def _resolving(future: Future, nbytes: int) -> Callback:
    """A completion callback that resolves ``future`` as :meth:`Engine.submit_many` promises."""
    def done(error: BaseException | None) -> None:
        if error is None:
            future.set_result(nbytes)
        else:
            future.set_exception(error)
    return done


def late_engine(late: LateWrites | None, seed: int, backend: str) -> Any:
    """A context manager giving the case's :class:`LateWriteEngine` over ``backend`` (closed on exit), or None
    when the case draws no late writes."""
    if late is None:
        return contextlib.nullcontext()
    return LateWriteEngine(make_engine(backend), late, seed)
