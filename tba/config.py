"""One schema for every user option of tba: :class:`OffloadConfig`.

Every option is a field of one keyword-only dataclass, documented once (unit, default, meaning)
and validated once, in ``__post_init__``. Everything else is generated from it: the visible
signatures of :class:`tba.Offloader` and :func:`tba.offload_activations`, the keys of the
DeepSpeed ``"tba"`` block, Megatron's ``--tba-*`` flags, the README's option table and the
``TBA_*`` environment variables. A new option is added here and nowhere else.

Note: [Where a value comes from]
An explicit argument wins over the environment variable ``TBA_<FIELD>`` (``TBA_QUEUE_DEPTH=16``),
which wins over the default. The adaptive goal is one setting under three names (:data:`GOALS`):
a goal given as an argument wins over every goal variable, so ``memory_budget="2G"`` with
``TBA_MEMORY_BUDGET_BYTES`` or ``TBA_OVERHEAD_BOUND`` set plans for 2 GiB; two goals given the same
way (both as arguments, or both in the environment) are a :class:`~tba.errors.TbaConfigError`.
``TBA_DIR`` names the directory. Sizes are bytes, given as an int or as a string that
:func:`tba.parse_size` reads (``"64K"``, ``"512MiB"``, ``"2GB"``); a float such as
``overhead_bound`` takes a number or its decimal string (from the environment).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import os
import re
from collections.abc import Iterator, Mapping
from typing import Any

from tba import defaults
from tba._units import SizeError, parse_size
from tba.errors import TbaConfigError, did_you_mean

ENV_PREFIX = "TBA_"
"""Environment variables are ``TBA_`` plus the field name in capitals; ``TBA_DIR`` for ``directory``."""

GOALS = ("memory_budget", "memory_budget_bytes", "overhead_bound")
"""The options that name the adaptive goal: one given as an argument replaces all the others from the environment
(Note [Where a value comes from]) or from the config that :meth:`OffloadConfig.replace` copies."""

_SIZE, _COUNT, _FLAG, _TRISTATE, _FLOAT, _NAME, _PATH = "size", "count", "flag", "tristate", "float", "name", "path"


def _option(default: Any, kind: str, doc: str, *, optional: bool = False, env: str | None = None) -> Any:
    return dataclasses.field(default=default, metadata={"kind": kind, "doc": doc, "optional": optional, "env": env})


@dataclasses.dataclass(kw_only=True)
class OffloadConfig:
    """Options of :class:`tba.Offloader` and :func:`tba.offload_activations` (see the module docstring)."""

    directory: str | None = _option(None, _PATH, "Where the spill file lives, ideally on a local NVMe drive. "
                                    "None: $TBA_DIR, else the system temp directory. Created if missing.",
                                    optional=True, env="TBA_DIR")
    backend: Any = _option("auto", _NAME, "I/O engine: auto (io_uring where the kernel allows it, else threads), "
                           "io_uring, threads, kvikio (CUDA tensors through kvikio.CuFile), a registered engine "
                           "name, or an Engine instance.")
    policy: Any = _option("adaptive", _NAME, "Placement per layer: adaptive (profile the first steps offloading "
                          "everything, then keep, offload or recompute each layer of the found or given layers to "
                          "meet the goal), offload (every layer to disk), keep (nothing to disk), a tba.Plan to "
                          "pin, or a tba.Policy object whose plan(profile) chooses after profiling (one-shot "
                          "contexts share its plans: the same object, or one of its class with the same attributes). "
                          "keep and plans need layers=.")
    memory_budget: int | None = _option(None, _SIZE, "Adaptive goal: at most this many activation bytes (an int "
                                        "or a size such as 512M or 1.5GiB), fastest placement first; planning "
                                        "fails with TbaConfigError when the model cannot fit.", optional=True)
    memory_budget_bytes: int | None = _option(None, _SIZE, "The same as memory_budget (its older name).",
                                              optional=True)
    overhead_bound: float | None = _option(None, _FLOAT, "Adaptive goal: least memory whose step time stays within "
                                           "(1 + overhead_bound) x the fastest placement's. Without any goal: "
                                           f"{defaults.ADAPTIVE_OVERHEAD_BOUND:g}.", optional=True)
    profile_steps: int = _option(defaults.PROFILE_STEPS, _COUNT, "Steps profiled (offloading everything) before "
                                 "the adaptive plan applies.")
    min_offload_bytes: int = _option(defaults.MIN_OFFLOAD_BYTES, _SIZE, "Storages smaller than this stay in memory.")
    prefetch_depth_layers: int = _option(defaults.PREFETCH_DEPTH_LAYERS, _COUNT, "Layers below the current one "
                                         "read ahead during backward.")
    prefetch_budget_bytes: int | None = _option(defaults.PREFETCH_BUDGET_BYTES, _SIZE, "Bound on bytes read ahead "
                                                "or held for backward. None: the window sizes itself, from "
                                                f"{defaults.PREFETCH_WINDOW_MIN_BYTES >> 20} MiB up to "
                                                f"{defaults.PREFETCH_WINDOW_MAX_FRACTION:g} of the bytes a forward "
                                                "writes.", optional=True)
    block_size_bytes: int = _option(defaults.BLOCK_SIZE_BYTES, _SIZE, "Largest I/O request, a multiple of "
                                    f"{defaults.ALIGN_BYTES}.")
    queue_depth: int = _option(defaults.QUEUE_DEPTH, _COUNT, f"Requests in flight at once, 1..{defaults.MAX_QUEUE_DEPTH}.")
    direct_io: bool | None = _option(None, _TRISTATE, "True requires O_DIRECT, False disables it, None uses it "
                                     "where the file system takes it and warns once otherwise.", optional=True)
    staging_bytes: int = _option(defaults.STAGING_BYTES, _SIZE, "Pinned host staging pool of CUDA storages "
                                 "(at least one block).")
    verify: bool = _option(False, _FLAG, "Checksum (CRC-32C) each host storage when written and check it when read "
                           "back; a mismatch raises TbaReadError. Needs the verify extra.")

    def __new__(cls, *args: Any, **options: Any) -> OffloadConfig:  # a misspelt option: TbaConfigError, not TypeError
        check_names(options)
        return super().__new__(cls)

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            setattr(self, field.name, _coerce(field, getattr(self, field.name)))
        _check_ranges(self)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **options: Any) -> OffloadConfig:
        """A config from ``options``, each missing one from ``TBA_<FIELD>`` (Note [Where a value comes from]).

        A goal in ``options`` (``memory_budget``, ``memory_budget_bytes`` or ``overhead_bound``) wins over every
        goal variable: ``TBA_MEMORY_BUDGET_BYTES``, ``TBA_MEMORY_BUDGET`` and ``TBA_OVERHEAD_BOUND`` are then unread.

        Raises:
            TbaConfigError: an unknown option, or a value (given or from the environment) that is invalid.
        """
        check_names(options)
        environ = os.environ if environ is None else environ
        values = dict(options)
        from_environ: dict[str, str] = {}
        goal_given = any(options.get(name) is not None for name in GOALS)
        for field in dataclasses.fields(cls):
            variable = env_name(field.name)
            if goal_given and field.name in GOALS:
                continue  # the argument's goal wins over every goal variable
            if field.name not in values and environ.get(variable, "") != "":
                values[field.name] = _from_env(field, variable, environ[variable])
                from_environ[field.name] = variable
        try:
            return cls(**values)
        except TbaConfigError as err:
            # A range error names the option; name the variable the user set too (the same error, re-raised).
            named = [f"${variable}" for name, variable in from_environ.items() if re.search(rf"\b{name}\b", str(err))]
            if named:
                err.args = (f"{err} (from {', '.join(named)})", *err.args[1:])
            raise

    def replace(self, **options: Any) -> OffloadConfig:
        """A copy with ``options`` changed (validated again); a goal given replaces the config's goal."""
        check_names(options)
        for name, twin in (("memory_budget", "memory_budget_bytes"), ("memory_budget_bytes", "memory_budget")):
            if name in options and twin not in options:  # one budget, under either name
                options[twin] = None
        if any(options.get(name) is not None for name in GOALS):
            options.update({name: None for name in GOALS if name not in options})
        return dataclasses.replace(self, **options)

    def offloader_options(self) -> dict[str, Any]:
        """Every option but ``directory``, as keywords."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "directory"}


def option_names() -> tuple[str, ...]:
    """Every option, in schema order."""
    return tuple(f.name for f in dataclasses.fields(OffloadConfig))


def options() -> Iterator[dataclasses.Field]:
    """The schema's fields (``.name``, ``.default``, ``.metadata["doc"]``, ``.metadata["kind"]``)."""
    return iter(dataclasses.fields(OffloadConfig))


