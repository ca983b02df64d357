"""Build DeepSpeed's ``async_io`` op for ``tests/integrations/test_deepspeed_nvme.py``, without debug info.

``make deepspeed-aio`` (which CI runs) calls this script. DeepSpeed's builder compiles its twelve
C++ files at ``-O0`` (the op is bound by I/O) but with ``-g``: every file includes
``torch/extension.h``, and the debug information of torch's templates made each file take about
48 s of one core on the 2-core VM against 34 s without it, a minute and a half of CI.

Note: [The NVMe test loads the op built without -g]
torch's JIT loader keys a built extension by its sources and flags: an op built with other flags
than the loading process asks for is rebuilt, under a new name, at load time. So the test drops
``-g`` with the same function (:func:`drop_debug_info`) before DeepSpeed loads the op; a test run
that did not would rebuild it, slowly, and still pass.

Usage: ``python tools/deepspeed_aio.py`` (exit status 1, naming the fix, when libaio is missing).
"""

from __future__ import annotations

import sys
from typing import Any

DEBUG_INFO_FLAG = "-g"


def drop_debug_info(builder_class: Any) -> Any:
    """Patch ``builder_class`` (DeepSpeed's ``AsyncIOBuilder``) to compile without ``-g``; returns the original
    ``cxx_args`` so that a caller can restore it. Calling it twice patches once."""
    original = builder_class.cxx_args
    if getattr(original, "_tba_without_debug_info", False):
        return original

    def cxx_args(self: Any) -> list[str]:
        return [flag for flag in original(self) if flag != DEBUG_INFO_FLAG]

    cxx_args._tba_without_debug_info = True  # type: ignore[attr-defined]
    builder_class.cxx_args = cxx_args
    return original


def main() -> int:
    from deepspeed.ops.op_builder import AsyncIOBuilder

    drop_debug_info(AsyncIOBuilder)
    builder = AsyncIOBuilder()
    if not builder.is_compatible(False):
        print("deepspeed_aio: libaio is missing: apt-get install libaio-dev", file=sys.stderr)
        return 1
    builder.load(verbose=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
