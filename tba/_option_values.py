"""How an option's value is read and checked: the kinds of :class:`tba.OffloadConfig`'s fields.

Every field of the schema (``tba/config.py``) has a kind in its metadata: a size (bytes, or a string
that :func:`tba.parse_size` reads), a count, a flag, a tristate (a flag or None), a float, a name
(``backend``, ``policy``) or a path. :func:`from_text` reads a value written as text (an environment
variable, a command-line flag), :func:`coerce` turns a Python value into the kind's (or raises
:class:`~tba.errors.TbaConfigError` naming the option and what it takes; a near miss of a policy name
gets the closest one), and :func:`check_ranges` checks what only the whole config can (ranges, the
staging pool against the block size, one goal).
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

from tba import defaults
from tba._units import SizeError, parse_size
from tba.errors import TbaConfigError, did_you_mean

SIZE, COUNT, FLAG, TRISTATE, FLOAT, NAME, PATH = "size", "count", "flag", "tristate", "float", "name", "path"
"""The kinds of option values (a field's ``metadata["kind"]``)."""


def from_text(field: dataclasses.Field, variable: str, text: str) -> Any:
    """``text`` (of environment variable or flag ``variable``) as a value of ``field``'s kind."""
    kind = field.metadata["kind"]
    text = text.strip()
    if field.metadata["optional"] and text.lower() == "none":
        return None
    if kind in (FLAG, TRISTATE):
        lowered = text.lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        if kind == TRISTATE:
            raise TbaConfigError(f"{variable}={text!r}: write 1, 0 or none (true/false/none)")
        raise TbaConfigError(f"{variable}={text!r}: write 1 or 0 (true/false)")
    if kind == COUNT:
        try:
            return int(text)
        except ValueError:
            raise TbaConfigError(f"{variable}={text!r}: write a whole number") from None
    if kind == FLOAT:
        try:
            return float(text)
        except ValueError:
            raise TbaConfigError(f"{variable}={text!r}: write a number such as 0.1") from None
    if kind == SIZE:
        try:
            return parse_size(text)
        except SizeError as err:
            raise TbaConfigError(f"{variable}: {err}") from None
    return text


def coerce(field: dataclasses.Field, value: Any) -> Any:
    """``value`` as ``field``'s kind wants it (a size string as bytes, a path expanded), or :class:`TbaConfigError`."""
    name, kind = field.name, field.metadata["kind"]
    if value is None and field.metadata["optional"]:
        return None
    if kind == SIZE:
        if isinstance(value, str):
            try:
                return parse_size(value)
            except SizeError as err:
                raise TbaConfigError(f"{name}: {err}") from None
        _require(name, isinstance(value, int) and not isinstance(value, bool), value, "bytes (an int) or a size such as '64K'")
    elif kind == COUNT:
        _require(name, isinstance(value, int) and not isinstance(value, bool), value, "an int")
    elif kind in (FLAG, TRISTATE):
        _require(name, isinstance(value, bool), value, "True or False" + (" or None" if kind == TRISTATE else ""))
    elif kind == FLOAT:
        _require(name, isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value),
                 value, "a finite number such as 0.1")
        return float(value)
    elif kind == PATH:
        _require(name, isinstance(value, (str, os.PathLike)), value, "a path (str or os.PathLike)")
        path = os.path.expanduser(os.fspath(value))
        if path == "":
            raise TbaConfigError(f"{name} is empty; pass a directory path, or None for $TBA_DIR or the temp directory")
        if "\0" in path:
            raise TbaConfigError(f"{name} {path!r} contains a NUL byte; pass a directory path without one")
        return path
    elif kind == NAME and isinstance(value, str) and value == "":
        raise TbaConfigError(f"{name} is empty; see help(tba.OffloadConfig) for the accepted values")
    elif name == "policy" and isinstance(value, str) and value not in defaults.POLICIES:
        raise TbaConfigError(f"unknown policy {value!r}; {did_you_mean(value, defaults.POLICIES)}"
                             f"use one of {', '.join(defaults.POLICIES)}, a tba.Plan or a tba.Policy")
    return value


def _require(name: str, ok: bool, value: Any, expected: str) -> None:
    if not ok:
        raise TbaConfigError(f"{name} must be {expected}, got {type(value).__name__} {value!r}")


def check_ranges(config: Any) -> None:
    """Raise :class:`TbaConfigError` for a value out of its range, or for two goals; make the two budget names agree."""
    for name in ("memory_budget", "memory_budget_bytes"):
        value = getattr(config, name)
        if value is not None and value <= 0:
            raise TbaConfigError(f"{name} must be > 0 (bytes of activation memory; no model needs none), got {value}; "
                                 "give a budget such as '2G', or leave it out for the default goal")
    for name in ("min_offload_bytes", "prefetch_depth_layers", "prefetch_budget_bytes", "overhead_bound"):
        value = getattr(config, name)
        if value is not None and value < 0:
            raise TbaConfigError(f"{name} must be >= 0, got {value}")
    if not 1 <= config.queue_depth <= defaults.MAX_QUEUE_DEPTH:
        raise TbaConfigError(f"queue_depth must be in 1..{defaults.MAX_QUEUE_DEPTH}, got {config.queue_depth}")
    if config.profile_steps < 1:
        raise TbaConfigError(f"profile_steps must be >= 1, got {config.profile_steps}")
    if config.block_size_bytes <= 0 or config.block_size_bytes % defaults.ALIGN_BYTES:
        raise TbaConfigError(f"block_size_bytes must be a positive multiple of {defaults.ALIGN_BYTES}, "
                             f"got {config.block_size_bytes}")
    if config.staging_bytes < config.block_size_bytes:
        raise TbaConfigError(f"staging_bytes ({config.staging_bytes}) must hold at least one block of block_size_bytes "
                             f"({config.block_size_bytes}); raise staging_bytes or lower block_size_bytes")
    budgets = {config.memory_budget, config.memory_budget_bytes} - {None}
    if len(budgets) > 1:
        raise TbaConfigError(f"memory_budget ({config.memory_budget}) and memory_budget_bytes "
                             f"({config.memory_budget_bytes}) differ; give one of them")
    config.memory_budget = config.memory_budget_bytes = next(iter(budgets), None)
    if config.memory_budget is not None and config.overhead_bound is not None:
        raise TbaConfigError("give one adaptive goal: memory_budget or overhead_bound, not both")
