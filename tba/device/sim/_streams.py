"""Simulated streams and events: ordered queues run by one scheduler thread, with adversarial delays.

By default every stream, the compute (default) stream too, is a queue that the scheduler thread
runs in order (Note [The compute stream lags too] in ``tba/device/sim/_device.py``). Only a device without
``lagging_compute`` has a synchronous compute stream: its work runs on the launching thread at
launch, as if the device kept up with the host, and ``wait_event`` on it blocks the host until the
event fired. The scheduler picks among the streams whose head can run, at random, sleeping a
little between operations and now and then pausing one stream for a long while (a side stream
lagging a whole forward). Events are tokens
that fire when the scheduler reaches their record; ``wait_event`` queues a wait on the token the
event held when it was called (an event never recorded is no wait), as in CUDA.
"""

from __future__ import annotations

import collections
import random
import threading
import time
from collections.abc import Callable
from typing import Any

HANG_TIMEOUT_S = 60.0
"""A wait on the simulated device longer than this is reported as a hang."""


class Token:
    """One record of an event: fires when the stream reaches it."""

    def __init__(self, scheduler: Scheduler, clock: dict[str, int] | None) -> None:
        self.fired = threading.Event()
        self.clock = clock
        self.captured = False
        self.stream: SimStream | None = None
        self._scheduler = scheduler

    def fire(self) -> None:
        self.fired.set()
        self._scheduler.wake()


class SimStream:
    """An ordered queue of device work (a CUDA stream)."""

    def __init__(self, sim: Any, name: str, synchronous: bool = False) -> None:
        self.sim = sim
        self.name = name
        self.synchronous = synchronous
        self.queue: collections.deque = collections.deque()
        self.paused_until = 0.0
        self.joined_capture = False

    def __repr__(self) -> str:
        return f"<simulated stream {self.name}>"

    def wait_event(self, event: Any) -> None:
        self.sim.stream_wait(self, event)

    def record_event(self, event: Any = None) -> Any:
        event = event if event is not None else self.sim.Event()
        event.record(self)
        return event

    def synchronize(self) -> None:
        """``cudaStreamSynchronize``: no event is created (an injected ``record`` fault does not apply)."""
        self.sim.maybe_fail("synchronize")  # Note [Injected CUDA faults] in tba/device/sim/_faults.py
        event = self.sim.Event(blocking=True)
        event.token = self.sim.record(self)
        event.synchronize()

    def query(self) -> bool:
        """Whether all queued work ran: the scheduler pops an operation before it runs it."""
        return not self.queue and self.sim.scheduler.running is not self


class SimEvent:
    """A CUDA event on the simulated device."""

    def __init__(self, sim: Any, blocking: bool = False) -> None:
        self.sim = sim
        self.blocking = blocking
        self.token: Token | None = None

    def record(self, stream: SimStream | None = None) -> None:
        self.sim.maybe_fail("record")  # Note [Injected CUDA faults] in tba/device/sim/_faults.py
        self.token = self.sim.record(stream if stream is not None else self.sim.current_stream())

    def wait(self, stream: SimStream | None = None) -> None:
        (stream if stream is not None else self.sim.current_stream()).wait_event(self)

    def query(self) -> bool:
        self.sim.check_alive()  # Note [A broken context] in tba/device/sim/_faults.py
        token = self.token
        if token is None:
            return True
        if token.captured:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing (event query)")
        if token.fired.is_set():
            self.sim.checker.merge("host", token.clock)
            return True
        return False

    def synchronize(self) -> None:
        self.sim.maybe_fail("synchronize")  # Note [Injected CUDA faults] in tba/device/sim/_faults.py
        self.wait_fired()

    def wait_fired(self) -> None:
        """Block the host until the record fired (``synchronize`` without its injected fault)."""
        token = self.token
        if token is None:
            return
        if token.captured:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing "
                               "(cudaEventSynchronize of an event recorded during graph capture)")
        if not self.blocking:
            self.sim.note_busy_wait()
        self.sim.wait_token(token, "an event synchronize")
        self.sim.checker.merge("host", token.clock)


