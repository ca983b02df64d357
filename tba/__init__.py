"""tba: offload PyTorch activations to NVMe files during forward and prefetch them for backward.

Typical use::

    import tba

    with tba.offload_activations(directory="/nvme/tba") as offloader:
        loss = model(batch)
    loss.backward()
    print(offloader.stats)
"""

from tba.defaults import BACKENDS
from tba.errors import ShortTransferError, TbaConfigError, TbaError, TbaReadError
from tba.io import Engine, ThreadEngine, available_backends, make_engine
from tba.policy import Adaptive, KeepAll, LayerProfile, OffloadAll, Plan, Policy, Profile, RecomputeAll, estimate, plan
from tba.runtime._layers import find_layers
from tba.runtime._offloader import Offloader, offload_activations
from tba.runtime._shared import shutdown
from tba.runtime._stats import OffloadStats

__version__ = "0.1.0"
"""The package version; ``pyproject.toml`` reads it from here."""

__all__ = [
    "Adaptive",
    "BACKENDS",
    "Engine",
    "KeepAll",
    "LayerProfile",
    "OffloadAll",
    "OffloadStats",
    "Offloader",
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
    "estimate",
    "find_layers",
    "make_engine",
    "offload_activations",
    "plan",
    "shutdown",
]
