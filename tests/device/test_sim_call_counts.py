"""The CUDA calls tba makes per saved storage, pinned (issue 25: the device path's host cost per storage).

On an H200 the device path cost 300-460 us of extra host time per 64 KiB storage against ~50 us on
the CPU path (docs/gpu.md, "The fourth run"), much of it in Python calls into ``torch.cuda``. Every
such call goes through one seam (``tba.device.cuda_api()``); here the simulated device's seam, its
events and its streams count the calls tba makes, over ``N`` leaf tensors through ``torch.tanh`` (as
``python -m tba bench-hooks --device cuda``), and each count is pinned: per storage written in
forward, per storage read back in backward, and per unpack. A call added per storage fails here.
"""

from __future__ import annotations

import collections
import contextlib
import sys
import threading
from concurrent.futures import Future

import pytest
import torch

import tba
from tba import _control
from tba.device._staged_route import StagedRoute
from tba.device.sim import fake_kvikio
from tba.device.sim._streams import SimEvent, SimStream

N = 16
SIZE = 64 << 10
SEAM = ("Event", "current_stream", "stream", "device", "is_current_stream_capturing", "synchronize", "copy_", "empty",
        "record_stream")

# Counted over a whole step (a read may start before forward ended): per pack (the training thread marks
# the producer), per storage written (a write may still be skipped: Note [A write nobody needs is not
# started]), per storage read back, per unpack. Before issue 25 the staged route also entered
# ``cuda.device`` once per write and twice per read (Note [A stream context selects its device]), and
# built a ``concurrent.futures.Future`` per file transfer (Note [A block's file transfer reports by callback]);
# the kvikio route one per write and per read (Note [kvikio's completions are queued to tba's own waiters]).
PACK = {"current_stream": 1, "is_current_stream_capturing": 1, "Event": 1, "Event.record": 1}
# The staged route copies the writes queued together into one block, with one stream context and one
# event per block (Note [Storages queued together share a block]): "group" is per block written.
STAGED = {
    "pack": PACK,
    "write": {"Stream.wait_event": 1, "copy_": 1},
    "group": {"Event": 1, "Event.record": 1, "Event.synchronize": 1, "stream": 1},
    "read": {"Stream.wait_event": 1, "copy_": 1, "empty": 1},
    "read_group": {"Event": 2, "Event.record": 2, "Event.synchronize": 1, "Stream.wait_event": 1, "stream": 2},
    "unpack": {"current_stream": 1},
}
KVIKIO = {
    "pack": PACK,
    "write": {"Event.synchronize": 1},
    "group": {},
    "read_group": {},
    "read": {"Event": 1, "Event.record": 1, "Event.synchronize": 1, "stream": 1, "empty": 1},
    "unpack": {"current_stream": 1},
}


class _Counter:
    """Counts calls made from tba's own modules (not the simulator's) to the seam, events and streams."""

    def __init__(self, sim, monkeypatch) -> None:
        self.counts: collections.Counter = collections.Counter()
        self._lock = threading.Lock()
        for name in SEAM:
            monkeypatch.setattr(sim, name, self._wrap(getattr(sim, name), name))
        for owner, names in ((SimEvent, ("record", "synchronize", "wait", "query")), (SimStream, ("wait_event", "record_event"))):
            for name in names:
                monkeypatch.setattr(owner, name, self._wrap(getattr(owner, name), f"{owner.__name__[3:]}.{name}"))
        monkeypatch.setattr(Future, "__init__", self._wrap(Future.__init__, "Future"))

    def _wrap(self, inner, label):
        def counted(*args, **kwargs):
            frame = sys._getframe(1)
            while frame.f_globals.get("__name__", "").startswith("concurrent.futures"):  # an executor's submit
                frame = frame.f_back
            caller = frame.f_globals.get("__name__", "")
            if caller.startswith("tba") and not caller.startswith("tba.device.sim"):
                with self._lock:
                    self.counts[label] += 1
            return inner(*args, **kwargs)

        return counted

    def take(self) -> dict[str, int]:
        with self._lock:
            taken, self.counts = dict(self.counts), collections.Counter()
        return taken


def _expected(per: dict[str, dict[str, int]], **times: int) -> dict[str, int]:
    total: collections.Counter = collections.Counter()
    for what, count in times.items():
        for name, calls in per[what].items():
            total[name] += calls * count
    return {name: calls for name, calls in total.items() if calls}


@pytest.mark.parametrize("route", ["staged", "kvikio"])
def test_cuda_calls_per_storage(sim, tmp_path, monkeypatch, route):
    leaves = [torch.randn(SIZE // 4, requires_grad=True) for _ in range(N)]
    groups, read_groups = collections.Counter(), collections.Counter()

    def counting(name, counts):
        send = getattr(StagedRoute, name)

        def counted_send(self, group):
            counts[len(group.members)] += 1
            send(self, group)

        monkeypatch.setattr(StagedRoute, name, counted_send)

    counting("_send", groups)
    counting("_send_read", read_groups)
    with fake_kvikio(sim, gds=True) if route == "kvikio" else contextlib.nullcontext():
        off = tba.Offloader(tmp_path, min_offload_bytes=0, prefetch_budget_bytes=0,
                            **({"backend": "kvikio"} if route == "kvikio" else {}))
        counter = None
        for _ in range(2):  # the first step builds the route (streams, pinned pool), the second is counted
            read_before, written_before = off.stats.bytes_read, off.stats.storages_written
            if counter is not None:
                counter.take()
                groups.clear()
                read_groups.clear()
            with off:
                outputs = [torch.tanh(leaf).sum() for leaf in leaves]
            _control.settle()
            off._store.flush()  # every write is over before backward: none is skipped, or half done
            engine = off._store.engine.name
            torch.autograd.backward(outputs)
            del outputs
            _control.settle()
            counter = counter or _Counter(sim, monkeypatch)
        off.close()  # waits for the last completions
        counted = counter.take()
    per = STAGED if route == "staged" else KVIKIO
    reads = (off.stats.bytes_read - read_before) // SIZE
    written = off.stats.storages_written - written_before
    assert written >= N - 2 and reads > N // 2
    blocks, read_blocks = sum(groups.values()), sum(read_groups.values())
    if route == "staged":  # forward's saves reach the stager in batches: some of their writes share a block
        assert sum(size * count for size, count in groups.items()) == written
        assert sum(size * count for size, count in read_groups.items()) == reads
        assert blocks < written, groups
    expected = _expected(per, pack=N, write=written, group=blocks, read=reads, read_group=read_blocks, unpack=N)
    if route == "staged" and engine != "io_uring":  # the thread engine builds its own futures for its workers
        counted.pop("Future", None)
    assert counted == expected