class Scheduler:
    """Runs the asynchronous streams' queues on one thread, in stream order, with random delays.

    Args:
        seed: Seed of the delays.
        max_delay_s: Longest sleep between two operations.
        lag_probability: Chance, per operation, that its stream then pauses for up to ``max_lag_s``.
        max_lag_s: Longest pause of one stream.
    """

    def __init__(self, seed: int, max_delay_s: float, lag_probability: float, max_lag_s: float) -> None:
        self._rng = random.Random(seed)
        self.max_delay_s = max_delay_s
        self.lag_probability = lag_probability
        self.max_lag_s = max_lag_s
        self._cond = threading.Condition()
        self._streams: list[SimStream] = []
        self._stopping = False
        self.held = False
        self.operations = 0
        self.running: SimStream | None = None
        """The stream whose operation the scheduler thread is running now (popped from its queue)."""
        self._thread = threading.Thread(target=self._run, name="tba-sim-scheduler", daemon=True)
        self._thread.start()

    def add(self, stream: SimStream) -> None:
        with self._cond:
            self._streams.append(stream)

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def launch(self, stream: SimStream, op: Callable[[], None] | Token) -> None:
        """Queue ``op`` (a callable, or a :class:`Token` to wait for) on ``stream``."""
        with self._cond:
            stream.queue.append(op)
            self._cond.notify_all()

    def _pick(self) -> tuple[SimStream, Any] | None:
        if self.held:
            return None
        now = time.monotonic()
        ready = []
        for stream in self._streams:
            if not stream.queue or stream.paused_until > now:
                continue
            head = stream.queue[0]
            if isinstance(head, Token) and not head.fired.is_set():
                continue
            ready.append(stream)
        if not ready:
            return None
        stream = self._rng.choice(ready)
        return stream, stream.queue.popleft()

    def _run(self) -> None:
        while True:
            with self._cond:
                picked = self._pick()
                while picked is None:
                    if self._stopping and not any(s.queue for s in self._streams):
                        return
                    self._cond.wait(0.002)
                    picked = self._pick()
                stream, op = picked
                self.running = stream
                delay = self._rng.random() * self.max_delay_s
                if self._rng.random() < self.lag_probability:
                    stream.paused_until = time.monotonic() + self._rng.random() * self.max_lag_s
            try:
                if not isinstance(op, Token):
                    op()
            finally:
                with self._cond:
                    self.running = None
                    self.operations += 1
                    self._cond.notify_all()
            if delay:
                time.sleep(delay)

    def discard(self) -> list[SimStream]:
        """Drop every queued operation (a broken context runs none of them: Note [A broken context] in
        ``tba/device/sim/_faults.py``); returns the streams."""
        with self._cond:
            for stream in self._streams:
                stream.queue.clear()
            self._cond.notify_all()
            return list(self._streams)

    def catch_up(self, stream: SimStream) -> None:
        """Block the calling host thread until everything queued on ``stream`` so far has run.

        Not a synchronisation the race checker sees (the host learns nothing): it stands in for the
        device running a kernel launched on ``stream`` only after the work queued before it there.
        """
        if stream.synchronous:
            return
        with self._cond:
            if not stream.queue and self.running is not stream:
                return
        token = Token(self, None)
        self.launch(stream, token.fire)
        stream.sim.wait_token(token, f"{stream.name} running its queue")

    def idle(self) -> bool:
        with self._cond:
            return not any(s.queue for s in self._streams)

    def stop(self) -> None:
        """Run what is queued (pauses cut short), then end the thread."""
        with self._cond:
            self._stopping = True
            self.held = False
            self.max_lag_s = self.max_delay_s = 0.0
            for stream in self._streams:
                stream.paused_until = 0.0
            self._cond.notify_all()
        self._thread.join(HANG_TIMEOUT_S)
