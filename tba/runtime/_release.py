"""What happens to a storage's bytes in memory: released, pages discarded, kept after a failed write.

The lifetime half of :class:`tba.runtime._store.StorageStore`:

* :meth:`StoreRelease.release` drops tba's reference to an entry's bytes and accounts for it;
* a written host storage that tba alone holds has its pages handed back to the kernel first
  (``tba/runtime/_trim.py``, Note [Whose pages tba may discard]); one the program still uses
  lingers until a bounded sweep finds it unused (Note [A bounded sweep per tensor]);
* a write that failed (a full disk) keeps its storage in memory, warned about once per directory and
  cause (Note [A file-size limit is one cause]).

Every method runs under the store's lock.
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import resource
import threading
from typing import TYPE_CHECKING

import torch

from tba import defaults
from tba._fork_lock import ForkSafeLock
from tba.errors import EngineClosedError, error_summary, names_cuda_error
from tba.io import FULL_DISK_ERRNOS, checksum
from tba.runtime._entry import State, StorageEntry
from tba.runtime._trim import discard_pages, sole_owner, trimmer

if TYPE_CHECKING:
    from tba.device import Routes
    from tba.io import SpillFile
    from tba.runtime._prefetch import PrefetchWindow
    from tba.runtime._stats import OffloadStats

logger = logging.getLogger("tba")

# A full disk is reported once per process, directory and errno, not once per context: successive
# one-shot contexts (one per step) would otherwise repeat the same warning every step.
_WARNED_WRITE_ERRORS: set[tuple[str, int | str | None]] = set()
_WARNED_LOCK = ForkSafeLock()
_WARNED_MOVED = False
"""Whether a storage resized under its write was warned about (once per process)."""


def _fresh_in_child() -> None:
    """A forked child is a process of its own: it warns for itself."""
    _WARNED_WRITE_ERRORS.clear()


os.register_at_fork(after_in_child=_fresh_in_child)


class StoreRelease:
    """The release half of :class:`~tba.runtime._store.StorageStore`, which sets every attribute used here."""

    lock: threading.RLock
    stats: OffloadStats
    window: PrefetchWindow
    live_entries: int
    spill: SpillFile | None
    routes: Routes | None
    verify: bool
    _warned_verify_device: bool
    _lingering: collections.deque[tuple[StorageEntry, torch.Tensor]]
    pages_discarded_bytes: int

    def _release_written(self, entry: StorageEntry) -> None:
        """Drop a written storage's bytes; a host storage's pages go back to the kernel (``tba/runtime/_trim.py``).

        Its pages are discarded only while tba holds the last reference. While the program still
        uses the tensor, the entry is released as usual (unpack reads the file), but a hidden
        reference lingers in ``_lingering`` until :meth:`_sweep_written`, at the next save or
        unpack, finds it the last one: then the pages go back to the kernel before the memory is freed.
        """
        data = entry.data
        if data is not None and entry.own_memory and self.routes is not None and entry.route is self.routes.host:
            if sole_owner(entry.cdata):
                self._discard_pages(entry, data)
            else:
                self._lingering.append((entry, data))
        self.release(entry)

    # Note: [Release after unpack]
    # A storage whose write completed after the prefetch window asked to hold it (the end of forward
    # came first) keeps its original memory until backward has unpacked it. Its release then goes
    # through _release_written like any written storage's, so that its pages go back to the kernel
    # too: whether they did depended on which came first, the write or the end of forward (a test
    # failed on a loaded machine). Bytes read back into a pool buffer are only dropped.

    def _sweep_written(self, limit: int | None = defaults.LINGER_SWEEP_PER_CALL) -> None:
        """Free lingering written storages that the program has stopped using, pages first.

        Note: [A bounded sweep per tensor]
        Saves and unpacks each look at ``limit`` lingering storages, oldest first, and move those still in
        use to the back: a program that holds thousands of saved outputs (a list of per-sample results)
        made every save and unpack scan all of them, quadratic in the tensors per step. ``limit=None``
        (at the end of forward and of backward) looks at every one.
        """
        lingering = self._lingering
        count = len(lingering) if limit is None else min(limit, len(lingering))
        for _ in range(count):
            entry, data = held = lingering.popleft()
            if sole_owner(entry.cdata):
                self._discard_pages(entry, data)
            else:
                lingering.append(held)

    def _discard_pages(self, entry: StorageEntry, data: torch.Tensor) -> None:
        """Hand the pages of ``entry``'s storage, which ``data`` alone holds now, back to the kernel.

        Note: [Only the memory a storage was saved with is discarded]
        The program may have resized the storage since its save (``untyped_storage().resize_``, which moves it to a
        new allocation): its pages went back from the new address over the size it was saved with, zeroing whatever
        the heap held after a smaller one (glibc aborted with "double free or corruption" where, without tba, torch
        raises a clear error at backward: helper-108). Only a storage at the address and size it was saved with
        has its pages discarded; another is only dropped. Either way it is never served live again.
        """
        entry.pages_discarded = True
        if _in_saved_memory(entry, data):
            self.pages_discarded_bytes += discard_pages(entry.address, entry.nbytes)

    def start_forward(self) -> None:
        """A forward begins: what the prefetch window held or read back for the last one's backward is let go of.

        Note: [A new forward lets go of what backward did not use]
        The end of forward holds the last layer's storages, and reads those below within the budget, for the backward
        that comes next. Several forwards before one backward (micro-batches summed into one loss, a pipeline's
        warm-up) kept each forward's share: under a 2 MiB budget a reusable offloader held 3 to 7 MiB after eight forwards,
        one storage more every few. So a forward first lets go of what no backward has used yet: a written storage's
        memory (its pages first), bytes read back, and, once written, a storage whose write is still running; backward
        reads them when it gets there. A held write that was skipped meanwhile stays in memory (nothing is on disk).
        """
        with self.lock:
            if self.live_entries:
                for entry in self.window:
                    if entry.state is State.DEAD or entry.fully_unpacked:
                        continue
                    entry.hold_for_backward = False
                    if entry.state is State.ON_DISK and entry.data is not None:
                        self._release_written(entry)
            self.window.reset_cursor()

    def release(self, entry: StorageEntry) -> None:
        """Drop tba's reference to ``entry``'s bytes in memory."""
        if entry.data is not None:
            entry.data = None
            entry.ready_event = None
            self.stats.resident_bytes -= entry.nbytes  # a release never raises the peak: no _resident call
            trimmer.note_released(entry.nbytes)

    def _resident(self, delta_bytes: int) -> None:
        stats = self.stats
        stats.resident_bytes += delta_bytes
        stats.peak_resident_bytes = max(stats.peak_resident_bytes, stats.resident_bytes)

    def _skip_unwritten(self, entry: StorageEntry) -> None:
        """A write skipped because backward already used the storage, or will take it from memory: a live one
        stays in memory, silently (one the prefetch window holds still counts in its budget until unpacked)."""
        entry.io_error = None
        if entry.state is not State.DEAD:
            entry.state = State.KEPT
            if not entry.hold_for_backward:
                self.window.discount(entry)
        self._free_extent(entry)
        self.stats.writes_skipped += 1
        self.stats.bytes_write_skipped += entry.nbytes

    def _keep_after_write_error(self, entry: StorageEntry) -> None:
        error, entry.io_error = entry.io_error, None
        end_bytes = entry.offset + entry.extent_bytes
        self._keep_unwritten(entry)
        self._warn_write_failed(error, end_bytes)

    def _keep_unwritten(self, entry: StorageEntry) -> None:
        """Keep ``entry`` in memory in place of a write that failed or cannot be trusted (``stats.tensors_kept_on_error``)."""
        entry.state = State.KEPT
        if not entry.hold_for_backward:  # a held one stays counted until unpacked, as in _skip_unwritten
            self.window.discount(entry)
        self._free_extent(entry)
        self.stats.tensors_kept_on_error += 1
        self.stats.bytes_kept_on_error += entry.nbytes

    @staticmethod
    def _moved_under_write(entry: StorageEntry) -> bool:
        """Whether ``entry``'s storage left the memory it was saved with before its write ended.

        Note: [A storage resized under its write is kept in memory]
        A write reads the storage's memory at the address taken when its save job ran. A program that resized the
        storage after that (``untyped_storage().resize_``, which moves it to a new allocation and frees the old one)
        and before the engine got to it had the freed memory written, and backward read that back as the saved
        tensor: a gradient of whatever the heap held, with no error, where torch alone refuses the shrunken tensor
        at backward (helper-108 found the read of freed memory). The write is not trusted then: the storage stays in
        memory as the program left it, and backward sees what it would see without tba.
        """
        data = entry.data
        return data is not None and not _in_saved_memory(entry, data)

    def _keep_moved(self, entry: StorageEntry) -> None:
        """Keep ``entry``, whose storage moved under its write, in memory (Note [A storage resized under its write is
        kept in memory]); one warning per process."""
        global _WARNED_MOVED
        self._keep_unwritten(entry)
        with _WARNED_LOCK:
            first, _WARNED_MOVED = not _WARNED_MOVED, True
        (logger.warning if first else logger.debug)(
            "tba: the program resized the storage of a saved tensor (untyped_storage().resize_) while tba was writing "
            "it; it stays in memory as the program left it, and backward sees what it would without tba")

    def _warn_write_failed(self, error: BaseException, end_bytes: int, kept: bool = True) -> None:
        """Log a failed write: a warning the first time per directory and cause, else at debug level. ``kept``: its
        storage stays in memory (False: it had died, and nothing is kept or counted)."""
        cause, fix = write_error_cause(error, end_bytes)
        text = error_summary(error)  # Note [A log record holds no failed save's frames] in tba/errors.py
        key = (self.spill.directory, cause)
        with _WARNED_LOCK:
            first = key not in _WARNED_WRITE_ERRORS
            _WARNED_WRITE_ERRORS.add(key)
        outcome = "kept in memory" if kept else "its storage had died, nothing kept"
        if not first:
            logger.debug("tba: write to %s failed again (%s); %s", self.spill.directory, text, outcome)
        else:
            logger.warning("tba: writing activations to %s failed (%s); keeping them in memory instead and training "
                           "goes on (stats.bytes_kept_on_error counts them%s). %s", self.spill.directory, text,
                           "" if kept else "; this one's storage had died, so nothing was kept", fix)

    def _checksum_written(self, entry: StorageEntry) -> None:
        """Record the CRC-32C of the bytes just written (a function of its own: no reference outlives it)."""
        data = entry.data
        if data is None:
            return
        # By route, not by ``device.type``: the simulated device's storages are CPU tensors, and a
        # read-back checksum of one ran on the host before its host-to-device copy had (a spurious
        # TbaReadError there, and a code path the GPU never takes).
        if self.routes is not None and entry.route is self.routes.host:
            entry.checksum = checksum(data)
        elif not self._warned_verify_device:
            self._warned_verify_device = True
            logger.warning("tba: verify=True checks host storages only; %s storages are not checksummed",
                           data.device.type)

    def _free_extent(self, entry: StorageEntry) -> None:
        if entry.offset >= 0:
            self.spill.free(entry.offset)
            entry.offset = -1


def _in_saved_memory(entry: StorageEntry, data: torch.Tensor) -> bool:
    """Whether ``data``, the bytes of ``entry``'s storage, are still at the address and size they were saved with (Notes
    [Only the memory a storage was saved with is discarded], [A storage resized under its write is kept in memory])."""
    return data.data_ptr() == entry.address and data.untyped_storage().nbytes() == entry.nbytes


def write_error_cause(error: BaseException | None, end_bytes: int) -> tuple[int | str | None, str]:
    """The cause a failed write that would have ended ``end_bytes`` into the file is warned about once for
    (an errno), and the fix the warning names.

    Note: [A file-size limit is one cause]
    Under a file-size limit (``ulimit -f``, ``RLIMIT_FSIZE``) the kernel cuts a write that crosses the
    limit to end there, which under ``O_DIRECT`` is an unaligned size and fails with ``EINVAL``; the
    writes past the limit fail with ``EFBIG``. Both are the limit: one warning naming it, not two
    naming "Invalid argument" and "File too large" and telling the user to free space.
    """
    number = getattr(error, "errno", None)
    limit, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    if number in (errno.EFBIG, errno.EINVAL) and limit != resource.RLIM_INFINITY and end_bytes > limit:
        return errno.EFBIG, (f"This process has a file-size limit of {limit} bytes (ulimit -f), which stops the spill "
                             "file there, in any directory: raise it (ulimit -f unlimited) before starting training.")
    if isinstance(error, EngineClosedError):
        # Not the disk: the engine given as backend= was closed, or came from the parent through fork() (a forked
        # child's io_uring engine refuses all work), and the warning said to check the disk.
        return "engine closed", ("The engine passed as backend= is closed, or was made before this process was "
                                 "forked (each process needs its own): pass a backend name, or a new engine.")
    if number is None and names_cuda_error(error):
        # The device's copy to or from the staging block failed, not the file (after an illegal access, every
        # later CUDA call fails): freeing disk space would not help.
        return None, "The GPU failed, not the disk: the CUDA error above is the cause; fix it, the directory is fine."
    if error is not None and not isinstance(error, OSError):
        # Not the disk's answer: the engine itself failed (a thread it could not start: "can't start new thread").
        return type(error).__name__, ("The I/O engine failed, not the disk: the error above says why (a limit on "
                                      "threads or memory?); fix that, or pass backend= another engine.")
    # Only a full disk is fixed by freeing space: one remounted read-only after an error (ext4's errors=remount-ro)
    # or failing with EIO was told to free space there.
    if number in FULL_DISK_ERRNOS:
        return number, "Free space there or pass another directory."
    if number == errno.EROFS:
        return number, ("The file system became read-only (a disk error makes ext4 remount so: see dmesg); fix the disk "
                        "or pass another directory.")
    return number, "Check the disk (dmesg) or pass another directory."


# Note: [A failed write's warning never raises]
# The warning runs where a write's failure is settled: ``_finish_write`` (an engine's thread, before
# ``_transfer_ended`` wakes ``flush``) and ``_write_not_queued`` (after the entry is kept, before the save goes on
# with it). An error whose ``__str__`` raised went up from there: the entry stayed kept but registered, and the
# save job kept the tensor a second time, the entry live for good (a one-shot offloader never closed its file).
# So its text is read by :func:`tba.errors.error_text`, which gives "" instead of raising.
