"""File space allocator: aligned extents in one growing file, reused across steps.

Every offloaded storage needs a contiguous range of its spill file. Creating a file per tensor
would cost a metadata round trip each time and litter the directory; instead one file per offload
context holds all of them, and this allocator hands out ``[offset, offset + nbytes)`` ranges.

It is first-fit over a free list kept sorted by offset, with neighbours merged on free. When no
hole fits, the file grows at its end. A training step frees what the previous one allocated and
asks for the same sizes again, so after the first step every request lands in an existing hole and
the file stops growing. All sizes are rounded up to ``alignment_bytes`` so that every extent can
be read and written with ``O_DIRECT``.
"""

from __future__ import annotations

import bisect


class ExtentAllocator:
    """First-fit allocator of aligned file ranges.

    Args:
        alignment_bytes: Every offset and length is a multiple of this. Default 4096.
    """

    def __init__(self, alignment_bytes: int = 4096) -> None:
        if alignment_bytes <= 0 or alignment_bytes & (alignment_bytes - 1):
            raise ValueError(f"alignment_bytes must be a power of two, got {alignment_bytes}")
        self.alignment_bytes = alignment_bytes
        self.end_bytes = 0
        self._free_offsets: list[int] = []
        self._free_sizes: dict[int, int] = {}
        self._used: dict[int, int] = {}

    @property
    def used_bytes(self) -> int:
        """Bytes currently allocated."""
        return sum(self._used.values())

    @property
    def in_use(self) -> bool:
        """Whether any extent is allocated (O(1), unlike :attr:`used_bytes`)."""
        return bool(self._used)

    def allocate(self, nbytes: int) -> int:
        """Reserve at least ``nbytes`` (rounded up to the alignment) and return the offset."""
        if nbytes <= 0:
            raise ValueError(f"nbytes must be positive, got {nbytes}")
        alignment_bytes = self.alignment_bytes
        size = -(-nbytes // alignment_bytes) * alignment_bytes  # round_up, inline: once per storage saved
        for i, offset in enumerate(self._free_offsets):
            hole = self._free_sizes[offset]
            if hole >= size:
                del self._free_offsets[i]
                del self._free_sizes[offset]
                if hole > size:
                    self._insert_free(offset + size, hole - size)
                self._used[offset] = size
                return offset
        offset = self.end_bytes
        self.end_bytes += size
        self._used[offset] = size
        return offset

    def free(self, offset: int) -> None:
        """Return the extent that starts at ``offset``; merges it with free neighbours."""
        size = self._used.pop(offset, None)
        if size is None:
            raise KeyError(f"no extent allocated at offset {offset}")
        i = bisect.bisect_left(self._free_offsets, offset)
        if i < len(self._free_offsets) and offset + size == self._free_offsets[i]:
            after = self._free_offsets.pop(i)
            size += self._free_sizes.pop(after)
        if i > 0:
            before = self._free_offsets[i - 1]
            if before + self._free_sizes[before] == offset:
                self._free_sizes[before] += size
                self._shrink_tail()
                return
        self._insert_free(offset, size)
        self._shrink_tail()

    def _insert_free(self, offset: int, size: int) -> None:
        bisect.insort(self._free_offsets, offset)
        self._free_sizes[offset] = size

    def _shrink_tail(self) -> None:
        """Forget a free hole that ends at the end of the file, so the file may be truncated."""
        if self._free_offsets:
            last = self._free_offsets[-1]
            if last + self._free_sizes[last] == self.end_bytes:
                self._free_offsets.pop()
                del self._free_sizes[last]
                self.end_bytes = last