def env_name(name: str) -> str:
    """The environment variable of option ``name``."""
    field = {f.name: f for f in dataclasses.fields(OffloadConfig)}[name]
    return field.metadata["env"] or ENV_PREFIX + name.upper()


def format_default(field: dataclasses.Field) -> str:
    """The default as documentation shows it: sizes in KiB/MiB/GiB, None as ``None``."""
    value = field.default
    if field.metadata["kind"] == _SIZE and isinstance(value, int) and value:
        for shift, unit in ((30, "GiB"), (20, "MiB"), (10, "KiB")):
            if value % (1 << shift) == 0:
                return f"{value >> shift} {unit}"
    return repr(value) if isinstance(value, str) else str(value)


def check_names(options: Mapping[str, Any]) -> None:
    """Raise :class:`TbaConfigError` for an option name the schema does not have, suggesting the closest."""
    names = option_names()
    for name in options:
        if name not in names:
            raise TbaConfigError(f"unknown option {name!r}; {did_you_mean(name, names)}options are: {', '.join(names)}")


def signature_with_options(function: Any, *, before: tuple[inspect.Parameter, ...] = ()) -> inspect.Signature:
    """``function``'s signature with ``**options`` spelled out as the schema's keyword-only fields.

    Private keywords (a leading underscore: test seams) are left out of what ``help()`` shows.
    """
    signature = inspect.signature(function)
    kept = [p for p in signature.parameters.values()
            if p.kind is not inspect.Parameter.VAR_KEYWORD and not p.name.startswith("_")]
    names = {p.name for p in kept}
    fields = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type)
              for f in dataclasses.fields(OffloadConfig) if f.name not in names]
    return signature.replace(parameters=[*kept, *before, *fields])


