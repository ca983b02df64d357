"""A DCP ``StorageReader`` that reads checkpoints through tba's engine.

It reads any checkpoint in DCP's file-system format (tba's or ``FileSystemWriter``'s): the
pickled ``.metadata`` names, for every item, a file and an ``(offset, length)`` range. Items of
one file are sorted by offset and gathered into batches of at most ``batch_bytes``; each batch is
one aligned range, read with ``O_DIRECT`` in ``chunk_bytes`` requests kept ``queue_depth`` deep
(the bytes past the last whole block of the file, which O_DIRECT cannot read, come through a
buffered ``pread``). Each tensor item is then a ``torch.save`` archive in memory: it is loaded,
narrowed to the requested chunk and copied into the planner's tensor; other items go to
``planner.load_bytes``.
"""

from __future__ import annotations

import concurrent.futures
import io
import os
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from tba.checkpoint._io import (
    ALIGN_BYTES,
    DEFAULT_CHUNK_BYTES,
    DEFAULT_QUEUE_DEPTH,
    Engine,
    EngineSettingsRepr,
    Op,
    Request,
    TbaCheckpointError,
    TbaConfigError,
    align_up,
    check_engine_settings,
    checkpoint_path,
    host_buffer,
    make_engine,
)
from tba.checkpoint._pending import wait_for_saves
from tba.checkpoint._publish import METADATA_NAME
from tba.checkpoint._stale import remove_stale_partials

_TRIES = 3
"""Attempts at reading ``.metadata`` while other processes' saves replace the directory."""

DEFAULT_BATCH_BYTES = 256 << 20
"""Most bytes read into memory before they are handed to the planner (bytes)."""

EAGER_FILES = 64
"""Data files a load opens before it reads a byte (Note [A checkpoint of many files is opened file by file])."""



class CheckpointReplaced(TbaCheckpointError):
    """The checkpoint was replaced by another save while a load read it; nothing was loaded."""


def _close_all(files: dict[str, tuple[int, int]]) -> None:
    for fds in files.values():
        for fd in fds:
            if fd >= 0:
                os.close(fd)


def _narrow(tensor: torch.Tensor, offsets: torch.Size, lengths: torch.Size) -> torch.Tensor:
    for dim, (start, length) in enumerate(zip(offsets, lengths)):
        if start != 0 or length != tensor.size(dim):
            tensor = tensor.narrow(dim, start, length)
    return tensor


