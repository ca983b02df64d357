"""tba: offload PyTorch activations to NVMe files during forward and prefetch them for backward.

Typical use::

    import tba

    with tba.offload_activations(directory="/nvme/tba") as offloader:
        loss = model(batch)
    loss.backward()
    print(offloader.stats)

Note: [import tba imports torch on first use]
The names below are imported when first used (PEP 562's module ``__getattr__``), not by ``import tba``:
``python -m tba run script.py`` replaces itself with the script and ``python -m tba --help`` prints and
exits, and neither needs torch, whose import took 2.4 of the launcher's 2.7 s on the 2-core VM. The first
use of any public name (``tba.offload_activations``, ``from tba import Offloader``) imports it, torch with
it; a submodule (``tba.runtime``) is imported when first named too. Type checkers see every name through
the ``TYPE_CHECKING`` imports.

Note: [Only plain names are tried as submodules]
Any other name is tried as a submodule, but only a plain identifier that is not a dunder: probes such as
``hasattr(tba, "__main__")`` would otherwise import ``tba/__main__.py``, which runs the command line and
exits the caller's process (``SystemExit``), and a dotted name (``getattr(tba, "a.b")``) would raise
``ModuleNotFoundError`` from ``hasattr``, which expects ``AttributeError``. ``import tba.__main__`` and
``python -m tba`` use the import system, not this lookup.

Note: [A failed import is not a missing attribute]
An ``AttributeError`` raised while a home module imports (a torch without an attribute tba's runtime uses)
would leave ``__getattr__`` as a missing attribute: ``from tba import offload_activations`` replaces it by
Python's bare "cannot import name", dropping the cause, and ``hasattr`` or ``getattr(tba, name, None)`` says the
name is absent. Before the lazy imports it surfaced at ``import tba``; now it comes out as an ``ImportError``
chained to the original.

Note: [The control thread still starts at import tba]
``tba._control`` starts tba's control thread when it is imported, "before a program installs its signal
handlers" (its comment, and Note [Asynchronous exceptions] there): ``Thread.start`` interrupted half way by a
handler's exception can leave a thread started but not recorded. With the runtime imported on first use that
start would move into the program's training loop, under its handlers, so ``import tba`` still imports
``tba._control`` (30 ms, no torch).
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
from typing import TYPE_CHECKING, Any

from tba import _control  # noqa: F401 - Note [The control thread still starts at import tba]

if TYPE_CHECKING:
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
    from tba.runtime import (
        KeepReason,
        Offloader,
        OffloadStats,
        find_layers,
        keep_in_memory,
        offload_activations,
        shutdown,
    )

__version__ = "0.3.0.dev0"
"""The package version; ``pyproject.toml`` reads it from here."""

_HOMES = {
    "tba._units": ("parse_size",),
    "tba.config": ("OffloadConfig",),
    "tba.errors": ("ShortTransferError", "TbaConfigError", "TbaError", "TbaReadError"),
    "tba.io": ("Engine", "ThreadEngine", "available_backends", "backend_names", "make_engine", "register_engine"),
    "tba.policy": ("Adaptive", "KeepAll", "LayerProfile", "OffloadAll", "OffloadedRecomputeAll", "Placement", "Plan",
                   "Policy", "Profile", "RecomputeAll", "estimate", "plan"),
    "tba.runtime": ("KeepReason", "Offloader", "OffloadStats", "find_layers", "keep_in_memory", "offload_activations",
                    "shutdown"),
}
_HOME_OF = {name: module for module, names in _HOMES.items() for name in names}
"""Each public name's module (Note [import tba imports torch on first use])."""

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


def __getattr__(name: str) -> Any:
    module = _HOME_OF.get(name)
    if module is not None:
        value = getattr(_import(module), name)
        globals()[name] = value  # once: later uses find it without this call
        return value
    if name.isidentifier() and not name.startswith("__"):  # Note [Only plain names are tried as submodules]
        try:
            return _import(f"{__name__}.{name}")
        except ModuleNotFoundError as err:
            if err.name != f"{__name__}.{name}":
                raise  # the submodule exists and failed to import something of its own
    raise AttributeError(f"module 'tba' has no attribute {name!r}")


def _import(module: str) -> Any:
    """``module``, imported; an ``AttributeError`` raised while importing it comes out as an ``ImportError``
    (Note [A failed import is not a missing attribute])."""
    try:
        return importlib.import_module(module)
    except AttributeError as err:
        raise ImportError(f"importing {module} failed: {err}", name=module) from err


def _drop_imports_of_lost_threads() -> None:
    """Note: [An import in flight at a fork]
    The first use of a public name imports its module (about 0.1 s for the runtime, torch loaded), and tba imports a
    few more on their first use. A fork meanwhile, from another thread (a ``DataLoader`` or ``multiprocessing``
    starting its workers while a thread takes the first step), gave the child a module half run and its import lock
    held by a thread the child does not have: the child's own first use of tba waited for that lock for ever
    (helper-94). So in the child, right after the fork, each module lock held by another thread of the parent is
    forgotten, and the module it guarded, if half run, is taken out of ``sys.modules`` (and off its package): the
    child imports it afresh. tba's modules and those their imports were in the middle of (torch's), any module whose
    import the fork cut: left as they were, each would hang the child at its first import. Waiting for such imports
    before the fork instead cannot work: the importing thread can start the next one between the wait and the fork.
    """
    bootstrap = importlib._bootstrap  # type: ignore[attr-defined]
    locks = getattr(bootstrap, "_module_locks", None)
    if not isinstance(locks, dict):
        return
    me = threading.get_ident()
    for name, ref in list(locks.items()):
        lock = ref()
        owner = getattr(lock, "owner", None)
        if owner is None or owner == me:
            continue
        locks.pop(name, None)
        module = sys.modules.get(name)
        if module is not None and getattr(getattr(module, "__spec__", None), "_initializing", False):
            del sys.modules[name]
            parent, _, child = name.rpartition(".")
            package = vars(sys.modules[parent]) if parent in sys.modules else {}
            if package.get(child) is module:  # vars(): a getattr would run tba's own lazy import here
                del package[child]


os.register_at_fork(after_in_child=_drop_imports_of_lost_threads)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
