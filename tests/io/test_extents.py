"""ExtentAllocator: first fit, alignment, merging of neighbours, reuse across steps."""

import pytest

from tba.io._extents import ExtentAllocator
from tba.io._memory import round_up


@pytest.mark.parametrize("nbytes, expected", [(1, 4096), (4095, 4096), (4096, 4096), (4097, 8192)])
def test_round_up(nbytes, expected):
    assert round_up(nbytes, 4096) == expected


def test_allocations_are_aligned_and_disjoint():
    alloc = ExtentAllocator(4096)
    offsets = [alloc.allocate(n) for n in (1, 4095, 4097, 10_000)]
    assert offsets == [0, 4096, 8192, 16384]
    assert alloc.end_bytes == 16384 + 12288
    assert alloc.used_bytes == alloc.end_bytes


def test_first_fit_reuses_holes_and_splits_them():
    alloc = ExtentAllocator(4096)
    a, b, c = alloc.allocate(8192), alloc.allocate(8192), alloc.allocate(4096)
    alloc.free(a)
    assert alloc.allocate(4096) == a
    assert alloc.allocate(4096) == a + 4096
    assert alloc.allocate(4096) == c + 4096
    assert b == 8192


def test_free_merges_neighbours_and_shrinks_the_tail():
    alloc = ExtentAllocator(4096)
    offsets = [alloc.allocate(4096) for _ in range(4)]
    alloc.free(offsets[1])
    alloc.free(offsets[2])
    assert alloc.allocate(8192) == offsets[1]
    alloc.free(offsets[1])
    alloc.free(offsets[3])
    assert alloc.end_bytes == 4096
    alloc.free(offsets[0])
    assert alloc.end_bytes == 0 and alloc.used_bytes == 0


def test_steady_state_steps_do_not_grow_the_file():
    alloc = ExtentAllocator(4096)
    sizes = [5000, 1 << 20, 3, 70_000, 1 << 16]
    for _ in range(5):
        offsets = [alloc.allocate(n) for n in sizes]
        high_water = alloc.end_bytes
        for offset in reversed(offsets):
            alloc.free(offset)
    assert high_water == sum(round_up(n, 4096) for n in sizes)


def test_bad_calls_raise():
    alloc = ExtentAllocator(4096)
    with pytest.raises(ValueError):
        alloc.allocate(0)
    with pytest.raises(KeyError):
        alloc.free(4096)
    with pytest.raises(ValueError):
        ExtentAllocator(3000)


def test_a_spill_file_in_use_gives_its_space_back_when_its_last_extent_is_freed(tmp_path):
    """release_space(when_idle=True) on a file in use truncates at the last free; a plain call meanwhile keeps that."""
    import os

    from tba.io import SpillFile, release_idle_space

    spill = SpillFile(str(tmp_path), direct=False)
    try:
        first, second = spill.allocate(1 << 20), spill.allocate(1 << 20)
        os.pwrite(spill.fd, b"x" * (2 << 20), first)
        assert not spill.release_space(when_idle=True), "a file with extents in use was truncated"
        release_idle_space()
        assert os.fstat(spill.fd).st_size > 0, "a file with extents in use was truncated"
        spill.free(first)
        assert os.fstat(spill.fd).st_size > 0, "truncated while an extent was still in use"
        spill.free(second)
        assert os.fstat(spill.fd).st_size == 0 and spill.size_bytes == 0, "the last free kept the space"
        third = spill.allocate(1 << 20)
        assert not spill.release_space()
        spill.free(third)
        assert spill.size_bytes > 0, "a plain release on a file in use gave the space back at a later free"
    finally:
        spill.close()


def _first_fit_by_hand(used: dict[int, int], size: int) -> int:
    """The lowest aligned offset where ``size`` bytes fit between the extents in ``used`` (offset -> size), or after them."""
    offset = 0
    for start in sorted(used):
        if start - offset >= size:
            return offset
        offset = start + used[start]
    return offset


@pytest.mark.parametrize("seed", range(20))
def test_random_steps_match_first_fit_by_hand(seed):
    """Random allocations and frees, mostly at the end of the file (Note [Extents come and go at the end of the file]
    in tba/io/_extents.py), some in the middle: every offset is first fit over what is in use, and the file ends at
    the end of its last extent."""
    import random

    rng = random.Random(seed)
    alloc = ExtentAllocator(4096)
    used: dict[int, int] = {}
    for _ in range(400):
        if used and rng.random() < 0.5:
            offsets = sorted(used)
            offset = offsets[-1] if rng.random() < 0.6 else rng.choice(offsets)
            alloc.free(offset)
            del used[offset]
        else:
            nbytes = rng.choice((1, 4096, 5000, 3 * 4096, 1 << 16))
            size = round_up(nbytes, 4096)
            expected = _first_fit_by_hand(used, size)
            assert alloc.allocate(nbytes) == expected
            used[expected] = size
        assert alloc.end_bytes == max((start + size for start, size in used.items()), default=0)
        assert alloc.used_bytes == sum(used.values()) and alloc.in_use == bool(used)
