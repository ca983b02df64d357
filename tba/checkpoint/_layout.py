"""How one data file of a checkpoint is laid out, built in host memory and written with O_DIRECT.

DCP's file format stores each tensor as a complete ``torch.save`` archive (a zip file) at
``(offset, length)`` inside a data file, and each non-tensor object as raw pickled bytes. To
write such a file with ``O_DIRECT`` the tensor bytes must start on a 4096-byte boundary, so each
tensor's archive is built around its data:

1. ``torch.save`` of an uninitialised contiguous tensor of the same shape and dtype runs under
   ``torch.serialization.skip_data()`` into a recorder that keeps every byte it is given. The
   writer reserves the storage's bytes with one relative ``seek``; what comes before is the
   archive's *head* (local zip headers, the pickle, padding), what comes after is its *tail*
   (remaining records, central directory). No tensor byte is read, and the pair is cached per
   (shape, dtype); archives sharing it share their ``serialization_id`` record too.
2. The archive is placed so that its data starts on a boundary: ``start = align_up(cursor +
   len(head)) - len(head)``. The gap before it (under 4 KiB) is zeros and belongs to no entry.
3. The whole file image is assembled in one page-aligned host buffer: heads, tails and gaps
   first, then each tensor is copied into its slot (``copy_`` handles any strides and dtype).
   As the copy passes each chunk boundary, that chunk is queued to the engine, so writing
   overlaps copying; when the last tensor is copied the caller's *snapshot* callback runs and
   the tensors may change again.

The zip's CRC field of a skipped record is not the data's CRC, exactly as when ``torch.save``
runs with ``compute_crc32=False``; ``torch.load`` (and so DCP's ``FileSystemReader``) does not
check it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import io
import os
from collections.abc import Callable

import torch

from tba.checkpoint._io import ALIGN_BYTES, DEFAULT_CHUNK_BYTES, Engine, Op, Request, align_up

SKELETON_CACHE_ENTRIES = 4096
"""Archive skeletons kept, one per (shape, dtype): a model's tensors repeat a few shapes."""


class _Recorder:
    """A write-only stream that splits ``torch.save``'s output at the one skipped hole."""

    def __init__(self) -> None:
        self.head = bytearray()
        self.tail = bytearray()
        self.hole_bytes: int | None = None
        self._position = 0

    def write(self, data: bytes) -> int:
        view = memoryview(data).cast("B")
        (self.head if self.hole_bytes is None else self.tail).extend(view)
        self._position += len(view)
        return len(view)

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        if whence != os.SEEK_CUR or self.hole_bytes is not None:
            raise io.UnsupportedOperation("torch.save skeleton: unexpected seek")
        self.hole_bytes = offset
        self._position += offset
        return self._position

    def tell(self) -> int:
        return self._position

    def flush(self) -> None:
        """Nothing to flush: bytes are kept in memory."""


@dataclasses.dataclass
class Entry:
    """One item of the file: ``head`` + ``nbytes`` of ``tensor`` + ``tail`` at ``offset``."""

    key: object
    head: bytes
    tensor: torch.Tensor | None = None
    nbytes: int = 0
    tail: bytes = b""
    offset: int = 0

    @property
    def length(self) -> int:
        """Bytes of this entry in the file."""
        return len(self.head) + self.nbytes + len(self.tail)

    @property
    def data_offset(self) -> int:
        """File offset of the tensor's first byte."""
        return self.offset + len(self.head)


@functools.lru_cache(maxsize=SKELETON_CACHE_ENTRIES)
def _skeleton(shape: torch.Size, dtype: torch.dtype) -> tuple[bytes, bytes]:
    recorder = _Recorder()
    with torch.serialization.skip_data():
        torch.save(torch.empty(shape, dtype=dtype, device="cpu"), recorder)  # the host copy, whatever the default device
    nbytes = shape.numel() * dtype.itemsize
    if (recorder.hole_bytes or 0) != nbytes:
        raise RuntimeError(f"torch.save skeleton reserved {recorder.hole_bytes} bytes for a "
                           f"{nbytes}-byte tensor")
    return bytes(recorder.head), bytes(recorder.tail)


