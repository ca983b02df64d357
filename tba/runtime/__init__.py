"""The saved-tensor path: what happens to each tensor autograd saves inside an offload context.

``_offloader.py`` holds :class:`~tba.Offloader`'s options and ``close``, ``_step_cycle.py`` its
entry and exit, ``_store_owner.py``
what its store runs on and reports (spill file, engine, counters), ``_oneshot.py`` the one-shot
context and ``_hooks.py`` its hooks (pack decides keep or offload, unpack rebuilds the tensor);
``_views.py`` the saved views, ``_entry.py`` the per-storage entry; ``_store.py`` the entries' I/O and lifetime
(dedup by storage and writes in ``_writes.py``, reads, release); ``_prefetch.py`` the window of storages read
ahead during backward; ``_layers.py`` which layer is running; ``_recompute.py`` the checkpoint wrapper of recomputed
layers; ``_stats.py`` the counters; ``_keep.py`` the reasons a tensor stays in memory and which one
applies;
``_runner.py``, ``_profiled_step.py``, ``_profiling.py``, ``_timer.py`` and ``_peak.py`` profile
steps (time and measured activation peak) and apply a placement plan. Bytes reach the file
through a device route (:mod:`tba.device`) and an engine (:mod:`tba.io`).
"""

from tba.runtime import _entry, _host_requests, _writes
from tba.runtime._compile import compile_blocks
from tba.runtime._keep import KeepReason, keep_in_memory
from tba.runtime._layers import find_layers, resolve_layers
from tba.runtime._offloader import Offloader
from tba.runtime._oneshot import offload_activations
from tba.runtime._recompute import RecomputeLayers
from tba.runtime._runner import PolicyRunner, StepCounters, StepPlacement
from tba.runtime._shared import idle_pool_bytes, shutdown
from tba.runtime._stats import OffloadStats
from tba.runtime._timer import LayerTimer

__all__ = [
    "KeepReason", "LayerTimer", "OffloadStats", "Offloader", "PolicyRunner", "RecomputeLayers", "StepCounters",
    "StepPlacement", "compile_blocks", "find_layers", "idle_pool_bytes", "keep_in_memory", "offload_activations",
    "native_parts", "resolve_layers", "shutdown",
]


def native_parts() -> dict[str, bool]:
    """Which parts of the per-storage path run in C here (optional extensions, setup.py): ``record`` (the storage
    record, ``tba._record``), ``requests`` (host transfers into engine requests, ``tba._requests``) and ``save`` (a
    host storage's fresh save, ``tba._save``)."""
    return {"record": _entry.NATIVE, "requests": _host_requests.NATIVE, "save": _writes.NATIVE}