def options_doc(indent: int = 4) -> str:
    """One line per option (name, default, meaning) for docstrings."""
    pad = " " * indent
    return "\n".join(f"{pad}{f.name} (default {format_default(f)}): {f.metadata['doc']}"
                     for f in dataclasses.fields(OffloadConfig))


def options_table_markdown() -> str:
    """The README's option table: name, default, environment variable, meaning."""
    rows = ["| option | default | environment | meaning |", "|---|---|---|---|"]
    for field in dataclasses.fields(OffloadConfig):
        rows.append(f"| `{field.name}` | `{format_default(field)}` | `{env_name(field.name)}` | {field.metadata['doc']} |")
    return "\n".join(rows)


def parse_text(name: str, text: str) -> Any:
    """Option ``name``'s value written as text (a command-line flag, an environment variable).

    Raises:
        TbaConfigError: ``text`` is not a value of that option.
    """
    field = {f.name: f for f in dataclasses.fields(OffloadConfig)}[name]
    return _from_env(field, name, text)


def _from_env(field: dataclasses.Field, variable: str, text: str) -> Any:
    kind = field.metadata["kind"]
    text = text.strip()
    if field.metadata["optional"] and text.lower() == "none":
        return None
    if kind in (_FLAG, _TRISTATE):
        lowered = text.lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise TbaConfigError(f"{variable}={text!r}: write 1 or 0 (true/false)")
    if kind == _COUNT:
        try:
            return int(text)
        except ValueError:
            raise TbaConfigError(f"{variable}={text!r}: write a whole number") from None
    if kind == _FLOAT:
        try:
            return float(text)
        except ValueError:
            raise TbaConfigError(f"{variable}={text!r}: write a number such as 0.1") from None
    if kind == _SIZE:
        try:
            return parse_size(text)
        except SizeError as err:
            raise TbaConfigError(f"{variable}: {err}") from None
    return text


