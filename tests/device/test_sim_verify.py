"""``verify=True`` on the simulated device: device storages are not checksummed, as on a GPU.

The checksum of a written storage was taken when its ``device.type`` was ``"cpu"``, which every
simulated device storage is: the simulator then checksummed read-back device buffers on the host
right after their host-to-device copies were queued, before they ran, and raised a spurious
TbaReadError (two of five steps), on a path a GPU never takes.
"""

from __future__ import annotations

from model_cases import tiny_gpt
from utils import run_step, steps_equal

import tba

BLOCK = 8192


def test_verify_on_the_simulated_device_checks_host_storages_only(sim, tmp_path):
    model, forward = tiny_gpt()
    reference = run_step(model, forward)
    offloader = tba.Offloader(tmp_path, layers=model, min_offload_bytes=0, block_size_bytes=BLOCK,
                              staging_bytes=8 * BLOCK, verify=True)
    try:
        for _ in range(5):
            assert steps_equal(reference, run_step(model, forward, offloader, flush=True))
        assert offloader.stats.bytes_read > 0 and offloader.stats.bytes_verified == 0
    finally:
        offloader.close()
