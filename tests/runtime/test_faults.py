"""Injected I/O faults: a full disk keeps training going; a failed read is loud, never zeros."""

from __future__ import annotations

import errno
import logging
import threading

import pytest
import torch
from model_cases import tiny_gpt
from utils import FaultyEngine, assert_exact, run_step

import tba
from tba.errors import TbaReadError


def test_disk_full_keeps_tensors_in_memory_with_one_warning(spill_dir, caplog):
    model, forward = tiny_gpt()
    engine = FaultyEngine(write_errno=errno.ENOSPC)
    with caplog.at_level(logging.WARNING, logger="tba"):
        offloader = assert_exact(model, forward, spill_dir, engine)
    warnings = [r for r in caplog.records if "failed" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in caplog.records]
    assert "No space left on device" in warnings[0].getMessage() or "ENOSPC" in warnings[0].getMessage()
    stats = offloader.stats
    assert stats.storages_written == 0 and stats.bytes_written == 0 and stats.bytes_read == 0
    assert 0 < stats.tensors_kept_on_error <= stats.tensors_offloaded
    assert stats.bytes_kept_on_error > 0 and stats.unpacks_from_memory > 0
    assert engine.failed > 0
    engine.close()


def test_disk_full_warns_once_across_successive_contexts(spill_dir, caplog):
    model, forward = tiny_gpt()
    engine = FaultyEngine(write_errno=errno.ENOSPC)
    with caplog.at_level(logging.WARNING, logger="tba"):
        for _ in range(3):
            assert_exact(model, forward, spill_dir, engine)
    warnings = [r for r in caplog.records if "failed" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in caplog.records]
    engine.close()


@pytest.mark.parametrize("fault", [{"read_errno": errno.EIO}, {"short_reads": True}], ids=["eio", "short"])
def test_failed_read_raises_naming_tensor_file_and_offset(spill_dir, fault):
    model, forward = tiny_gpt()
    engine = FaultyEngine(**fault)
    offloader = tba.offload_activations(spill_dir, backend=engine, min_offload_bytes=0, layers=model)
    with pytest.raises(TbaReadError) as info:
        run_step(model, forward, offloader)
    message = str(info.value)
    assert "storage #" in message and spill_dir in message and "offset" in message
    assert isinstance(info.value.__cause__, OSError)
    assert info.value.__cause__.errno == errno.EIO
    engine.close()


def test_failed_read_never_returns_data(spill_dir):
    engine = FaultyEngine(read_errno=errno.EIO)
    with tba.Offloader(spill_dir, backend=engine, min_offload_bytes=0) as off:
        packed = off.pack(torch.randn(1 << 16))  # nothing else holds it: unpack must read the file
        off.flush()
        for _ in range(2):
            with pytest.raises(TbaReadError):
                off.unpack(packed)
    del packed
    off.close()
    engine.close()


def test_close_with_a_shared_engine_waits_for_its_transfers(spill_dir):
    """An engine the offloader does not own outlives it: close waits for the writes on its file.

    Closing the file first failed them with EBADF, or, once the number was reused by the next
    spill file, sent the old step's bytes into the new file (wrong gradients in the soak test).
    """
    gate = threading.Event()
    engine = FaultyEngine(gate=gate)
    off = tba.Offloader(spill_dir, backend=engine, min_offload_bytes=0)
    with off:
        packed = off.pack(torch.randn(1 << 16))
    closing = threading.Thread(target=off.close)
    closing.start()
    closing.join(0.2)
    assert closing.is_alive(), "close returned while a write on its file was queued"
    gate.set()
    closing.join(10)
    assert not closing.is_alive()
    assert off.stats.tensors_kept_on_error == 0 and off.stats.storages_written == 1
    del packed
    engine.close()
