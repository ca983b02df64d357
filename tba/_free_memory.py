"""Hand the allocator's cached free memory back to the kernel, so that resident memory is live memory.

A caching malloc (tcmalloc, jemalloc, mimalloc) keeps the pages of freed blocks for reuse, and
glibc keeps free pages at the top of its heap. The resident set then stays at the largest
footprint so far: a step that needs less than an earlier one shows no growth at all, and "peak
resident set during the step minus the resident set before it" reads 0 (keep-all measured 0.0 MiB
under tcmalloc once its first step had run). :func:`release_free_memory` asks whichever allocator
serves the process to return its free pages first, through the allocator's own call:

* tcmalloc: ``MallocExtension_ReleaseFreeMemory()``;
* jemalloc: ``mallctl("arena.4096.purge")`` (4096 is ``MALLCTL_ARENAS_ALL``);
* mimalloc: ``mi_collect(true)``;
* glibc: ``malloc_trim(0)``.

Freed pages fault in again when used, so a step measured right after a release runs slower than in
training: measure memory and time on different steps.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable


@functools.lru_cache(maxsize=1)
def _releaser() -> Callable[[], object] | None:
    process = ctypes.CDLL(None)
    for symbol, call in (
        ("MallocExtension_ReleaseFreeMemory", lambda fn: fn()),
        ("mi_collect", lambda fn: fn(ctypes.c_bool(True))),
        ("mallctl", lambda fn: fn(b"arena.4096.purge", None, None, None, ctypes.c_size_t(0))),
        ("malloc_trim", lambda fn: fn(ctypes.c_size_t(0))),
    ):
        function = getattr(process, symbol, None)
        if function is not None:
            return functools.partial(call, function)
    return None


def release_free_memory() -> bool:
    """Return the allocator's free pages to the kernel; False when no known allocator call exists."""
    release = _releaser()
    if release is None:
        return False
    release()
    return True