def tensor_entry(key: object, tensor: torch.Tensor) -> Entry:
    """The entry for ``tensor``: its ``torch.save`` archive split around the raw bytes.

    The archive is that of a contiguous tensor of the same shape and dtype (what ``torch.load``
    returns is the same either way), so it depends on nothing else and is cached.
    """
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    head, tail = _skeleton(tensor.shape, tensor.dtype)
    return Entry(key, head, tensor, tensor.nbytes, tail)


def place(entries: list[Entry]) -> int:
    """Assign each entry's offset (tensor data on 4096-byte boundaries); returns the file size."""
    cursor = 0
    for entry in entries:
        if entry.nbytes:
            entry.offset = align_up(cursor + len(entry.head)) - len(entry.head)
        else:
            entry.offset = cursor
        cursor = entry.offset + entry.length
    return cursor


def _put_bytes(image: torch.Tensor, offset: int, data: bytes) -> None:
    if data:
        image[offset : offset + len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))


def _copy_tensor(image: torch.Tensor, entry: Entry) -> None:
    if not entry.nbytes:
        return
    slot = image[entry.data_offset : entry.data_offset + entry.nbytes]
    slot.view(entry.tensor.dtype).view(entry.tensor.shape).copy_(entry.tensor)


def write_image(
    engine: Engine,
    fd: int,
    image: torch.Tensor,
    entries: list[Entry],
    file_bytes: int,
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    check_snapshot: Callable[[], None] | None = None,
    on_snapshot: Callable[[], None] | None = None,
) -> None:
    """Build the file image in ``image`` and write it to ``fd`` at offset 0.

    Args:
        engine: Engine that runs the writes.
        fd: Destination, opened for writing (``O_DIRECT`` or not).
        image: Page-aligned ``uint8`` buffer of at least ``align_up(file_bytes)`` bytes.
        entries: Placed entries (see :func:`place`), in file order.
        file_bytes: Logical size of the file (bytes); the last block is padded with zeros.
        chunk_bytes: Bytes per write request, a multiple of 4096.
        check_snapshot: Called once every tensor has been copied, before ``on_snapshot``; may raise.
        on_snapshot: Called once every tensor has been copied into ``image`` (or the copy failed).

    Raises:
        OSError: The first failed write (``ENOSPC`` for a full disk).
    """
    padded_bytes = align_up(file_bytes)
    cursor = 0
    for entry in entries:
        image[cursor : entry.offset].zero_()
        _put_bytes(image, entry.offset, entry.head)
        _put_bytes(image, entry.data_offset + entry.nbytes, entry.tail)
        cursor = entry.offset + entry.length
    image[cursor:padded_bytes].zero_()

    base = image.data_ptr()
    futures: list[concurrent.futures.Future] = []
    submitted = 0

    def submit_until(end: int) -> None:
        nonlocal submitted
        requests = []
        while end - submitted >= chunk_bytes or (end == padded_bytes and submitted < end):
            nbytes = min(chunk_bytes, end - submitted)
            requests.append(Request(Op.WRITE, fd, base + submitted, nbytes, submitted))
            submitted += nbytes
        if requests:
            futures.extend(engine.submit_many(requests))

    try:
        for entry in entries:
            _copy_tensor(image, entry)
            submit_until(entry.offset + entry.length - (entry.offset + entry.length) % ALIGN_BYTES)
        if check_snapshot is not None:
            check_snapshot()
    except BaseException:
        _wait_whole(futures)
        raise
    finally:
        if on_snapshot is not None:
            on_snapshot()
    try:
        submit_until(padded_bytes)
        concurrent.futures.wait(futures)
    except BaseException:
        _wait_whole(futures)
        raise
    for future in futures:
        future.result()


def _wait_whole(futures: list[concurrent.futures.Future]) -> None:
    """Wait for every write, through asynchronous exceptions too (the first is raised once they are done).

    Note: [A save ends no sooner than its writes]
    A synchronous save spends most of its time in the final wait for its writes, in the caller's thread,
    where a Ctrl-C lands. It left write_image with writes still queued, and the writer closed the data file:
    they ran on a closed descriptor, or on whatever file another thread opened under its number meanwhile.
    """
    interrupted = None
    while True:
        try:
            concurrent.futures.wait(futures)
            break
        except BaseException as err:  # noqa: BLE001 - raised below, once every write has ended
            interrupted = interrupted or err
    if interrupted is not None:
        raise interrupted
