"""Waiting for a read in the caller's thread, and what a failed or changed read raises.

The base of :class:`~tba.runtime._reads.StoreReads` (the read half of
:class:`tba.runtime._store.StorageStore`, which sets every attribute used here):

* :meth:`StoreReadWait.wait_read` blocks the unpack that needs a read still in flight, outside the
  store's lock, and turns the read's own failure into a :class:`~tba.errors.TbaReadError` naming the
  tensor and the file (Note [A device error reading back is a read error]);
* :meth:`StoreReadWait._verify` compares the bytes read back with the checksum taken when they were
  written (``verify=True``).
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

import torch

from tba._control import wait
from tba._outcome import Outcome
from tba._trace import nvtx_range
from tba.errors import TbaError, TbaReadError
from tba.io import checksum
from tba.runtime._entry import StorageEntry

if TYPE_CHECKING:
    from tba.io import SpillFile
    from tba.runtime._prefetch import PrefetchWindow
    from tba.runtime._stats import OffloadStats


class StoreReadWait:
    """Waits and checks of :class:`~tba.runtime._reads.StoreReads`."""

    lock: threading.RLock
    stats: OffloadStats
    window: PrefetchWindow
    spill: SpillFile | None

    def _verify(self, entry: StorageEntry, data: torch.Tensor) -> TbaReadError | None:
        """None when ``data`` has the checksum ``entry`` was written with, else the error to raise."""
        got = checksum(data)
        with self.lock:
            self.stats.bytes_verified += entry.nbytes
        if got == entry.checksum:
            return None
        return TbaReadError(
            f"verify: {entry.describe()} read back from the spill file in {self.spill.directory} (offset "
            f"{entry.offset}, {entry.extent_bytes} bytes) differs from what was written (CRC-32C {got:#010x}, "
            f"written {entry.checksum:#010x}): the file was changed underneath tba (another process, a punched "
            "hole, a failing disk); its gradients cannot be computed, run the step again"
        )

    # Note: [A device error reading back is a read error]
    # Only OSError became TbaReadError here. A staged read also fails in its device calls: the
    # host-to-device copy, the event after it, the read buffer's allocation event (a CUDA error
    # after a kernel fault, cudaErrorMemoryAllocation creating an event), and the fake or real
    # kvikio raises RuntimeError for I/O. Those reached backward as the bare RuntimeError of
    # whichever call failed, naming neither the tensor nor the file (tests/device/test_sim_faults.py,
    # a copy fault injected into the simulated device). Every failure of a read is a TbaReadError
    # now, with the cause chained; a TbaError passes as it is, and running out of memory stays
    # torch.OutOfMemoryError (or MemoryError), which training loops catch to retry smaller. Only the
    # read's own error is wrapped: one a signal handler raised while the thread waited is the user's
    # and reaches them as it is (tests/runtime/test_async_exceptions.py).

    def wait_read(self, entry: StorageEntry, done: Outcome) -> tuple[torch.Tensor, Any]:
        start = time.perf_counter()
        try:
            with nvtx_range("wait_read"):
                result = wait(done)
        except (TbaError, torch.OutOfMemoryError, MemoryError):
            del done  # Note [A failed outcome is no local of the frames it is raised through] in tba/_outcome.py
            raise
        except Exception as err:  # Note [A device error reading back is a read error]
            # Note [A failed outcome is no local of the frames it is raised through] in tba/_outcome.py
            failed, done = done.failed_with(err), None
            if not failed:
                raise
            raise TbaReadError(
                f"cannot read back {entry.describe()}: spill file in {self.spill.directory}, "
                f"offset {entry.offset}, {entry.extent_bytes} bytes: {err}"
            ) from err
        with self.lock:
            self.stats.unpacks_waited += 1
            self.stats.unpack_wait_s += time.perf_counter() - start
            self.window.note_wait()
        return result
