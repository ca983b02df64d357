"""tba: offload PyTorch activations to NVMe files during forward and prefetch them for backward.

Typical use::

    import tba

    with tba.offload_activations(directory="/nvme/tba") as offloader:
        loss = model(batch)
    loss.backward()
    print(offloader.stats)
"""

from tba.engine import BACKENDS, Engine, ThreadEngine, available_backends, make_engine
from tba.errors import ShortTransferError, TbaConfigError, TbaError, TbaReadError
from tba.layers import find_layers
from tba.offloader import Offloader, offload_activations
from tba.stats import OffloadStats

__version__ = "0.1.0"

__all__ = [
    "BACKENDS",
    "Engine",
    "OffloadStats",
    "Offloader",
    "ShortTransferError",
    "TbaConfigError",
    "TbaError",
    "TbaReadError",
    "ThreadEngine",
    "available_backends",
    "find_layers",
    "make_engine",
    "offload_activations",
]