def _coerce(field: dataclasses.Field, value: Any) -> Any:
    name, kind = field.name, field.metadata["kind"]
    if value is None and field.metadata["optional"]:
        return None
    if kind == _SIZE:
        if isinstance(value, str):
            try:
                return parse_size(value)
            except SizeError as err:
                raise TbaConfigError(f"{name}: {err}") from None
        _require(name, isinstance(value, int) and not isinstance(value, bool), value, "bytes (an int) or a size such as '64K'")
    elif kind == _COUNT:
        _require(name, isinstance(value, int) and not isinstance(value, bool), value, "an int")
    elif kind in (_FLAG, _TRISTATE):
        _require(name, isinstance(value, bool), value, "True or False" + (" or None" if kind == _TRISTATE else ""))
    elif kind == _FLOAT:
        _require(name, isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value),
                 value, "a finite number such as 0.1")
        return float(value)
    elif kind == _PATH:
        _require(name, isinstance(value, (str, os.PathLike)), value, "a path (str or os.PathLike)")
        path = os.path.expanduser(os.fspath(value))
        if path == "":
            raise TbaConfigError(f"{name} is empty; pass a directory path, or None for $TBA_DIR or the temp directory")
        if "\0" in path:
            raise TbaConfigError(f"{name} {path!r} contains a NUL byte; pass a directory path without one")
        return path
    elif kind == _NAME and isinstance(value, str) and value == "":
        raise TbaConfigError(f"{name} is empty; see help(tba.OffloadConfig) for the accepted values")
    elif name == "policy" and isinstance(value, str) and value not in defaults.POLICIES:
        raise TbaConfigError(f"unknown policy {value!r}; {did_you_mean(value, defaults.POLICIES)}"
                             f"use one of {', '.join(defaults.POLICIES)}, a tba.Plan or a tba.Policy")
    return value


def _require(name: str, ok: bool, value: Any, expected: str) -> None:
    if not ok:
        raise TbaConfigError(f"{name} must be {expected}, got {type(value).__name__} {value!r}")


def _check_ranges(config: OffloadConfig) -> None:
    for name in ("min_offload_bytes", "prefetch_depth_layers", "prefetch_budget_bytes", "memory_budget",
                 "memory_budget_bytes", "overhead_bound"):
        value = getattr(config, name)
        if value is not None and value < 0:
            raise TbaConfigError(f"{name} must be >= 0, got {value}")
    for name in ("memory_budget", "memory_budget_bytes"):
        if getattr(config, name) == 0:
            raise TbaConfigError(f"{name} must be > 0 (bytes of activation memory; no model needs none), got 0; "
                                 "give a budget such as '2G', or leave it out for the default goal")
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


OffloadConfig.__signature__ = inspect.signature(OffloadConfig.__init__).replace(  # type: ignore[attr-defined]
    parameters=list(inspect.signature(OffloadConfig.__init__).parameters.values())[1:])  # __init__'s, not __new__'s
OffloadConfig.__doc__ = (OffloadConfig.__doc__ or "") + "\n\nFields (environment variable TBA_<NAME>):\n" + options_doc()
