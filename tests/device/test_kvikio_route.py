"""The kvikio route's own threads survive failing callbacks, and a failed transfer's buffer is never freed.

Built on the simulated device (``tba/device/sim``) with kvikio's file handle replaced by a stub, so
each case controls exactly what kvikio reports. Found by a review of the route's in-flight bound.
"""

from __future__ import annotations

import threading
import types

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from tba.device import CudaOps
from tba.device.sim import fake_kvikio


class _Finished:
    """A kvikio future that has finished, with ``error`` if given."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.error = error

    def get(self) -> int:
        if self.error is not None:
            raise self.error
        return 0


class _NoWait:
    def synchronize(self) -> None:
        pass


@pytest.fixture
def route(sim):
    from tba.device._kvikio import KvikioRoute

    with fake_kvikio(sim, gds=True):
        made = KvikioRoute(CudaOps(torch.device("cpu")))
        made.futures = []  # what the stub's transfers return, in order; _Finished() when empty
        made._file = lambda fd: types.SimpleNamespace(pwrite=lambda buf, size, offset: _next(made),
                                                      pread=lambda buf, size, offset: _next(made))
        yield made
        made.stop()
        made.close()


def _next(route):
    return route.futures.pop(0) if route.futures else _Finished()


def _write(route, wanted=None, on_done=None):
    done, seen = threading.Event(), []

    def report(error):
        seen.append(error)
        done.set()

    route.write(torch.zeros(100, dtype=torch.uint8), 0, -1, 0, on_done or report, _NoWait(), wanted)
    return done, seen


def test_a_failing_wanted_is_reported_and_later_writes_go_on(route):
    def boom():
        raise RuntimeError("wanted failed")

    first, seen = _write(route, wanted=boom)
    second, _ = _write(route)
    assert first.wait(5) and second.wait(5), "the write thread died with wanted()'s error"
    assert isinstance(seen[0], RuntimeError) and route._writing_bytes == 0


def test_a_failing_completion_callback_does_not_stop_later_writes(route, caplog):
    def bad(error):
        raise RuntimeError("on_done failed")

    _write(route, wanted=lambda: False, on_done=bad)  # skipped: its callback runs on the write thread
    second, _ = _write(route)
    assert second.wait(5), "the write thread died with on_done's error"
    assert "kvikio transfer's job failed" in caplog.text


@pytest.mark.parametrize("kind", ["write", "read"])
def test_a_failed_transfers_buffer_is_never_freed(route, kind, monkeypatch, caplog):
    """Note [A failed transfer's buffer is never freed]: kvikio may still be moving other pieces."""
    from tba.device import _kvikio

    monkeypatch.setattr(_kvikio, "FAILED_TRANSFER_BUFFERS", [])
    route.futures.append(_Finished(RuntimeError("one piece failed")))
    done, seen = threading.Event(), []
    if kind == "write":
        src = torch.zeros(100, dtype=torch.uint8)
        watched = StorageWeakRef(src.untyped_storage())
        route.write(src, 0, -1, 0, lambda error: (seen.append(error), done.set()), _NoWait())
        del src
    else:
        route.read(torch.device("cpu"), 100, 0, -1, 0, lambda error, data, event: (seen.append(error), done.set()))
    assert done.wait(5) and isinstance(seen[0], OSError)
    route.stop()
    assert len(_kvikio.FAILED_TRANSFER_BUFFERS) == 1, "the failed transfer's buffer was let go"
    assert "stays allocated for good" in caplog.text
    if kind == "write":
        assert not watched.expired()
