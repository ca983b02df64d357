"""tba: offload PyTorch activations to NVMe files during forward and prefetch them for backward.

Typical use::

    import tba

    with tba.offload_activations(directory="/nvme/tba") as offloader:
        loss = model(batch)
    loss.backward()
    print(offloader.stats)
"""

from tba._units import parse_size
from tba.config import OffloadConfig
from tba.errors import ShortTransferError, TbaConfigError, TbaError, TbaReadError
from tba.io import Engine, ThreadEngine, available_backends, backend_names, make_engine, register_engine
from tba.policy import (
    Adaptive,
    KeepAll,
    LayerProfile,
    OffloadAll,
    OffloadedRecomputeAll,
    Placement,
    Plan,
    Policy,
    Profile,
    RecomputeAll,
    estimate,
    plan,
)
from tba.runtime import KeepReason, Offloader, OffloadStats, find_layers, keep_in_memory, offload_activations, shutdown

__version__ = "0.1.0"
"""The package version; ``pyproject.toml`` reads it from here."""

__all__ = [
    "Adaptive",
    "Engine",
    "KeepAll",
    "KeepReason",
    "LayerProfile",
    "OffloadAll",
    "OffloadConfig",
    "OffloadStats",
    "OffloadedRecomputeAll",
    "Offloader",
    "Placement",
    "Plan",
    "Policy",
    "Profile",
    "RecomputeAll",
    "ShortTransferError",
    "TbaConfigError",
    "TbaError",
    "TbaReadError",
    "ThreadEngine",
    "available_backends",
    "backend_names",
    "estimate",
    "find_layers",
    "keep_in_memory",
    "make_engine",
    "offload_activations",
    "parse_size",
    "plan",
    "register_engine",
    "shutdown",
]
