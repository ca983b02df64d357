"""A fixed pool of aligned (pinned, when CUDA is present) host blocks for staged transfers.

Device memory cannot be handed to ``pwrite``. The staged route copies a device storage into host
blocks, block by block, and writes each block to the file; reads go the other way. The blocks come
from this pool, which allocates one slab up front (a ``cudaHostAlloc`` per tensor costs
milliseconds, and fresh host memory is slow to touch) and carves it into ``block_bytes`` pieces,
each aligned to :data:`ALIGN_BYTES` so the file I/O can use ``O_DIRECT``.

The pool never grows. When every block is in use, :meth:`StagingPool.acquire` waits until a
transfer completes and releases one: backpressure, not allocation. Writes and reads share it.
"""

from __future__ import annotations

import logging
import threading

import torch

from tba.defaults import ALIGN_BYTES, BLOCK_SIZE_BYTES, STAGING_BYTES
from tba.device._cuda import cuda_api
from tba.errors import TbaConfigError
from tba.io import aligned_empty

logger = logging.getLogger(__name__)


class StagingPool:
    """``capacity_bytes // block_bytes`` host blocks of ``block_bytes`` each.

    Args:
        capacity_bytes: Total size of the slab. Default 256 MiB.
        block_bytes: Size of one block, a multiple of 4096; also the largest piece of one
            transfer. Default 4 MiB.
        pinned: Page-lock the slab (needs CUDA); None (default) pins when CUDA is available.
            When page-locking fails the pool warns and stays pageable (:attr:`pinned` is then False).

    Note: [A slab that cannot be page-locked]
    ``cudaHostRegister`` fails when the locked-memory limit or the host's memory is reached
    (``cudaErrorMemoryAllocation``). The offloader then failed to open with that bare RuntimeError.
    Pageable staging is still exact: a device-to-host ``cudaMemcpyAsync`` into pageable memory returns
    only once the copy is done, and one from pageable memory returns once the source was staged, so
    the events tba records after the copies still order every reuse of a block; the copies only stop
    overlapping the host. So the pool warns and goes on unpinned.
    """

    def __init__(self, capacity_bytes: int = STAGING_BYTES, block_bytes: int = BLOCK_SIZE_BYTES,
                 pinned: bool | None = None) -> None:
        if block_bytes <= 0 or block_bytes % ALIGN_BYTES:
            raise TbaConfigError(f"staging block_bytes must be a positive multiple of {ALIGN_BYTES}, got {block_bytes}")
        if capacity_bytes < block_bytes:
            raise TbaConfigError(
                f"staging capacity ({capacity_bytes} bytes) must hold at least one block of {block_bytes} bytes; "
                "raise staging_bytes"
            )
        if pinned is None:
            pinned = cuda_api().is_available()
        count = capacity_bytes // block_bytes
        self.block_bytes = block_bytes
        self.pinned = pinned
        # Note: [Pinned exactly]
        # torch's pinned allocator (``pin_memory=True``) is a caching allocator that rounds each
        # request up to a power of two: a 256 MiB slab plus alignment slack took 512 MiB of
        # page-locked memory. The slab is ordinary page-aligned memory, touched once, then
        # page-locked in place (``cudaHostRegister``), exactly its size.
        try:
            self._slab = aligned_empty(count * block_bytes)
        except (RuntimeError, MemoryError) as error:
            raise TbaConfigError(f"cannot allocate the {count * block_bytes}-byte staging slab of CUDA storages "
                                 f"({str(error).strip().splitlines()[0][:200]}); lower staging_bytes (the default is "
                                 f"{STAGING_BYTES} bytes)") from None
        self._slab.fill_(0)
        self._cuda = cuda_api() if pinned else None
        if self._cuda is not None:
            try:
                self._cuda.pin(self._slab)
            except Exception as error:  # Note [A slab that cannot be page-locked]
                logger.warning("tba: cannot page-lock the %d-byte staging slab (%s); staging through pageable "
                               "memory instead, which is exact but slower: lower staging_bytes, or raise the "
                               "locked-memory limit (ulimit -l, the container's memlock)", count * block_bytes, error)
                self._cuda = None
                self.pinned = False
        self._free = [self._slab[i * block_bytes : (i + 1) * block_bytes] for i in range(count)]
        self.capacity_blocks = count
        self._cond = threading.Condition()
        self.waits = 0

    @property
    def free_blocks(self) -> int:
        with self._cond:
            return len(self._free)

    def acquire(self) -> torch.Tensor:
        """A free block (a ``uint8`` tensor of ``block_bytes``), waiting for one if none is free."""
        with self._cond:
            if not self._free:
                self.waits += 1
                self._cond.wait_for(lambda: self._free)
            return self._free.pop()

    def close(self) -> None:
        """Unpin the slab (every block must be back). Idempotent."""
        cuda, self._cuda = self._cuda, None
        if cuda is not None:
            cuda.unpin(self._slab)

    def release(self, block: torch.Tensor) -> None:
        """Give a block back; wakes one waiter."""
        with self._cond:
            self._free.append(block)
            self._cond.notify()
