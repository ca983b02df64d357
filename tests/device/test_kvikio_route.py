"""The kvikio route's own threads survive failing callbacks, and a failed transfer's buffer is let go once no piece moves.

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
        made._file = lambda fd: types.SimpleNamespace(pwrite=lambda buf, size, offset, task_size: _next(made),
                                                      pread=lambda buf, size, offset, task_size: _next(made))
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


class _Held:
    """A kvikio future whose piece moves until ``release`` is set."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def get(self) -> int:
        assert self.release.wait(5), "the held piece was never released"
        return 0


@pytest.mark.parametrize("kind", ["write", "read"])
def test_a_failed_transfers_buffer_goes_once_no_piece_moves(route, kind):
    """Note [A transfer waits for every piece it started]: a failed transfer's buffer was kept for the process's life
    (kvikio's future raises at the first failed piece while others may still move), so on a full disk each step's failed
    writes held their storages for good (helper-161). The route cuts the transfer into one-task calls and reports the
    error, letting the buffer go, only once every piece ended."""
    route._task_bytes = 40  # 100 bytes: three pieces
    held = _Held()
    route.futures += [_Finished(RuntimeError("one piece failed")), held, _Finished()]
    done, seen = threading.Event(), []
    if kind == "write":
        src = torch.zeros(100, dtype=torch.uint8)
        watched = StorageWeakRef(src.untyped_storage())
        route.write(src, 0, -1, 0, lambda error: (seen.append(error), done.set()), _NoWait())
        del src
    else:
        route.read(torch.device("cpu"), 100, 0, -1, 0, lambda error, data, event: (seen.append(error), done.set()))
    assert not done.wait(0.2), "the failure was reported while a piece still moved"
    if kind == "write":
        assert not watched.expired(), "the source was let go while a piece still moved"
    held.release.set()
    assert done.wait(5) and isinstance(seen[0], OSError) and "one piece failed" in str(seen[0])
    route.stop()
    assert route.futures == []
    if kind == "write":
        assert watched.expired(), "the failed write's source was kept"


def test_each_piece_is_one_kvikio_task(route):
    """A piece's ``task_size`` is its own size, which kvikio runs as one task: its future ends when its bytes do."""
    calls = []
    route._file = lambda fd: types.SimpleNamespace(
        pwrite=lambda buf, size, offset, task_size: (calls.append((buf.numel(), size, offset, task_size)), _Finished())[1])
    route._task_bytes = 40
    done = threading.Event()
    route.write(torch.zeros(100, dtype=torch.uint8), 0, -1, 1000, lambda error: done.set(), _NoWait())
    assert done.wait(5)
    assert calls == [(40, 40, 1000, 40), (40, 40, 1040, 40), (20, 20, 1080, 20)]


@pytest.mark.parametrize(("message", "number"), [
    ("POSIX error on pwrite: No space left on device", 28), ("POSIX error on pwrite: Disk quota exceeded", 122),
    ("cuFile error: something else", 5)], ids=["ENOSPC", "EDQUOT", "other"])
def test_kvikio_errors_keep_their_cause(route, message, number):
    """kvikio raises RuntimeError for I/O failures, all reported as EIO: on a full disk the write warning said "Check the
    disk (dmesg)", and a second warning came for the same disk's ENOSPC (one per cause, where the rule allows one)."""
    route.futures.append(_Finished(RuntimeError(message)))
    done, seen = threading.Event(), []
    route.write(torch.zeros(100, dtype=torch.uint8), 0, -1, 0, lambda error: (seen.append(error), done.set()), _NoWait())
    assert done.wait(5)
    assert isinstance(seen[0], OSError) and seen[0].errno == number and message in str(seen[0])


@pytest.mark.parametrize("kind", ["write", "read"])
def test_a_cuda_error_of_kvikio_is_not_blamed_on_the_disk(route, kind):
    """kvikio raises RuntimeError for a CUDA failure too (its compatibility mode copies through the device; a kernel's
    illegal access breaks the context). Every RuntimeError became OSError(EIO), so a failed write's warning told the user
    to check the disk (dmesg) for a GPU fault. A message naming no errno and a CUDA error stays the error it was."""
    from tba.runtime._release import write_error_cause

    message = "CUDA error at: kvikio/posix_io.hpp: CUDA_ERROR_ILLEGAL_ADDRESS an illegal memory access was encountered"
    route.futures.append(_Finished(RuntimeError(message)))
    done, seen = threading.Event(), []
    if kind == "write":
        route.write(torch.zeros(100, dtype=torch.uint8), 0, -1, 0, lambda error: (seen.append(error), done.set()),
                    _NoWait())
    else:
        route.read(torch.device("cpu"), 100, 0, -1, 0, lambda error, data, event: (seen.append(error), done.set()))
    assert done.wait(5)
    assert not isinstance(seen[0], OSError) and message in str(seen[0])
    assert write_error_cause(seen[0], 100)[1].startswith("The GPU failed, not the disk")
