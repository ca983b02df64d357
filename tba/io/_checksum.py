"""Checksums of spilled bytes, for ``verify=True``.

Bytes can change in the spill file after tba wrote them: another process writing into it, a hole
punched in it, a disk returning bad data. Without a check, backward would compute on them and
produce wrong gradients silently. With ``verify=True`` the store computes a CRC-32C of each
storage's bytes when its write completes (over the memory that was written, which is still held
at that moment) and compares it with the CRC-32C of the bytes read back before the tensor is
handed out; a mismatch raises :class:`tba.TbaReadError`.

CRC-32C comes from the ``crc32c`` package (hardware instructions where the CPU has them, ~12 GB/s
on this project's machines, and the GIL released for large buffers); it is an optional
dependency: ``pip install 'tba-offload[verify]'``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tba.errors import TbaConfigError
from tba.io._memory import memory_view


def load_crc32c() -> Callable[[memoryview], int]:
    """The CRC-32C function of the ``crc32c`` package.

    Raises:
        TbaConfigError: The package is not installed; names the install command.
    """
    try:
        import crc32c
    except ImportError as err:
        raise TbaConfigError(
            "verify=True needs the crc32c package, which is not installed; run pip install 'tba-offload[verify]' "
            "(or pip install crc32c), or pass verify=False"
        ) from err
    return crc32c.crc32c


def checksum(data: torch.Tensor) -> int:
    """CRC-32C of the bytes of the contiguous host ``uint8`` tensor ``data``."""
    return load_crc32c()(memory_view(data.data_ptr(), data.numel()))
