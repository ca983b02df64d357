"""tba.bench._fuzz_io: the fuzzer's late-write engine calls each request's callback exactly once."""

from __future__ import annotations

import collections

from tba.bench._fuzz_io import LateWriteEngine, LateWrites
from tba.io import Engine, Op, Request


class RefusesReads(Engine):
    """Runs writes inline and refuses every submission with a read, as a failed io_uring ring refuses all."""

    name = "refuses-reads"

    def submit_many(self, requests):
        raise NotImplementedError

    def submit_calls(self, requests, on_done):
        if any(request.op is Op.READ for request in requests):
            raise OSError(5, "the ring failed")
        for callback in on_done:
            callback(None)

    def close(self):
        pass


def test_a_read_the_inner_engine_refuses_is_heard_once_and_the_held_write_once():
    """Note [A late engine that took writes never raises] in tba/bench/_fuzz_io.py: the refusal of a batch's read
    was raised after its write was held, so the caller told both (as tba does) and the write heard twice."""
    heard = collections.defaultdict(list)
    engine = LateWriteEngine(RefusesReads(), LateWrites(1, 0.0, 1), seed=0)
    requests = [Request(Op.WRITE, 0, 0, 4096, 0), Request(Op.READ, 0, 0, 4096, 4096)]
    callbacks = [lambda error, i=i: heard[i].append(error) for i in range(len(requests))]
    try:
        engine.submit_calls(requests, callbacks)
    except OSError as err:  # what tba's HostBatch does with a refused submission
        for callback in callbacks:
            callback(err)
    engine.close()
    assert heard[0] == [None] and [type(error) for error in heard[1]] == [OSError]
