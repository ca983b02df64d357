"""Host transfers into engine requests: adjacent storages as one vectored request, large ones in blocks.

Note: [Adjacent storages, one request]
The saves of one forward batch get extents one after another in the spill file, and the reads of
one prefetch step are their extents again, in reverse. Sent one request per storage, each small
storage cost the io_uring worker a wake-up and the completion thread a return to Python: on
tmpfs 22 µs of CPU per 64 KiB write against 12 µs per 64 KiB when written 1 MiB at a time
(``docs/host-cost.md``, thirteenth pass), on a 2-core machine time taken from compute. So when the
engine takes vectored requests (io_uring's READV/WRITEV; the thread engine moves the pieces one
after another in one worker), consecutive requests whose extents touch
go as one: its pieces are the storages' memory ranges in file order, at most
:data:`MAX_PIECES` of them and :data:`JOIN_MAX_BYTES` in all, and its completion calls each storage's
callback in turn. Nothing else changes: each storage still has its own extent, its own buffer and
its own callback. A vectored request that fails goes again one request per storage, so that each
storage hears its own outcome, as it would have alone: a write cut at a file-size limit fails
with ``EINVAL`` under ``O_DIRECT`` for the whole request, also for the storages that end below the
limit, which alone would have been written (Note [A file-size limit is one cause] in
``tba/runtime/_release.py``).

Note: [Requests formed in C]
With the optional extension ``tba._requests`` built (setup.py), :func:`add_requests` is its C loop
(``native/tba_requests.c``): the same decisions, the same ``Request`` tuples and callbacks, without the
Python loop's 20 lines per storage on the control thread, whose Python the forward waits for
(docs/host-cost.md). Without it, :func:`python_add_requests` below. Both read :data:`MAX_PIECES` and
:data:`JOIN_MAX_BYTES` at each call.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import NamedTuple

from tba.device import Countdown, WriteNotNeeded
from tba.io import Op, Request

try:
    from tba import _requests
except ImportError:  # the optional extension was not built (setup.py)
    _requests = None

Callback = Callable[[BaseException | None], None]

MAX_PIECES = 256
"""Most storages in one vectored request (the kernel takes 1024 pieces)."""

JOIN_MAX_BYTES = 1 << 20
"""Most bytes of one vectored request. A request's fixed cost is paid back by then (64 KiB writes to
tmpfs: 20 µs of CPU per 64 KiB one by one, 12-13 at 1 MiB and at 4 MiB alike); a larger one only makes
its first storage wait longer for its last (a read that backward waits for, say)."""


class Transfer(NamedTuple):
    """One storage's extent, and the memory it moves to or from, before requests are formed."""

    op: Op
    fd: int
    address: int
    extent_bytes: int
    offset: int
    on_done: Callback
    owner: object


Retry = Callable[[list[Transfer]], None]
"""Sends each of a failed vectored request's transfers again, alone."""


def add_requests(requests: list[Request], callbacks: list[Callback], transfers: list[Transfer],
                 block_size_bytes: int, retry: Retry | None) -> None:
    """Append the requests for ``transfers`` (in their order) and one callback per request to the lists.

    With ``retry`` (the engine takes vectored requests), consecutive transfers of one file whose
    extents touch (in either order) go as one request of at most :data:`JOIN_MAX_BYTES`, whose
    failure calls ``retry`` with them. One larger than ``block_size_bytes`` goes as several, its
    callback heard once all are. In C where ``tba._requests`` is built (Note [Requests formed in C]).
    """
    if _requests is None:
        python_add_requests(requests, callbacks, transfers, block_size_bytes, retry)
    else:
        _requests.add_requests(requests, callbacks, transfers, block_size_bytes, retry, MAX_PIECES,
                               min(block_size_bytes, JOIN_MAX_BYTES))


def python_add_requests(requests: list[Request], callbacks: list[Callback], transfers: list[Transfer],
                        block_size_bytes: int, retry: Retry | None) -> None:
    """:func:`add_requests` in Python: what runs without ``tba._requests``, and what its C loop does."""
    group: list[Transfer] = []
    low = high = group_bytes = 0
    join_bytes = min(block_size_bytes, JOIN_MAX_BYTES)
    for transfer in transfers:
        if transfer.extent_bytes > block_size_bytes:
            _add_large(requests, callbacks, transfer, block_size_bytes)
            continue
        if group and (retry is None or transfer.fd != group[0].fd or len(group) >= MAX_PIECES
                      or group_bytes + transfer.extent_bytes > join_bytes
                      or (transfer.offset != high and transfer.offset + transfer.extent_bytes != low)):
            _add_group(requests, callbacks, group, retry)
            group = []
        if not group:
            low = high = transfer.offset
            group_bytes = 0
        group.append(transfer)
        group_bytes += transfer.extent_bytes
        if transfer.offset == high:
            high += transfer.extent_bytes
        else:
            low = transfer.offset
    if group:
        _add_group(requests, callbacks, group, retry)


def alone(transfer: Transfer) -> Request:
    """The request that moves ``transfer`` by itself."""
    return Request(transfer.op, transfer.fd, transfer.address, transfer.extent_bytes, transfer.offset, transfer.owner)


def _group_done(group: list[Transfer], retry: Retry, error: BaseException | None) -> None:
    # WRITE_NOT_NEEDED is no failure of the request but HostBatch's word that its writes were not sent
    # (taken just before closing, refused by the closed engine): each storage hears it, none goes again.
    if error is not None and not isinstance(error, WriteNotNeeded):
        retry(group)
        return
    # The engine has let go of the request and its owners; so must this callback before the storages
    # hear their end: a write's completion releases the storage's pages only when tba holds it no more
    # (Note [A storage the program still holds is not read back] in tba/runtime/_reads.py), and the
    # group's own reference made every joined storage linger, and backward take it from memory.
    callbacks = [transfer.on_done for transfer in group]
    group.clear()
    for callback in callbacks:
        callback(error)


def _add_group(requests: list[Request], callbacks: list[Callback], group: list[Transfer], retry: Retry | None) -> None:
    if len(group) == 1 or retry is None:
        requests.extend(alone(transfer) for transfer in group)
        callbacks.extend(transfer.on_done for transfer in group)
        return
    group.sort(key=lambda transfer: transfer.offset)
    first = group[0]
    requests.append(Request(first.op, first.fd, first.address, sum(t.extent_bytes for t in group), first.offset,
                            tuple(t.owner for t in group), tuple((t.address, t.extent_bytes) for t in group)))
    callbacks.append(functools.partial(_group_done, group, retry))


def _add_large(requests: list[Request], callbacks: list[Callback], transfer: Transfer, block_size_bytes: int) -> None:
    nbytes = transfer.extent_bytes
    starts = range(0, nbytes, block_size_bytes)
    pieces = Countdown(len(starts), transfer.on_done)
    for start in starts:
        requests.append(Request(transfer.op, transfer.fd, transfer.address + start, min(block_size_bytes, nbytes - start),
                                transfer.offset + start, transfer.owner))
        callbacks.append(pieces.done)


if _requests is not None:
    try:
        _requests.configure(Request, Transfer, functools.partial, _group_done, _add_large)
    except (RuntimeError, TypeError) as err:  # a build that does not match this tba: the Python loop serves
        logging.getLogger("tba").warning("tba: %s; tba forms its requests in Python meanwhile (python setup.py "
                                         "build_ext --inplace, or reinstall tba)", err)
        _requests = None

NATIVE = _requests is not None
"""Whether :func:`add_requests` is the C loop of ``tba._requests``."""
