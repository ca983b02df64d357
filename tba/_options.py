"""Type and range checks of :class:`tba.Offloader` options, run at the ``with`` line.

Python does not check annotations, so a string size (``"4M"``), a float, a string flag
(``direct_io="False"``, which is truthy) or an out-of-range queue depth would otherwise surface as
a raw ``TypeError``/``ValueError`` deep in the engine, or silently do the wrong thing. Every check
here raises :class:`tba.TbaConfigError` naming the option and the expected value.
"""

from __future__ import annotations

import os
from typing import Any

from tba.defaults import MAX_QUEUE_DEPTH
from tba.errors import TbaConfigError

INT_OPTIONS = ("min_offload_bytes", "prefetch_depth_layers", "prefetch_budget_bytes", "block_size_bytes",
               "queue_depth", "staging_bytes", "profile_steps")


def check_int(name: str, value: Any) -> None:
    """Raise :class:`TbaConfigError` unless ``value`` is an ``int`` (``bool`` excluded)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TbaConfigError(f"{name} must be an int (bytes or a count), got {type(value).__name__} {value!r}")


def check_options(options: dict[str, Any]) -> None:
    """Check the types and ranges of the integer and flag options in ``options``."""
    for name in INT_OPTIONS:
        if name in options and not (name == "prefetch_budget_bytes" and options[name] is None):
            check_int(name, options[name])
    depth = options.get("queue_depth", 1)
    if not 1 <= depth <= MAX_QUEUE_DEPTH:
        raise TbaConfigError(f"queue_depth must be in 1..{MAX_QUEUE_DEPTH}, got {depth}")
    verify = options.get("verify", False)
    if not isinstance(verify, bool):
        raise TbaConfigError(f"verify must be True or False, got {type(verify).__name__} {verify!r}")
    direct = options.get("direct_io")
    if direct is not None and not isinstance(direct, bool):
        raise TbaConfigError(f"direct_io must be True, False or None, got {type(direct).__name__} {direct!r}")


def normalize_directory(directory: str | os.PathLike | None) -> str | None:
    """``directory`` with ``~`` expanded; None stays None (``$TBA_DIR`` or the temp directory).

    Raises:
        TbaConfigError: an empty string, or a value that is not a path.
    """
    if directory is None:
        return None
    if not isinstance(directory, (str, os.PathLike)):
        raise TbaConfigError(f"directory must be a path (str or os.PathLike), got {type(directory).__name__}")
    path = os.path.expanduser(os.fspath(directory))
    if path == "":
        raise TbaConfigError("directory is empty; pass a directory path, or None for $TBA_DIR or the temp directory")
    return path


def check_writable(directory: str) -> None:
    """Raise :class:`TbaConfigError` when the existing ``directory`` cannot be written."""
    if os.path.isdir(directory) and not os.access(directory, os.W_OK | os.X_OK):
        raise TbaConfigError(
            f"offload directory {directory} is not writable; pass directory= (or set TBA_DIR) "
            "to a writable directory on a fast local disk"
        )
