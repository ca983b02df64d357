"""Lazy asynchronous checkpoints: training stops only for what has not been copied yet.

DataStates-LLM's observation: parameters and optimizer state do not change between one optimizer
step and the next, so a checkpoint taken right after a step can be copied while the next forward
and backward run, and written to storage after that, while training goes on. Only the next
optimizer step, the first thing that modifies those tensors, has to wait for the copy.

:meth:`LazyCheckpointer.save` does, in the caller's thread, only what must see the state as it
is now: it copies the container structure and every non-tensor value (``copy.deepcopy``, cheap),
checks that DCP can store them, checks the destination, and starts one background thread. That
thread runs ``dcp.save`` (single process, ``no_dist``) with a :class:`TbaStorageWriter` whose
file image lives in a host buffer reused from one checkpoint to the next; the writer copies each
tensor into the image and queues its chunks to the engine as soon as they are complete, then
calls back when the last tensor is copied (the *snapshot*). The returned :class:`LazyCheckpoint`
offers :meth:`~LazyCheckpoint.wait_snapshot` (call it before modifying any saved tensor, or let
:meth:`LazyCheckpointer.guard` register an optimizer step pre-hook that does) and
:meth:`~LazyCheckpoint.wait` (the checkpoint is durable and published), plus an ``on_done``
callback.

Tensors modified during forward (e.g. BatchNorm running statistics) are not protected by the
step hook: call ``wait_snapshot()`` before the forward pass if the state dict holds such buffers.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.stateful import Stateful

from tba import _sched
from tba.checkpoint._frozen import StepWatch, check_unchanged, forget_watches_in_child, freeze, start_watch, stop_watch
from tba.checkpoint._handle import LazyCheckpoint
from tba.checkpoint._io import DEFAULT_QUEUE_DEPTH, Engine, ImagePool, TbaConfigError, TbaError, interrupt_in, size_bytes
from tba.checkpoint._pending import begin_save, wait_for_earlier_saves
from tba.checkpoint._publish import hold_staging, release_staging
from tba.checkpoint._stale import remove_dead_warm_ups, warm_up_prefix
from tba.checkpoint._writer import TbaStorageWriter

logger = logging.getLogger("tba")


def _unwrap(err: BaseException) -> BaseException:
    """tba's own error from inside DCP's ``CheckpointException`` (which wraps each rank's), else ``err``: a
    ``TbaConfigError`` from the save thread too, whose message ``wait()`` then gives alone, not DCP's report."""
    failures = err.failures.values() if isinstance(err, CheckpointException) else ()
    return next((failure[0] for failure in failures if isinstance(failure[0], TbaError)), err)


_warmed_up = False


def _warm_up_in_caller(backend: str, queue_depth: int, fallback_dir: str | None = None) -> None:
    """Take one tiny checkpoint into a temporary directory in the calling thread, once per process.

    Note: [Fork while the save thread runs]
    torch and Python initialise some things on first use: C++ function-local statics (``is_pinned``
    reaches ``at::detail::getMTIAHooks``) and lazy imports (``torch.save`` imports its serialization
    config), each under a lock. If the save thread is the first to get there and the process forks
    meanwhile (a DataLoader worker, a user's ``os.fork``), the child inherits that lock held by a
    thread it does not have, and its own first checkpoint waits for ever (seen in CI: a child's
    ``save_lazy`` hung in ``__cxa_guard_acquire``, and in an import's module lock). Running the whole
    save path once here, in the thread that is about to start the save thread and so cannot be
    forking, leaves the background thread only steady-state work, whose locks fork handles.
    """
    global _warmed_up
    if _warmed_up:
        return
    # Note: [A full temporary directory does not fail the save]
    # The warm-up wrote to the temporary directory only: with /tmp full (or $TMPDIR unusable) every
    # save_lazy raised DCP's CheckpointException about that directory (a BaseException, which
    # except Exception does not catch), though the checkpoint's own directory was fine (helper-99). It
    # falls back to the checkpoint's parent (checked writable already), and if that fails too the
    # save goes on without it: the save reports its own errors, and the warm-up runs at a later save.
    for directory in dict.fromkeys((None, fallback_dir)):
        writer = TbaStorageWriter(backend=backend, queue_depth=queue_depth, image_pool=ImagePool())
        try:
            remove_dead_warm_ups(directory or tempfile.gettempdir())
            with tempfile.TemporaryDirectory(prefix=warm_up_prefix(), dir=directory) as scratch:
                # Note [A warm-up killed mid-way is removed by the next] in tba/checkpoint/_stale.py
                held = hold_staging(scratch)
                try:
                    writer.reset(os.path.join(scratch, "warm_up"))
                    dcp.save({"warm_up": torch.zeros(8, device="cpu")}, storage_writer=writer, no_dist=True)
                finally:
                    release_staging(held)
            _warmed_up = True
            return
        except (Exception, CheckpointException) as err:  # noqa: BLE001 - DCP wraps errors in its own BaseException
            interrupt = interrupt_in(err)  # Note [A Ctrl-C inside DCP stays a Ctrl-C] in tba/checkpoint/_io.py
            if interrupt is not None:
                raise interrupt from None
            message = str(_unwrap(err)).strip().splitlines() or [type(err).__name__]
            logger.info("tba: warming up checkpoints in %s failed: %s", directory or tempfile.gettempdir(), message[-1][:200])
        finally:
            writer.close()


_CHECKPOINTERS: weakref.WeakSet[LazyCheckpointer] = weakref.WeakSet()
"""Every live checkpointer, reset in a forked child (Note [Lazy checkpoints and fork])."""


class LazyCheckpointer:
    """Takes lazy checkpoints one after the other, reusing one engine and one host buffer.

    Args:
        backend: Engine backend (``"auto"``, ``"io_uring"``, ``"threads"``) or an Engine.
        queue_depth: Write requests in flight. Default 8.
        reserve_bytes: Host buffer to allocate and touch now (bytes, or a size such as "2G"), about the checkpoint's
            size; otherwise the first save allocates it and its snapshot is slower.
    """

    def __init__(self, *, backend: str = "auto", queue_depth: int = DEFAULT_QUEUE_DEPTH,
                 reserve_bytes: int | str = 0) -> None:
        reserve_bytes = size_bytes("reserve_bytes", reserve_bytes)
        self._settings = (backend, queue_depth)
        self._pool = ImagePool(reserve_bytes)
        self._writer = TbaStorageWriter(backend=backend, queue_depth=queue_depth, image_pool=self._pool)
        self._latest: LazyCheckpoint | None = None
        self._lock = threading.Lock()
        self._guarded: weakref.WeakKeyDictionary[torch.optim.Optimizer, Any] = weakref.WeakKeyDictionary()
        _CHECKPOINTERS.add(self)

    def _after_fork_in_child(self) -> None:
        """In a forked child: the parent's save thread does not exist here; forget its checkpoint.

        Note: [Lazy checkpoints and fork]
        A child that waited for the parent's in-flight checkpoint waited for ever (its thread stays
        in the parent), and its host buffer may be half-copied. The child starts afresh: a new lock,
        writer and buffer; the parent's checkpoint is the parent's to finish.
        """
        self._lock = threading.Lock()
        backend, queue_depth = self._settings
        self._pool = ImagePool()
        self._writer = TbaStorageWriter(backend=backend, queue_depth=queue_depth, image_pool=self._pool)
        self._latest = None

    @property
    def latest(self) -> LazyCheckpoint | None:
        """The most recent checkpoint handle, or None."""
        return self._latest

    def save(self, state_dict: dict[str, Any], path: str | os.PathLike, *,
             on_done: Callable[[LazyCheckpoint], None] | None = None) -> LazyCheckpoint:
        """Start a checkpoint of ``state_dict`` to directory ``path`` and return at once.

        Until the handle's :meth:`~LazyCheckpoint.wait_snapshot` returns, the tensors in
        ``state_dict`` must not be modified. Top-level values with ``state_dict()`` (modules,
        optimizers: DCP's ``Stateful``) are replaced by their state dicts now, as DCP does. A
        previous checkpoint still being written is waited for first (its host buffer is reused).

        Raises:
            TbaConfigError: A value DCP cannot store, or a destination that cannot be written.
        """
        if not isinstance(state_dict, dict):
            raise TbaConfigError(f"state_dict must be a dict, got {type(state_dict).__name__}")
        frozen, watched = freeze({k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state_dict.items()})
        if not isinstance(path, (str, os.PathLike)):
            raise TbaConfigError(f"path must be the checkpoint's directory (a str or os.PathLike), got {path!r}")
        if on_done is not None and not callable(on_done):  # else its TypeError reached the log only, at the end
            raise TbaConfigError(f"on_done must be a function taking the handle, or None, got {on_done!r}")
        path = os.path.abspath(os.fspath(path))
        with self._lock:
            previous = self._latest
            if previous is not None and not previous.done():
                logger.info("tba: checkpoint %s waits for %s to finish", path, previous.path)
                previous._done.wait()
            self._writer._retarget(path)  # the save runs in its own thread (Note [One writer runs one save at a time])
            self._writer.prepare_local_plan(None)  # refuses a bad destination before the save is registered
            _warm_up_in_caller(*self._settings, os.path.dirname(path))
            handle = LazyCheckpoint(path, on_done)
            begin_save(path, handle._done)  # Note [A load waits for the saves to its path]
            watch = thread = None
            try:
                self._writer.on_snapshot = handle._mark_snapshot
                # Note [A tensor changed before the lazy copy read it]
                # and Note [A fused optimizer step bumps no version]
                watch = StepWatch(watched, self._guards)
                self._writer.check_snapshot = lambda: check_unchanged(watched, path, watch)
                # Note [Lazy saves to one path publish in call order]
                self._writer.before_publish = lambda: wait_for_earlier_saves(handle._done)
                self._latest = handle
                # Note: [A checkpoint started is finished at exit]
                # The save thread is not a daemon: the interpreter joins it before it exits, so a script
                # whose last act is save_lazy publishes its checkpoint. A daemon thread was ended in the
                # middle of torch's C++ code during finalization ("terminate called without an active
                # exception", abort) and left a partial directory.
                thread = threading.Thread(target=self._run, args=(frozen, handle, watch), name="tba-ckpt", daemon=False)
                start_watch(watch)
                thread.start()
            except BaseException as err:
                # Note: [A save registered is always ended]
                # Once registered, a save has no thread to end it until thread.start() returns. A failed
                # start, or a Ctrl-C in between (a KeyboardInterrupt lands between any two statements),
                # left it registered for ever: the next load or save of the path, and close(), waited
                # for it for ever (helper-91). It ends here, failed, so they go on.
                if thread is not None and thread.ident is not None:
                    raise  # the thread runs: it ends the save
                if watch is not None:
                    stop_watch(watch)
                handle._finish(err)
                raise
        if not threading.main_thread().is_alive():
            # Note: [A save started at exit is waited for]
            # The interpreter joins non-daemon threads before it runs atexit handlers: a save started by one
            # (atexit.register(lambda: save_lazy(...))) was never joined, the interpreter finalized under it,
            # and nothing was published, or the process aborted ("terminate called without an active
            # exception"; helper-153). Once the main thread has ended, save() returns when the save has ended.
            handle._done.wait()
        return handle

    def _guards(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer.step()`` still runs this checkpointer's :meth:`guard` hook."""
        handle = self._guarded.get(optimizer)
        hooks = getattr(optimizer, "_optimizer_step_pre_hooks", None)
        return handle is not None and (hooks is None or handle.id in hooks)

    def _run(self, state_dict: dict[str, Any], handle: LazyCheckpoint, watch: StepWatch) -> None:
        _sched.background()
        error = None
        try:
            dcp.save(state_dict, storage_writer=self._writer, no_dist=True)
            handle.bytes_written = self._writer.last_write_bytes
            handle.write_s = self._writer.last_write_s
        except BaseException as err:  # noqa: BLE001 - reported through the handle
            error = _unwrap(err)  # logged unwrapped: DCP's CheckpointException prints each rank's whole traceback
            logger.error("tba: checkpoint %s failed: %s", handle.path, error)
        finally:
            self._writer._claim.end_if_mine()  # Note [A failed lazy save lets go of its writer] in tba/checkpoint/_claim.py
        stop_watch(watch)
        handle._finish(error)

    def wait_snapshot(self) -> float:
        """Wait for the latest checkpoint's snapshot, if any; returns the seconds waited."""
        latest = self._latest
        return latest.wait_snapshot() if latest is not None else 0.0

    def guard(self, optimizer: torch.optim.Optimizer) -> Any:
        """Make ``optimizer.step()`` wait for the latest snapshot; returns the hook's handle."""

        def wait_before_step(*_: object) -> None:
            self.wait_snapshot()

        register = getattr(optimizer, "register_step_pre_hook", None)
        if not callable(register):
            raise TbaConfigError(f"guard takes a torch.optim.Optimizer (whose step() changes the saved tensors), got "
                                 f"{type(optimizer).__name__}; pass the optimizer, not the model")
        handle = register(wait_before_step)
        self._guarded[optimizer] = handle
        return handle

    def close(self) -> None:
        """Wait for the latest checkpoint, then release the host buffer (a later save allocates a new one)."""
        latest = self._latest
        if latest is not None:
            latest._done.wait()
        self._writer.close()
        self._pool.release()

    def __repr__(self) -> str:
        backend, queue_depth = self._settings
        name = backend.name if isinstance(backend, Engine) else backend
        return f"LazyCheckpointer(backend={name!r}, queue_depth={queue_depth}, latest={self._latest!r})"

    def __enter__(self) -> LazyCheckpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_default: LazyCheckpointer | None = None
_default_lock = threading.Lock()


def _reset_in_child() -> None:
    global _default_lock
    _default_lock = threading.Lock()
    forget_watches_in_child()
    for checkpointer in list(_CHECKPOINTERS):
        checkpointer._after_fork_in_child()


os.register_at_fork(after_in_child=_reset_in_child)


def save_lazy(state_dict: dict[str, Any], path: str | os.PathLike, *,
              on_done: Callable[[LazyCheckpoint], None] | None = None) -> LazyCheckpoint:
    """Start a lazy checkpoint with a process-wide :class:`LazyCheckpointer`; see its ``save``."""
    global _default
    with _default_lock:
        if _default is None:
            _default = LazyCheckpointer()
    return _default.save(state_dict, path, on_done=on_done)
