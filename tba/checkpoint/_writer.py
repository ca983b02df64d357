"""A DCP ``StorageWriter`` that writes through tba's engine and publishes checkpoints atomically.

The checkpoint keeps DCP's on-disk format, so DCP's stock ``FileSystemReader`` loads it: one data
file per rank (``__<rank>_0.distcp``) holding each tensor as a ``torch.save`` archive and each
other object as pickled bytes, plus a pickled ``Metadata`` in ``.metadata`` whose
``storage_data`` maps every item to ``_StorageInfo(relative_path, offset, length)``. Tensor bytes
start on 4096-byte boundaries inside the data file (see :mod:`tba.checkpoint._layout`), so the
file is written from one aligned host image with ``O_DIRECT`` and many requests in flight.

Durability and atomicity: nothing is written under the checkpoint's own path. The coordinator
picks a staging directory beside it (``.<name>.tba-partial-m<machine>-<pid>-<id>``) in
``prepare_global_plan``; every rank writes its data file there, then ``ftruncate``\\ s it to its
logical size and ``fsync``\\ s it before ``write_data`` completes. ``finish`` writes the metadata
to the staging directory, ``fsync``\\ s it and the directory, and only then renames the staging
directory into place (exchanging it atomically with an existing checkpoint, which is then
deleted) and ``fsync``\\ s the parent. A process killed at any moment therefore leaves the old
checkpoint (or none) under the name, never a partial one; partial directories of dead processes
are removed by the next save or load in the same directory (Note [Whose partial directory is dead]).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.staging import BlockingAsyncStager
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from tba.checkpoint import _layout
from tba.checkpoint._claim import SaveClaim
from tba.checkpoint._io import (
    DCP_VERSION,
    DEFAULT_CHUNK_BYTES,
    DEFAULT_QUEUE_DEPTH,
    Engine,
    EngineSettingsRepr,
    ImagePool,
    StorageInfo,
    TbaCheckpointError,
    TbaConfigError,
    align_up,
    check_engine_settings,
    checkpoint_path,
    create_preallocated,
    is_working_directory,
    make_engine,
    size_bytes,
)
from tba.checkpoint._publish import (
    ACTIVE_STAGING,
    DATA_SUFFIX,
    METADATA_NAME,
    checkpoint_error,
    fsync_path,
    hold_staging,
    is_checkpoint_dir,
    release_staging,
    remove_replaced,
    staging_name,
    swap_into_place,
)
from tba.checkpoint._stale import remove_stale_partials

logger = logging.getLogger("tba")

@dataclasses.dataclass(frozen=True)
class _FilePlan:
    prefix: str
    staging: str


class TbaStorageWriter(EngineSettingsRepr, StorageWriter, BlockingAsyncStager):
    """DCP storage writer: O_DIRECT writes through tba's engine, atomic publication.

    Use it wherever DCP takes a ``storage_writer``: ``dcp.save(sd, storage_writer=w)`` or
    ``dcp.async_save(sd, storage_writer=w)``. For ``async_save`` it stages like DCP's
    ``FileSystemWriter`` (a blocking copy of the state dict to CPU). One instance runs one save
    at a time: its host buffer is reused by the next save.

    Args:
        path: Checkpoint directory; may also be given later as ``checkpoint_id``.
        backend: Engine backend (``"auto"``, ``"io_uring"``, ``"threads"``) or an Engine.
        queue_depth: Write requests in flight. Default 8.
        chunk_bytes: Bytes per write request (or a size such as "1M"), a multiple of 4096. Default 4 MiB.
        overwrite: Replace an existing checkpoint at ``path`` (atomically). Default True.
        image_pool: Host buffer to reuse across saves; a private one by default.
        cache_staged_state_dict: Passed to DCP's ``BlockingAsyncStager`` for ``async_save``.
        on_snapshot: Called from ``write_data`` once every tensor was copied to host memory.
        check_snapshot: Called once every tensor was copied, before ``on_snapshot``; raising fails the save.
    """

    def __init__(
        self,
        path: str | os.PathLike | None = None,
        *,
        backend: str | Engine = "auto",
        queue_depth: int = DEFAULT_QUEUE_DEPTH,
        chunk_bytes: int | str = DEFAULT_CHUNK_BYTES,
        overwrite: bool = True,
        image_pool: ImagePool | None = None,
        cache_staged_state_dict: bool = False,
        on_snapshot: Callable[[], None] | None = None,
        check_snapshot: Callable[[], None] | None = None,
    ) -> None:
        StorageWriter.__init__(self)
        BlockingAsyncStager.__init__(self, cache_staged_state_dict=cache_staged_state_dict)
        if (chunk_bytes := size_bytes("chunk_bytes", chunk_bytes)) <= 0 or chunk_bytes % _layout.ALIGN_BYTES:
            raise TbaConfigError(f"chunk_bytes must be a positive multiple of 4096, got {chunk_bytes}")
        check_engine_settings(backend, queue_depth)  # Note [Engine settings are checked at construction]
        self.path = os.path.abspath(checkpoint_path(path)) if path is not None else None
        self.overwrite = overwrite
        self.chunk_bytes = chunk_bytes
        self.on_snapshot = on_snapshot
        self.check_snapshot = check_snapshot
        self.before_publish: Callable[[], None] | None = None
        """Called by ``finish`` just before the checkpoint is published (a lazy save waits for earlier ones there)."""
        self._backend = backend
        self._queue_depth = queue_depth
        self._pool = image_pool or ImagePool()
        self.save_id = uuid.uuid4().hex
        self.rank = 0
        self._staging = ""
        self._staging_fd = -1
        self._claim = SaveClaim()  # Note [One writer runs one save at a time]
        self.last_write_bytes = 0
        """Bytes of the data file of the latest ``write_data`` (padding included)."""
        self.last_write_s = 0.0
        """Seconds the latest ``write_data`` spent from opening its data file until it was fsync'd."""

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        with self._claim.lock:
            self._claim.refuse_overlap(self.path, f"retarget it to {os.fspath(checkpoint_id)}" if checkpoint_id
                                       else "start another save")
            self._retarget(checkpoint_id)
            self._claim.path_by = threading.current_thread()

    def _retarget(self, checkpoint_id: str | os.PathLike | None) -> None:
        """Set the path and a new save id; the save may run in any thread (a lazy save's own)."""
        if checkpoint_id:
            self.path = os.path.abspath(os.fspath(checkpoint_id))
        self.save_id = uuid.uuid4().hex
        self._claim.path_by = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return "://" not in str(checkpoint_id)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._claim.begin(self.path)  # Note [One writer runs one save at a time]
        self.rank = kwargs.get("rank") or 0

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        if self.path is None:
            raise TbaConfigError("no checkpoint path: pass path= or checkpoint_id=")
        parent = os.path.dirname(self.path)
        try:
            os.makedirs(parent, exist_ok=True)
        except OSError as err:
            raise checkpoint_error(err, "creating the checkpoint's parent directory", parent) from err
        if not os.access(parent, os.W_OK):
            raise TbaConfigError(f"cannot write checkpoints in {parent}: it is read-only or not "
                                 "writable by this user; save to a writable directory")
        if is_working_directory(self.path):  # publishing exchanges the directory and deletes the old one
            raise TbaConfigError(f"{self.path} is this process's working directory, which a save would replace and "
                                 "delete; pass a directory inside it, such as 'ckpt/step100'")
        if os.path.lexists(self.path):
            if not self.overwrite:
                raise TbaConfigError(f"a checkpoint exists at {self.path}; pass overwrite=True or "
                                     "choose a new path")
            if not os.path.isdir(self.path) or not is_checkpoint_dir(self.path):
                raise TbaConfigError(f"{self.path} exists and is not a checkpoint directory; "
                                     "choose a new path (tba never replaces other files)")
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        parent, name = os.path.split(self.path)
        remove_stale_partials(parent, name)  # Note [Whose partial directory is dead]
        staging = os.path.join(parent, staging_name(name, self.save_id))
        self._staging = staging
        ACTIVE_STAGING.add(staging)
        try:
            os.mkdir(staging)
            self._staging_fd = hold_staging(staging)
        except OSError as err:
            self._release_staging()
            shutil.rmtree(staging, ignore_errors=True)
            raise checkpoint_error(err, "creating the staging directory", parent) from err
        return [dataclasses.replace(plan, storage_data=_FilePlan(f"__{i}_", staging))
                for i, plan in enumerate(plans)]

    def _entries(self, plan: SavePlan, planner: SavePlanner) -> list[_layout.Entry]:
        entries = []
        for item in sorted(plan.items, key=lambda i: i.type != WriteItemType.BYTE_IO):
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                entries.append(_layout.Entry(item.index, bytes(data.getbuffer())))
            else:
                entries.append(_layout.tensor_entry(item.index, data))
        return entries

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        file_plan: _FilePlan = plan.storage_data
        file_name = f"{file_plan.prefix}0{DATA_SUFFIX}"
        path = os.path.join(file_plan.staging, file_name)
        snapshot_told = False

        def snapshot_done() -> None:
            nonlocal snapshot_told
            if not snapshot_told and self.on_snapshot is not None:
                snapshot_told = True
                self.on_snapshot()

        try:
            entries = self._entries(plan, planner)
            file_bytes = _layout.place(entries)
            image = self._pool.get(align_up(file_bytes))
            os.makedirs(file_plan.staging, exist_ok=True)
            start = time.perf_counter()
            # Note: [One engine per save]
            # DCP builds a writer per save and never closes it (dcp.save(sd, storage_writer=W(p))),
            # so an engine kept by the writer leaked a ring descriptor and a thread per save. The
            # engine lives exactly as long as one save's writes; an Engine passed in is the caller's.
            # The file first: a full disk fails it before any engine (its ring and thread) exists to leak.
            fd, _ = create_preallocated(path, align_up(file_bytes), directory=os.path.dirname(file_plan.staging))
            engine = None
            try:
                engine = self._backend if isinstance(self._backend, Engine) else make_engine(
                    self._backend, queue_depth=self._queue_depth)
                _layout.write_image(engine, fd, image, entries, file_bytes,
                                    chunk_bytes=self.chunk_bytes,
                                    check_snapshot=self.check_snapshot, on_snapshot=snapshot_done)
                os.ftruncate(fd, file_bytes)
                os.fsync(fd)
            finally:
                os.close(fd)
                if engine is not None and engine is not self._backend:
                    engine.close()
            self.last_write_s = time.perf_counter() - start
            self.last_write_bytes = file_bytes
        except BaseException as err:
            shutil.rmtree(file_plan.staging, ignore_errors=True)
            ACTIVE_STAGING.discard(file_plan.staging)
            self._release_staging()
            if isinstance(err, OSError):
                raise checkpoint_error(err, "writing the checkpoint", os.path.dirname(file_plan.staging)) from err
            raise
        finally:
            snapshot_done()
        results = [
            WriteResult(index=e.key, size_in_bytes=e.length,
                        storage_data=StorageInfo(file_name, e.offset, e.length))
            for e in entries
        ]
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        staging = self._staging
        metadata.version = DCP_VERSION
        metadata.storage_data = {r.index: r.storage_data for rank in results for r in rank}
        metadata.storage_meta = self.storage_meta()
        parent = os.path.dirname(self.path)
        try:
            with open(os.path.join(staging, METADATA_NAME), "wb") as stream:
                pickle.dump(metadata, stream)
                stream.flush()
                os.fsync(stream.fileno())
            fsync_path(staging)
            if self.before_publish is not None:
                self.before_publish()
            replaced = swap_into_place(staging, self.path, self.overwrite)
        except (OSError, TbaCheckpointError) as err:
            shutil.rmtree(staging, ignore_errors=True)
            if isinstance(err, TbaCheckpointError):  # Note [Files added to the path while a save runs]
                raise
            raise checkpoint_error(err, "publishing the checkpoint", parent) from err
        finally:
            ACTIVE_STAGING.discard(staging)
            self._release_staging()
        if replaced is not None:
            remove_replaced(replaced)
        logger.debug("tba: checkpoint %s published", self.path)

    def _release_staging(self) -> None:
        """Drop the staging directory's lock (Note [Whose partial directory is dead]) and the writer's claim (Note [A
        failed lazy save lets go of its writer] in ``tba/checkpoint/_claim.py``) once the save has ended, however."""
        self._claim.end()
        ACTIVE_STAGING.discard(self._staging)
        fd, self._staging_fd = self._staging_fd, -1
        if fd >= 0:
            release_staging(fd)

    def close(self) -> None:
        """Release the staging copy kept for ``async_save`` (engines are closed by each save itself)."""
        BlockingAsyncStager.close(self)
