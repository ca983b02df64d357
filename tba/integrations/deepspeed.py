"""DeepSpeed: tba offloads activations while ZeRO offloads optimizer states and parameters.

ZeRO-Offload moves optimizer states (and with ZeRO-Infinity, parameters) to host memory or NVMe;
tba moves the activations autograd saves during forward to NVMe. They are independent: DeepSpeed
works on parameters, gradients and optimizer states, tba only on saved activations (parameters
are never written, including ZeRO-3's gathered ones, which autograd saves as the parameter object
or a view of it). So the integration is a thin wrapper: it reads tba's settings from a ``"tba"``
block of the DeepSpeed config (DeepSpeed ignores unknown top-level keys), builds one reusable
:class:`tba.Offloader` over the engine's module, and enters it around each micro-step's forward::

    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                   config="ds_config.json")
    offload = TbaDeepSpeed(engine)               # reads engine.config's "tba" block
    for tokens, targets in loader:
        with offload:
            loss = engine(tokens, targets)
        engine.backward(loss)                    # gradient accumulation, ZeRO 1-3: unchanged
        engine.step()
    offload.close()

Shared disk: when ``zero_optimization.offload_param.device`` (else ``offload_optimizer.device``)
is ``"nvme"``, tba's directory defaults to ``<nvme_path>/tba``, beside DeepSpeed's swap folders,
and tba's I/O request size and queue depth default to DeepSpeed's ``aio`` block (``block_size``,
``queue_depth``; DeepSpeed's defaults 1 MiB and 8 when the block is absent), where ``TBA_DIR``,
``TBA_BLOCK_SIZE_BYTES`` and ``TBA_QUEUE_DEPTH`` do not set them. After the first
optimizer step, if both are on one device, :mod:`tba.integrations.shared_disk` compares the
planned traffic with a short bandwidth measurement and logs a warning when the disk cannot keep up.

Activation checkpointing: inside DeepSpeed's reentrant ``deepspeed.checkpointing.checkpoint`` the
forward runs under ``no_grad``, so a checkpointed region saves nothing into tba; its recompute in
backward runs after the offload context has exited. DeepSpeed keeps the region's inputs as
attributes of its autograd context, not through autograd's saved tensors, so those inputs stay in
memory; ``torch.utils.checkpoint`` saves them through autograd, and tba offloads them.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from typing import Any

from torch import nn

from tba.errors import TbaConfigError, TbaError
from tba.integrations import shared_disk
from tba.integrations._deepspeed_config import (
    BLOCK_KEYS,
    CONFIG_KEY,
    DEEPSPEED_AIO_BLOCK_SIZE_BYTES,
    DEEPSPEED_AIO_QUEUE_DEPTH,
    NVME_SUBDIRECTORY,
    TbaSettings,
    block_error,
    block_keys,
    load_config,
    parse_config,
)
from tba.runtime import Offloader, OffloadStats, resolve_layers

__all__ = ["BLOCK_KEYS", "CONFIG_KEY", "DEEPSPEED_AIO_BLOCK_SIZE_BYTES", "DEEPSPEED_AIO_QUEUE_DEPTH", "NVME_SUBDIRECTORY",
           "TbaDeepSpeed", "TbaSettings", "block_keys", "load_config", "parse_config"]

logger = logging.getLogger("tba")


def _missing_directories(directory: str | None) -> list[str]:
    """``directory`` and its ancestors that do not exist yet, deepest first (Note [TbaDeepSpeed removes the
    directories it made])."""
    missing: list[str] = []
    path = os.path.abspath(os.path.expanduser(directory)) if directory is not None else None  # as the offloader reads it
    while path is not None and not os.path.lexists(path) and path != os.path.dirname(path):
        missing.append(path)
        path = os.path.dirname(path)
    return missing


class TbaDeepSpeed:
    """tba for one DeepSpeed engine: ``with`` it around each micro-step's forward, ``close()`` at the end.

    Args:
        engine: The ``DeepSpeedEngine`` (anything with ``module``, ``config`` and ``global_steps``).
        config: The DeepSpeed config (dict or JSON path) holding the ``"tba"`` block. Default:
            ``engine.config``, the one given to ``deepspeed.initialize``.
        layers: The model's repeated blocks; default: found in ``engine.module``.

    Without a ``"tba"`` block, with ``"enabled": false`` or ``"policy": "keep"`` the context does
    nothing, so one training loop serves both.

    Raises:
        TbaConfigError: a bad ``"tba"`` block or Offloader option, naming the fix.
    """

    def __init__(self, engine: Any, config: str | os.PathLike | Mapping[str, Any] | None = None, *,
                 layers: nn.Module | list[nn.Module] | None = None) -> None:
        if not isinstance(getattr(engine, "module", None), nn.Module) or not hasattr(engine, "global_steps"):
            raise TbaConfigError(f"TbaDeepSpeed takes the DeepSpeed engine, got {type(engine).__name__}: pass the first value of "
                                 "engine, optimizer, _, _ = deepspeed.initialize(...), as TbaDeepSpeed(engine)")
        if layers is not None:
            resolve_layers(layers)  # a bad layers= is this call's, not the block's: refused without the block's name
        self.engine = engine
        self.settings = parse_config(engine.config if config is None else config)
        self.offloader: Offloader | None = None
        self._made_directories: list[str] = []
        self._first_step: tuple[int, float, int] | None = None
        self._check_pending = False
        settings = self.settings
        if settings is None or not settings.enabled or settings.policy == "keep":
            return
        self._made_directories = _missing_directories(settings.directory)
        try:
            self.offloader = Offloader(settings.directory, layers=engine.module if layers is None else layers,
                                       **{"policy": settings.policy, **settings.offloader_options})
        except TbaConfigError as err:
            raise block_error(str(err)) from err
        directory = self.offloader.config.directory  # the block's, <nvme_path>/tba, or $TBA_DIR's
        self._check_pending = bool(settings.check_bandwidth and settings.nvme_path is not None and directory is not None
                                   and shared_disk.same_device(directory, settings.nvme_path))
        logger.info("tba: offloading activations of the DeepSpeed engine to %s (%s)",
                    settings.directory or "$TBA_DIR or the temp dir",
                    ", ".join(f"{key}={value}" for key, value in settings.offloader_options.items()) or "defaults")

    @property
    def stats(self) -> OffloadStats | None:
        """The offloader's :class:`tba.OffloadStats`, or None when tba is off."""
        return None if self.offloader is None else self.offloader.stats

    def __repr__(self) -> str:
        if self.offloader is not None:
            return f"TbaDeepSpeed({self.offloader!r})"
        settings = self.settings
        why = ('no "tba" block' if settings is None else '"enabled": false' if not settings.enabled else
               f'"policy": "{settings.policy}"')
        return f"TbaDeepSpeed(off: {why})"

    def __enter__(self) -> TbaDeepSpeed:
        if self.offloader is not None:
            self._watch_first_step()
            self.offloader.__enter__()
        return self

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: object) -> None:
        if self.offloader is not None:
            self.offloader.__exit__(exc_type, exc, tb)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """``engine(*args, **kwargs)`` inside the offload context."""
        with self:
            return self.engine(*args, **kwargs)

    def close(self) -> None:
        """Close the offloader (its file goes away) and remove the directories tba made, those left empty.

        Note: [TbaDeepSpeed removes the directories it made]
        tba's directory defaults to ``<nvme_path>/tba``; where ``nvme_path`` did not exist either (ZeRO-1/2
        with ``device: "nvme"`` make nothing there), tba's first spill made both, and only ``tba`` was
        removed, leaving an empty ``nvme_path`` (helper-41). Every directory missing when this was built
        (``directory`` and the ancestors it made) is removed deepest first while empty; one that holds
        anything (DeepSpeed's swap folders) and everything above it stays.
        """
        if self.offloader is None:
            return
        self._watch_first_step()
        self.offloader.close()
        for directory in self._made_directories:
            try:
                os.rmdir(directory)
            except FileNotFoundError:
                continue  # never made (nothing was spilled), or already removed
            except OSError:
                break

    def _traffic_bytes(self) -> int:
        stats = self.offloader.stats
        return stats.bytes_written + stats.bytes_read

    def _watch_first_step(self) -> None:
        """Time the first optimizer step; once it is over, run the shared-disk check."""
        if not self._check_pending:
            return
        steps, now = self.engine.global_steps, time.perf_counter()
        if self._first_step is None:
            self._first_step = (steps, now, self._traffic_bytes())
            return
        first_steps, began, traffic = self._first_step
        if steps == first_steps:
            return
        self._check_pending = False
        self.offloader.flush()
        self._check_disk((self._traffic_bytes() - traffic) // (steps - first_steps), (now - began) / (steps - first_steps))

    def _check_disk(self, tba_bytes_per_step: int, step_s: float) -> None:
        settings, config = self.settings, self.offloader.config  # parsed values: the block may give "64K"
        params = list(self.engine.module.parameters())
        deepspeed_bytes = shared_disk.deepspeed_swap_bytes_per_step(
            optimizer_on_nvme=settings.optimizer_on_nvme,
            params_on_nvme=settings.params_on_nvme,
            num_params=sum(getattr(p, "ds_numel", p.numel()) for p in params),
            param_itemsize_bytes=params[0].element_size() if params else 0,
        )
        directory = self.offloader.spill.directory
        try:
            write_rate, read_rate = shared_disk.measure_bandwidth(
                directory, backend=config.backend, block_size_bytes=config.block_size_bytes, queue_depth=config.queue_depth)
        except (OSError, TbaError) as err:
            # Note: [A shared-disk check that cannot measure is skipped]
            # The probe preallocates 64 MiB in the shared directory and opens it with O_DIRECT. On a nearly full
            # disk (ENOSPC), a file system without O_DIRECT (where tba's own spill file falls back to buffered
            # I/O), or a process at its descriptor limit, the raw error came out of the next step's ``with``
            # and ended a training that was running well, for a diagnostic. It is skipped, saying why.
            logger.warning("tba: skipped the shared-disk check of %s, which could not measure the disk (%s); set "
                           "\"check_bandwidth\": false in the \"tba\" block to skip it without this warning",
                           directory, getattr(err, "strerror", None) or err)
            return
        warning = shared_disk.check_shared_disk(
            tba_bytes_per_step=tba_bytes_per_step, deepspeed_bytes_per_step=deepspeed_bytes, step_s=step_s,
            write_bytes_per_s=write_rate, read_bytes_per_s=read_rate, directory=directory)
        if warning is not None:
            logger.warning(warning)
