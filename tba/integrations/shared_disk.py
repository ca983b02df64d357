"""Is the disk that tba shares with DeepSpeed's NVMe swap fast enough for both?

With ZeRO-Infinity (``offload_optimizer`` or ``offload_param`` on ``nvme``) DeepSpeed swaps
optimizer states and parameters through files under its ``nvme_path``; tba puts its spill file in
a subdirectory there. When both live on one block device (same ``st_dev``) they share its
bandwidth. After the first training step the planned traffic per step is known:

* tba: the bytes it wrote and read in that step (``OffloadStats``);
* DeepSpeed, estimated from the config and the parameter count: with ``offload_optimizer`` on
  nvme every step reads and writes the fp32 master weights and Adam's two moments
  (:data:`OPTIMIZER_SWAP_BYTES_PER_PARAM`); with ``offload_param`` on nvme each parameter is read
  in forward and in backward and written after the step (3 times its element size).

Divided by the step time this is the bandwidth the disk must sustain. It is compared with a short
measurement in the shared directory (:func:`measure_bandwidth`: one write and one read of
:data:`PROBE_BYTES` through tba's engine, with the passes of ``python -m tba bench-io``), and :func:`check_shared_disk`
returns a warning when the plan exceeds what the disk delivered.
"""

from __future__ import annotations

import os

from tba.defaults import MIB, QUEUE_DEPTH
from tba.io import directory_bandwidth, make_engine, resolve_directory

PROBE_BYTES = 64 * MIB
"""Bytes written and read back by :func:`measure_bandwidth` (64 MiB: ~0.1 s at 1 GB/s)."""

OPTIMIZER_SWAP_BYTES_PER_PARAM = 24
"""fp32 master weight + two Adam moments (12 bytes), each read and written once per step."""

PARAM_SWAP_PASSES = 3
"""Parameter swaps per step with ``offload_param`` on nvme: read in forward and backward, written once."""


def existing_ancestor(path: str) -> str:
    """``path`` itself, or its nearest ancestor that exists (a directory may not be created yet)."""
    path = os.path.abspath(os.path.expanduser(path))  # as the offloader reads it
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


def same_device(first: str, second: str) -> bool:
    """True when both paths (or their nearest existing ancestors) are on one block device."""
    return os.stat(existing_ancestor(first)).st_dev == os.stat(existing_ancestor(second)).st_dev


def deepspeed_swap_bytes_per_step(*, optimizer_on_nvme: bool, params_on_nvme: bool, num_params: int,
                                  param_itemsize_bytes: int) -> int:
    """Estimated bytes DeepSpeed moves to and from its NVMe swap per optimizer step.

    Args:
        optimizer_on_nvme: ``offload_optimizer.device`` is ``"nvme"``.
        params_on_nvme: ``offload_param.device`` is ``"nvme"``.
        num_params: Parameters in the model (all of them, not one rank's partition).
        param_itemsize_bytes: Bytes per element of the model's parameters (2 for fp16/bf16).
    """
    total = 0
    if optimizer_on_nvme:
        total += OPTIMIZER_SWAP_BYTES_PER_PARAM * num_params
    if params_on_nvme:
        total += PARAM_SWAP_PASSES * param_itemsize_bytes * num_params
    return total


def measure_bandwidth(directory: str, *, backend: str = "auto", block_size_bytes: int = MIB,
                      queue_depth: int = QUEUE_DEPTH, probe_bytes: int = PROBE_BYTES) -> tuple[float, float]:
    """Write then read ``probe_bytes`` in ``directory`` as ``python -m tba bench-io`` does; (write, read) in bytes/s.

    The probe file has no name (see ``tba/io/_directory.py``): nothing is left in the directory.
    """
    with make_engine(backend, queue_depth=queue_depth) as engine:
        return directory_bandwidth(engine, resolve_directory(directory), probe_bytes, block_size_bytes=block_size_bytes)


def check_shared_disk(*, tba_bytes_per_step: int, deepspeed_bytes_per_step: int, step_s: float,
                      write_bytes_per_s: float, read_bytes_per_s: float, directory: str) -> str | None:
    """A warning when tba plus DeepSpeed's swap need more bandwidth than the disk delivered, else None.

    Traffic is taken as half writes and half reads; the time it needs on the disk is compared with
    the step time (``step_s``, seconds).
    """
    total = tba_bytes_per_step + deepspeed_bytes_per_step
    io_s = total / 2 / write_bytes_per_s + total / 2 / read_bytes_per_s
    if io_s <= step_s:
        return None
    return (
        f"tba: the disk under {directory} is shared with DeepSpeed's NVMe swap and cannot keep up: "
        f"tba moves {tba_bytes_per_step / 1e6:.1f} MB per step and DeepSpeed an estimated "
        f"{deepspeed_bytes_per_step / 1e6:.1f} MB, {io_s:.2f} s of I/O at the measured "
        f"{write_bytes_per_s / 1e9:.2f} GB/s write and {read_bytes_per_s / 1e9:.2f} GB/s read, longer than "
        f"the {step_s:.2f} s step. Expect I/O stalls; put tba's \"directory\" on another disk, or set "
        f"\"policy\": \"keep\" in the \"tba\" block."
    )
