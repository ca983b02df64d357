"""``verify=True``: bytes changed in the spill file underneath tba are detected (issue 12, item 10)."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from utils import assert_exact

import tba
from tba.bench.models import PRESETS, make_batch, make_gpt
from tba.errors import TbaConfigError, TbaReadError

pytest.importorskip("crc32c")


def change_underneath(off: tba.Offloader, packed) -> None:
    """Overwrite the first bytes of ``packed``'s storage in the spill file, as another process could."""
    fd = os.open(f"/proc/self/fd/{off.spill.fd}", os.O_WRONLY)
    try:
        os.pwrite(fd, b"\x5a" * 512, packed.entry.offset + packed.entry.phase_bytes)
    finally:
        os.close(fd)


def saved_then_changed(off: tba.Offloader, x: torch.Tensor):
    packed = off.pack(x)
    off.flush()
    assert packed.entry.data is None, "the bytes must be read back from the file"
    change_underneath(off, packed)
    return packed


@pytest.mark.usefixtures("read_back_always")
def test_verify_raises_naming_the_storage_when_bytes_changed_underneath(spill_dir, backend):
    x = torch.randn(1 << 16)
    with tba.Offloader(spill_dir, backend=backend, min_offload_bytes=0, verify=True) as off:
        packed = saved_then_changed(off, x)
        with pytest.raises(TbaReadError, match=r"verify: storage #0 \(262144 bytes.*differs from what was written"):
            off.unpack(packed)
        assert off.stats.bytes_verified == x.numel() * 4
    del packed
    off.close()


def test_without_verify_changed_bytes_are_not_checked(spill_dir, backend):
    """The default does not checksum: the changed bytes go unnoticed (this only documents it)."""
    with tba.Offloader(spill_dir, backend=backend, min_offload_bytes=0) as off:
        packed = saved_then_changed(off, torch.randn(1 << 16))
        off.unpack(packed)
        assert off.stats.bytes_verified == 0
    del packed
    off.close()


def test_verify_is_exact(spill_dir, backend):
    config = PRESETS["tiny"]
    model = make_gpt(config)
    tokens, targets = make_batch(config)
    off = assert_exact(model, lambda m: m(tokens, targets), spill_dir, backend, verify=True)
    stats = off.stats
    assert stats.bytes_read > 0 and stats.bytes_verified == stats.bytes_read


def test_verify_option_is_checked(spill_dir, monkeypatch):
    with pytest.raises(TbaConfigError, match="verify must be True or False"):
        tba.offload_activations(spill_dir, verify="yes")
    monkeypatch.setitem(sys.modules, "crc32c", None)
    with pytest.raises(TbaConfigError, match=r"pip install 'tba-offload\[verify\]'"):
        tba.offload_activations(spill_dir, verify=True)
