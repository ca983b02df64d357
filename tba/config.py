"""One schema for every user option of tba: :class:`OffloadConfig`.

Every option is a field of one keyword-only dataclass, documented once (unit, default, meaning) and
validated once, in ``__post_init__`` (by the field's kind: ``tba/_option_values.py``). Everything
else is generated from it: the visible signatures of :class:`tba.Offloader` and
:func:`tba.offload_activations`, the keys of the DeepSpeed ``"tba"`` block, Megatron's ``--tba-*``
flags, the README's option table and the ``TBA_*`` environment variables. A new option is added here
and nowhere else.

Note: [Where a value comes from]
An explicit argument wins over the environment variable ``TBA_<FIELD>`` (``TBA_QUEUE_DEPTH=16``),
which wins over the default. The adaptive goal is one setting under three names (:data:`GOALS`):
a goal given as an argument wins over every goal variable, so ``memory_budget="2G"`` with
``TBA_MEMORY_BUDGET_BYTES`` or ``TBA_OVERHEAD_BOUND`` set plans for 2 GiB; two goals given the same
way (both as arguments, or both in the environment) are a :class:`~tba.errors.TbaConfigError`.
``TBA_DIR`` names the directory. Sizes are bytes, given as an int or as a string that
:func:`tba.parse_size` reads (``"64K"``, ``"512MiB"``, ``"2GB"``); a float such as
``overhead_bound`` takes a number or its decimal string (from the environment).

Note: [A field that takes more than it holds]
A size option is given as ``2 << 30`` or ``"2GiB"`` and held, once validated, as bytes; ``directory`` is given
as a str or an ``os.PathLike`` and held as a str. Annotated ``int`` or ``int | None``, a user's type checker
refused ``OffloadConfig(memory_budget="2GiB")``, the README's own example; annotated ``int | str``, it would
make everyone who reads ``config.memory_budget`` handle a str that is never there. So such a field is
annotated ``Accepts[Held, Given]`` (``tba/_accepts.py``), a descriptor type: mypy and pyright take a dataclass
field whose type has ``__set__`` as a descriptor, so the generated ``__init__`` takes ``Given`` and reading
the field gives ``Held``. Nothing changes at run time: annotations are never evaluated here, and the field is
a plain attribute. mypy reads a field as a descriptor only when it has a default (every option has one), so
:class:`tba.Plan`, whose ``decisions`` and ``window_bytes`` are required, declares the constructor it takes
under ``TYPE_CHECKING`` instead (``tba/policy/_plan.py``). ``help()`` shows the accepted types
(:func:`_accepted`), never the ``Accepts`` spelling.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import re
from collections.abc import Iterator, Mapping
from typing import Any

from tba import defaults
from tba._accepts import Accepts
from tba._option_values import COUNT, FLAG, FLOAT, NAME, PATH, SIZE, TRISTATE, check_ranges, coerce, from_text
from tba.errors import TbaConfigError, did_you_mean
from tba.io import check_backend_name

ENV_PREFIX = "TBA_"
"""Environment variables are ``TBA_`` plus the field name in capitals; ``TBA_DIR`` for ``directory``."""

GOALS = ("memory_budget", "memory_budget_bytes", "overhead_bound")
"""The options that name the adaptive goal: one given as an argument replaces all the others from the environment
(Note [Where a value comes from]) or from the config that :meth:`OffloadConfig.replace` copies."""



def _option(default: Any, kind: str, doc: str, *, optional: bool = False, env: str | None = None) -> Any:
    return dataclasses.field(default=default, metadata={"kind": kind, "doc": doc, "optional": optional, "env": env})


@dataclasses.dataclass(kw_only=True)
class OffloadConfig:
    """Options of :class:`tba.Offloader` and :func:`tba.offload_activations` (see the module docstring)."""

    directory: Accepts[str | None, str | os.PathLike[str] | None] = _option(
        None, PATH, "Where the spill file lives, ideally on a local NVMe drive. None: $TBA_DIR, else the system temp "
        "directory. Created with its parents if missing (logged at DEBUG); python -m tba's --directory must exist.",
        optional=True, env="TBA_DIR")
    backend: Any = _option("auto", NAME, "I/O engine: auto (io_uring where the kernel allows it, else threads), "
                           "io_uring, threads, kvikio (CUDA tensors through kvikio.CuFile), a registered engine "
                           "name, or an Engine instance.")
    policy: Any = _option("adaptive", NAME, "Placement per layer: adaptive (profile the first steps offloading "
                          "everything, then keep, offload or recompute each layer of the found or given layers to "
                          "meet the goal), offload (every layer to disk), keep (nothing to disk), a tba.Plan to "
                          "pin, or a tba.Policy object whose plan(profile) chooses after profiling (one-shot "
                          "contexts share its plans: the same object, or one of its class with the same attributes). "
                          "keep and plans need layers=.")
    memory_budget: Accepts[int | None, int | str | None] = _option(
        None, SIZE, "Adaptive goal: at most this many activation bytes (an int or a size such as 512M or 1.5GiB), "
        "fastest placement first; planning fails with TbaConfigError when the model cannot fit.", optional=True)
    memory_budget_bytes: Accepts[int | None, int | str | None] = _option(
        None, SIZE, "The same as memory_budget (its older name).", optional=True)
    overhead_bound: float | None = _option(None, FLOAT, "Adaptive goal: least memory whose step time stays within "
                                           "(1 + overhead_bound) x the fastest placement's. Without any goal: "
                                           f"{defaults.ADAPTIVE_OVERHEAD_BOUND:g}.", optional=True)
    profile_steps: int = _option(defaults.PROFILE_STEPS, COUNT, "Steps profiled (offloading everything) before "
                                 "the adaptive plan applies.")
    min_offload_bytes: Accepts[int, int | str] = _option(defaults.MIN_OFFLOAD_BYTES, SIZE,
                                                         "Storages smaller than this stay in memory.")
    prefetch_depth_layers: int = _option(defaults.PREFETCH_DEPTH_LAYERS, COUNT, "Layers below the current one "
                                         "read ahead during backward.")
    prefetch_budget_bytes: Accepts[int | None, int | str | None] = _option(
        defaults.PREFETCH_BUDGET_BYTES, SIZE, "Bound on bytes read ahead or held for backward. None: the window sizes "
        f"itself, from {defaults.PREFETCH_WINDOW_MIN_BYTES >> 20} MiB up to "
        f"{defaults.PREFETCH_WINDOW_MAX_FRACTION:g} of the bytes a forward writes.", optional=True)
    block_size_bytes: Accepts[int, int | str] = _option(defaults.BLOCK_SIZE_BYTES, SIZE, "Largest I/O request, a "
                                                        f"multiple of {defaults.ALIGN_BYTES}.")
    queue_depth: int = _option(defaults.QUEUE_DEPTH, COUNT, f"Requests in flight at once, 1..{defaults.MAX_QUEUE_DEPTH}.")
    direct_io: bool | None = _option(None, TRISTATE, "True requires O_DIRECT, False disables it, None uses it "
                                     "where the file system takes it and warns once otherwise.", optional=True)
    staging_bytes: Accepts[int, int | str] = _option(defaults.STAGING_BYTES, SIZE, "Pinned host staging pool of CUDA storages "
                                 "(at least one block).")
    verify: bool = _option(False, FLAG, "Checksum (CRC-32C) each host storage when written and check it when read "
                           "back; a mismatch raises TbaReadError. Needs the verify extra.")

    def __new__(cls, *args: Any, **options: Any) -> OffloadConfig:  # a misspelt option: TbaConfigError, not TypeError
        check_names(options)
        return super().__new__(cls)

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            setattr(self, field.name, coerce(field, getattr(self, field.name)))
        check_ranges(self)

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
        if options.get("directory") is None and environ.get("TBA_DIRECTORY", "") != "":  # TBA_<NAME> but for directory
            raise TbaConfigError("$TBA_DIRECTORY is not read: the directory's variable is TBA_DIR; rename it to TBA_DIR")
        values = dict(options)
        from_environ: dict[str, str] = {}
        goal_given = any(options.get(name) is not None for name in GOALS)
        for field in dataclasses.fields(cls):
            variable = env_name(field.name)
            if goal_given and field.name in GOALS:
                continue  # the argument's goal wins over every goal variable
            if field.name not in values and environ.get(variable, "") != "":
                values[field.name] = from_text(field, variable, environ[variable])
                from_environ[field.name] = variable
        _check_goal_variables(from_environ, values, environ)
        try:
            config = cls(**values)
            if "backend" in from_environ:  # else an unknown name fails at the engine, naming no variable
                check_backend_name(config.backend)
            return config
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


def _check_goal_variables(from_environ: Mapping[str, str], values: Mapping[str, Any], environ: Mapping[str, str]) -> None:
    """Refuse a goal variable beside a policy that plans nothing, naming the variable (Note [A goal variable
    beside a policy that plans nothing]).

    Note: [A goal variable beside a policy that plans nothing]
    A goal (``TBA_MEMORY_BUDGET``, ``TBA_MEMORY_BUDGET_BYTES``, ``TBA_OVERHEAD_BOUND``) set in the environment
    beside ``policy="offload"``, ``"keep"`` or a pinned plan was refused only when the runner was built, as
    "memory_budget and overhead_bound need policy='adaptive', not 'offload'", naming neither the variable nor
    where the policy came from. Every integration passes ``policy="offload"`` unless told to plan, so a goal
    exported in the shell failed ``TbaDeepSpeed`` with that text prefixed by 'DeepSpeed config "tba" block:'
    (a block that held no goal), and ``TbaTrainer`` at its first training step. The variable wins over no
    argument here: ignoring it would drop a budget the user asked for, so it is refused, naming it.
    """
    variables = [(name, variable) for name, variable in from_environ.items() if name in GOALS]
    policy = values.get("policy", "adaptive")
    if not variables or (isinstance(policy, str) and policy not in ("offload", "keep")):
        return  # "adaptive" (an unknown name is refused by the schema, naming it)
    named = repr(policy) if isinstance(policy, str) else f"a {type(policy).__name__}"
    if "policy" in from_environ:
        named += f" (from ${from_environ['policy']})"
    variable = variables[0][1]
    raise TbaConfigError(f"${variable}={environ[variable]} is a goal of "
                         f"policy='adaptive', but policy is {named}: unset {variable}, or pass policy='adaptive'")


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
    if field.metadata["kind"] == SIZE and isinstance(value, int) and value:
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
    fields = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=_accepted(f))
              for f in dataclasses.fields(OffloadConfig) if f.name not in names]
    return signature.replace(parameters=[*kept, *before, *fields])


def _accepted(field: dataclasses.Field) -> Any:
    """What an option takes as an argument: a size also as a string (``"2GiB"``), which the field holds as bytes,
    a directory also as an ``os.PathLike`` (Note [A field that takes more than it holds])."""
    if field.metadata["kind"] == PATH:
        return "str | os.PathLike | None"
    if field.metadata["kind"] != SIZE:
        return field.type
    return "int | str | None" if field.metadata["optional"] else "int | str"


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
    return from_text(field, name, text)


OffloadConfig.__signature__ = inspect.signature(OffloadConfig.__init__).replace(  # type: ignore[attr-defined]
    parameters=[p.replace(annotation=_accepted(f)) for p, f in  # __init__'s, not __new__'s
                zip(list(inspect.signature(OffloadConfig.__init__).parameters.values())[1:], dataclasses.fields(OffloadConfig))])
OffloadConfig.__doc__ = ((OffloadConfig.__doc__ or "") + "\n\nFields (environment variable TBA_<NAME>, TBA_DIR for "
                         "directory):\n" + options_doc())
