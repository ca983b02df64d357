"""Whether the io_uring engine can run in this process: the extension, the kernel's switch, a ring.

:func:`probe` answers once per process, with a one-line reason when it cannot (``tba.io`` logs it
when ``backend="auto"`` falls back to threads, ``python -m tba doctor`` prints it).
"""

from __future__ import annotations

import errno
import functools
from pathlib import Path

from tba.io._directory import lacks_descriptors, out_of_descriptors

_DISABLED_SYSCTL = Path("/proc/sys/kernel/io_uring_disabled")


def _errno_name(err: OSError) -> str:
    return errno.errorcode.get(err.errno or 0, str(err.errno))


@functools.cache
def probe() -> str | None:
    """Check once per process whether the io_uring engine can run here.

    Returns:
        None when it can, else a one-line reason, e.g. ``"extension not built: ..."``,
        ``"/proc/sys/kernel/io_uring_disabled = 2"`` or ``"io_uring_setup failed: EPERM
        (seccomp?)"``.
    """
    # Note: [A process out of descriptors says nothing about io_uring]
    # This answer is kept for the process (``functools.cache``, which keeps no exception): a probe made
    # while every descriptor was taken (``dlopen`` of the extension, or the ring, failing with EMFILE)
    # made backend='auto' use threads, and backend='io_uring' raise, for good, after the descriptors
    # came back. It raises :class:`OutOfDescriptorsError` instead, as the spill file's open does.
    try:
        from tba import _uring
    except ImportError as err:
        if lacks_descriptors(err):
            raise out_of_descriptors("the io_uring extension", err) from err
        return f"extension not built: {err}"
    try:
        disabled = _DISABLED_SYSCTL.read_text().strip()
    except OSError:
        disabled = "0"
    if disabled == "2":
        return f"{_DISABLED_SYSCTL} = 2"
    try:
        ring = _uring.Ring(2)
    except OSError as err:
        if lacks_descriptors(err):
            raise out_of_descriptors("an io_uring ring", err) from err
        hint = ""
        if err.errno == errno.EPERM:
            hint = f" ({_DISABLED_SYSCTL} = 1)" if disabled == "1" else " (seccomp?)"
        return f"io_uring_setup failed: {_errno_name(err)}{hint}"
    try:
        ring.wake()
        ring.reap()
    except OSError as err:
        return f"io_uring_enter failed: {_errno_name(err)}"
    finally:
        ring.close()
    return None
