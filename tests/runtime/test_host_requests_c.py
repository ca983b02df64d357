"""The C loop of ``tba._requests`` forms the requests and callbacks the Python one does (Note [Requests formed in C]
in ``tba/runtime/_host_requests.py``), on random transfer sequences, and refuses a request type it does not know.
Run once each, not per forming path as ``test_host_requests.py``'s tests are."""

from __future__ import annotations

import functools
import random

import pytest

from tba.io import Op
from tba.runtime import _host_requests

C_LOOP = _host_requests._requests
"""tba._requests, or None where it is not built."""

KIB = 1 << 10
BLOCK_BYTES = 1 << 20

pytestmark = pytest.mark.skipif(C_LOOP is None, reason="the native extension tba._requests is not built")


def _formed(add, transfers, block_size_bytes, retry):
    requests, callbacks = [], []
    if add is C_LOOP:
        C_LOOP.add_requests(requests, callbacks, list(transfers), block_size_bytes, retry, _host_requests.MAX_PIECES,
                            min(block_size_bytes, _host_requests.JOIN_MAX_BYTES))
    else:
        add(requests, callbacks, list(transfers), block_size_bytes, retry)
    return requests, [_callback(c) for c in callbacks]


def _callback(callback):
    """What a callback calls, comparable across two formings: a group's function and transfers, a large
    transfer's countdown's count and callback, else the storage's own callback."""
    if isinstance(callback, functools.partial):
        return callback.func, list(callback.args[0]), callback.args[1]
    countdown = getattr(callback, "__self__", None)
    if countdown is not None:
        return countdown._remaining, countdown._on_done
    return callback


@pytest.mark.parametrize("seed", range(40))
def test_the_c_loop_forms_the_requests_and_callbacks_of_the_python_one(seed, monkeypatch):
    rng = random.Random(seed)
    monkeypatch.setattr(_host_requests, "MAX_PIECES", rng.choice([3, _host_requests.MAX_PIECES]))
    transfers, offset = [], rng.randrange(0, 1 << 30, 4096)
    for _ in range(rng.randrange(1, 300)):
        extent = rng.choice([0, 4096, 64 * KIB, 256 * KIB, 3 * BLOCK_BYTES])
        step = rng.random()
        if step < 0.5:
            offset += extent  # touching after
        elif step < 0.8:
            offset -= extent  # touching before, as reads in reverse
        else:
            offset = rng.randrange(0, 1 << 30, 4096)
        offset = max(offset, 0)
        transfers.append(_host_requests.Transfer(rng.choice([Op.READ, Op.WRITE]), rng.choice([3, 3, 3, 4]),
                                                 rng.randrange(1 << 40), extent, offset, object(), object()))
    retry = rng.choice([None, print])
    block = rng.choice([64 * KIB, BLOCK_BYTES, 4 * BLOCK_BYTES])
    c_made = _formed(C_LOOP, transfers, block, retry)
    python_made = _formed(_host_requests.python_add_requests, transfers, block, retry)
    assert c_made == python_made


def test_the_c_loop_refuses_a_request_type_it_does_not_know():
    from typing import NamedTuple

    class Moved(NamedTuple):
        op: Op
        fd: int
        nbytes: int
        address: int
        offset: int
        owner: object = None
        pieces: tuple | None = None

    with pytest.raises(RuntimeError, match="rebuild the extension"):
        C_LOOP.configure(Moved, _host_requests.Transfer, functools.partial, print, print)


TOP = (1 << 63) - 1
"""The largest file offset (``off_t``), and the largest value the C loop's ``long long`` sums hold."""


@pytest.mark.parametrize("seed", range(20))
def test_the_c_loop_forms_what_the_python_one_does_at_the_top_of_the_offset_range(seed):
    rng = random.Random(seed)
    transfers, offset = [], TOP - rng.randrange(0, 64) * 4096
    for _ in range(rng.randrange(1, 40)):
        extent = rng.choice([0, 4096, 8192])
        offset = min(max(offset + rng.choice([extent, -extent, 0]), 0), TOP - extent)
        transfers.append(_host_requests.Transfer(Op.WRITE, 3, 0, extent, offset, object(), object()))
    assert _formed(C_LOOP, transfers, BLOCK_BYTES, print) == _formed(_host_requests.python_add_requests, transfers,
                                                                      BLOCK_BYTES, print)


@pytest.mark.parametrize("ends", [((1 << 63) - 4096, 4096), (-(1 << 63), 4096), (0, -4096), (1 << 62, (1 << 62) + 4096)])
def test_the_c_loop_refuses_a_transfer_outside_a_file_where_its_sums_would_wrap(ends):
    """Note [File offsets, not wrapped sums] in native/tba_requests.c: the pair at the top and the bottom of the range
    touched once the sum wrapped, and went as one request of a negative size where the Python loop sent each alone."""
    first = _host_requests.Transfer(Op.WRITE, 3, 0, 4096, TOP - 4096 * 2 + 1, object(), object())
    offset, extent = ends
    transfers = [first, _host_requests.Transfer(Op.WRITE, 3, 0, extent, offset, object(), object())]
    with pytest.raises(ValueError, match="outside a file"):
        _formed(C_LOOP, transfers, TOP, print)


class _Index:
    """A number whose ``__index__`` is Python: it runs wherever the C loop converts it."""

    def __index__(self) -> int:
        return 4096


@pytest.mark.parametrize("fields", [("x", _Index(), 3), (4096, "x", _Index())])
def test_a_field_that_is_no_number_raises_a_type_error_not_a_system_error(fields):
    """Note [One conversion at a time] in native/tba_requests.c: the next field's ``__index__`` ran with the first
    one's TypeError pending, and CPython raised a SystemError in its place."""
    extent, offset, fd = fields
    transfer = _host_requests.Transfer(Op.WRITE, fd, 0, extent, offset, object(), object())
    with pytest.raises(TypeError):
        _formed(C_LOOP, [transfer], BLOCK_BYTES, print)


def test_a_size_argument_that_is_no_number_raises_a_type_error_not_a_system_error():
    with pytest.raises(TypeError):
        C_LOOP.add_requests([], [], [], "x", None, _Index(), _Index())