class TbaStorageReader(EngineSettingsRepr, StorageReader):
    """DCP storage reader for ``dcp.load(sd, storage_reader=TbaStorageReader(path))``.

    Args:
        path: Checkpoint directory; may also be given as ``checkpoint_id``.
        backend: Engine backend or Engine instance. Default ``"auto"``.
        queue_depth: Read requests in flight. Default 8.
        batch_bytes: Bound on bytes held in memory at once, beyond a single larger item.
    """

    def __init__(
        self,
        path: str | os.PathLike | None = None,
        *,
        backend: str | Engine = "auto",
        queue_depth: int = DEFAULT_QUEUE_DEPTH,
        batch_bytes: int = DEFAULT_BATCH_BYTES,
    ) -> None:
        super().__init__()
        check_engine_settings(backend, queue_depth)  # Note [Engine settings are checked at construction]
        if isinstance(batch_bytes, bool) or not isinstance(batch_bytes, int) or batch_bytes < 1:
            raise TbaConfigError(f"batch_bytes must be a whole number of bytes >= 1, got {batch_bytes!r}")
        self.path = checkpoint_path(path)
        self.storage_data: dict[Any, Any] = {}
        self._backend = backend
        self._queue_depth = queue_depth
        self._batch_bytes = batch_bytes
        self._metadata_bytes: bytes | None = None

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self.storage_data = {}
        if checkpoint_id:
            self.path = os.fspath(checkpoint_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return "://" not in str(checkpoint_id) and os.path.isdir(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        wait_for_saves(self.path)  # Note [A load waits for the saves to its path]
        remove_stale_partials(os.path.dirname(os.path.abspath(self.path)))  # Note [Whose partial directory is dead]
        metadata_path = os.path.join(self.path, METADATA_NAME)
        for attempt in range(_TRIES):
            try:
                with open(metadata_path, "rb") as stream:
                    self._metadata_bytes = stream.read()
                break
            except (FileNotFoundError, NotADirectoryError) as err:  # a file at the path, or a save of another
                # process that has just replaced the directory
                if attempt == _TRIES - 1 or not os.path.exists(metadata_path):
                    raise TbaCheckpointError(f"no checkpoint at {self.path}: {METADATA_NAME} is missing; "
                                             "pass the directory a save completed to") from err
        metadata = pickle.loads(self._metadata_bytes)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if metadata.storage_data is None:
            raise TbaCheckpointError(f"checkpoint {self.path} has no storage data in its metadata")
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            if getattr(info, "transform_descriptors", None):
                raise TbaCheckpointError(f"{self.path} uses stream transforms "
                                         f"{info.transform_descriptors}; load it with FileSystemReader")
            per_file.setdefault(info.relative_path, []).append(item)
        directory = self._open_directory()
        try:
            # Note [A checkpoint of many files is opened file by file]
            files = self._open_files(directory, list(per_file)) if len(per_file) <= EAGER_FILES else {}
            try:
                engine = make_engine(self._backend, queue_depth=self._queue_depth)
                try:
                    for relative_path, items in per_file.items():
                        items.sort(key=lambda i: self.storage_data[i.storage_index].offset)
                        late = {} if relative_path in files else self._open_files(directory, [relative_path], True)
                        try:
                            self._read_file(engine, os.path.join(self.path, relative_path),
                                            files.get(relative_path) or late[relative_path], items, planner)
                        finally:
                            _close_all(late)
                finally:
                    if engine is not self._backend:  # an Engine passed in is the caller's, as the writer's is
                        engine.close()
            finally:
                _close_all(files)
        finally:
            os.close(directory)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _replaced(self, loading: bool = False) -> CheckpointReplaced:
        done = ("some of its tensors may be loaded already" if loading else "nothing was loaded")
        return CheckpointReplaced(f"the checkpoint at {self.path} was replaced by another save while this load read "
                                  f"it, and {done}; load again (tba.checkpoint.load does, a few times)")

    def _open_directory(self) -> int:
        """Open the checkpoint's directory and check that its ``.metadata`` is the one ``read_metadata`` parsed.

        Note: [A load racing another process's save]
        ``read_metadata`` and ``read_data`` each named files by the checkpoint's path; a save of
        another process exchanging the directory in between gave a read of the new data file at the
        old metadata's offsets, a miniz error (helper-41). The directory is opened once here, its
        ``.metadata`` read again through it and compared with the bytes ``read_metadata`` parsed
        (a tba save's metadata holds its unique ``save_id``), and every data file is opened through
        the same directory before a byte is loaded; an open file stays readable when the replaced
        checkpoint is deleted. A mismatch, or a file already deleted, raises
        :class:`CheckpointReplaced` before anything is loaded; :func:`tba.checkpoint.load` retries.
        """
        try:
            directory = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError as err:
            raise self._replaced() from err
        try:
            with open(METADATA_NAME, "rb", opener=lambda name, flags: os.open(name, flags, dir_fd=directory)) as stream:
                if self._metadata_bytes is not None and stream.read() != self._metadata_bytes:
                    raise self._replaced()
        except BaseException as err:
            os.close(directory)
            if isinstance(err, FileNotFoundError):
                raise self._replaced() from err
            raise
        return directory

    def _open_files(self, directory: int, names: list[str], loading: bool = False) -> dict[str, tuple[int, int]]:
        """Open data files through ``directory``, ``(buffered fd, O_DIRECT fd or -1)`` each.

        Note: [A checkpoint of many files is opened file by file]
        Every data file was opened, two descriptors each, before a byte was read (Note [A load racing
        another process's save]): a ``FileSystemWriter(single_file_per_rank=False)`` checkpoint, a
        file per tensor, failed with "Too many open files" from some 500 tensors under the usual limit
        of 1024 (helper-153). Up to :data:`EAGER_FILES` files are opened first, as before; more are
        opened one at a time, as each is read, through the same directory. A save replacing such a
        checkpoint midway then raises :class:`CheckpointReplaced` with part of it loaded (``FileSystemWriter``
        writes in place, never whole, anyway); ``tba.checkpoint.load`` loads everything again.
        """
        opened: dict[str, tuple[int, int]] = {}
        try:
            for name in names:
                fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC, dir_fd=directory)
                opened[name] = (fd, -1)
                try:
                    opened[name] = (fd, os.open(name, os.O_RDONLY | os.O_CLOEXEC | os.O_DIRECT, dir_fd=directory))
                except OSError:
                    pass
        except BaseException as err:
            _close_all(opened)
            if isinstance(err, FileNotFoundError):
                raise self._replaced(loading) from err
            raise
        return opened

    def _batches(self, items: list[ReadItem]) -> list[list[ReadItem]]:
        batches: list[list[ReadItem]] = [[]]
        start = None
        for item in items:
            info = self.storage_data[item.storage_index]
            if start is not None and info.offset + info.length - start > self._batch_bytes:
                batches.append([])
                start = None
            if start is None:
                start = info.offset - info.offset % ALIGN_BYTES
            batches[-1].append(item)
        return [b for b in batches if b]

    def _read_file(self, engine: Engine, path: str, fds: tuple[int, int], items: list[ReadItem],
                   planner: LoadPlanner) -> None:
        fd, direct_fd = fds
        size = os.fstat(fd).st_size
        for batch in self._batches(items):
            infos = [self.storage_data[i.storage_index] for i in batch]
            start = infos[0].offset - infos[0].offset % ALIGN_BYTES
            end = max(i.offset + i.length for i in infos)
            if end > size:
                raise TbaCheckpointError(f"{path} is shorter ({size} bytes) than its metadata says "
                                         f"({end}); the checkpoint is damaged")
            buffer = host_buffer(align_up(end) - start)
            self._fill(engine, direct_fd, fd, buffer, start, end, size)
            for item, info in zip(batch, infos):
                blob = buffer[info.offset - start : info.offset - start + info.length]
                self._deliver(item, blob, planner)

    @staticmethod
    def _fill(engine: Engine, direct_fd: int, fd: int, buffer: torch.Tensor, start: int, end: int, size: int) -> None:
        whole_end = min(align_up(end), size - size % ALIGN_BYTES) if direct_fd >= 0 else start
        whole_end = max(whole_end, start)
        base = buffer.data_ptr()
        requests = [
            Request(Op.READ, direct_fd, base + offset - start, min(DEFAULT_CHUNK_BYTES, whole_end - offset), offset)
            for offset in range(start, whole_end, DEFAULT_CHUNK_BYTES)
        ]
        futures = engine.submit_many(requests)
        if end > whole_end:
            rest = os.pread(fd, end - whole_end, whole_end)
            if len(rest) != end - whole_end:
                raise TbaCheckpointError(f"short read at offset {whole_end}: the checkpoint file is damaged")
            buffer[whole_end - start : end - start].copy_(torch.frombuffer(bytearray(rest), dtype=torch.uint8))
        concurrent.futures.wait(futures)
        for future in futures:
            future.result()

    @staticmethod
    def _deliver(item: ReadItem, blob: torch.Tensor, planner: LoadPlanner) -> None:
        data = io.BytesIO(blob.numpy().tobytes())
        if item.type == LoadItemType.BYTE_IO:
            planner.load_bytes(item, data)
            return
        tensor = torch.load(data, map_location="cpu", weights_only=True)
        tensor = _narrow(tensor, item.storage_offsets, item.lengths)
        target = planner.resolve_tensor(item).detach()
        if target.size() != tensor.size():
            raise TbaCheckpointError(f"{item.storage_index.fqn}: checkpoint holds {tuple(tensor.size())}, "
                                     f"the state dict wants {tuple(target.size())}")
        target.copy_(tensor)
        planner.commit_tensor(item, target)
