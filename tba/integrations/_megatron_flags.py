"""The ``--tba-*`` command-line flags of the Megatron integration (:mod:`tba.integrations.megatron`).

Every :class:`tba.OffloadConfig` option is a flag, derived from the option schema (``tba.config.options``): its
name is ``--tba-`` and the option's name with dashes (:data:`FLAG_NAMES` for the exceptions), its type parses and
range-checks the value at ``argparse`` time, so a bad value is an error naming the flag before the model is built,
and its help gives the default it runs with. A flag not given is left out of :func:`options_from_args`, so the
option falls to its ``TBA_<NAME>`` variable or its default.
"""

from __future__ import annotations

import argparse
import functools
from typing import Any

from tba.config import format_default, parse_text
from tba.config import options as config_options
from tba.defaults import POLICIES
from tba.errors import TbaConfigError, did_you_mean
from tba.integrations import check_alone
from tba.io import backend_names

FLAG_HELP = {
    "policy": "offload (every transformer layer to disk), keep (activations stay in memory, the context is "
              "not entered) or adaptive (keep, offload or recompute each layer to meet --tba-memory-budget "
              "or --tba-overhead-bound; not beside Megatron's recompute) (default: 'offload', as in every "
              "integration; TBA_POLICY is not read)",
    "prefetch_depth_layers": "Layers below the current one read ahead during backward. (default: 1, or "
                             "recompute_num_layers under full uniform recompute)",
}
"""Help of the flags whose meaning or default under Megatron is not the schema's: the integration offloads
unless told to plan, and reads the prefetch depth from Megatron's recompute (:class:`MegatronOffloader`)."""

FLAG_NAMES = {"directory": "--tba-dir", "memory_budget": "--tba-memory-budget"}
"""Flags whose name is not ``--tba-`` plus the option's name with dashes."""


def flag_name(option: str) -> str:
    """The Megatron flag of an :class:`tba.OffloadConfig` option: ``queue_depth`` -> ``--tba-queue-depth``."""
    return FLAG_NAMES.get(option, "--tba-" + option.replace("_", "-"))


def add_tba_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``--tba-*`` flags to ``parser`` and return it (Megatron-LM's ``extra_args_provider``).

    ``--tba-offload-activations`` (off by default) turns tba on; every :class:`tba.OffloadConfig`
    option has a flag (:func:`flag_name`), whose help gives the default it runs with: the schema's, but
    for ``--tba-policy`` (``offload``) and ``--tba-prefetch-depth-layers`` (:data:`FLAG_HELP`). A flag not
    given leaves the option to ``TBA_<NAME>`` or that default (``TBA_POLICY`` is not read).
    """
    group = parser.add_argument_group("tba", "offload activations to NVMe files during forward")
    group.add_argument("--tba-offload-activations", action="store_true",
                       help="run each forward step inside a tba offload context")
    for field in config_options():
        if field.name in _NOT_FLAGS:
            continue
        choices = POLICIES if field.name == "policy" else backend_names() if field.name == "backend" else None
        group.add_argument(flag_name(field.name), dest=_dest(field.name), default=None,
                           type=functools.partial(_choice, flag_name(field.name), tuple(choices)) if choices
                           else functools.partial(_flag_value, field.name),
                           metavar="{" + ",".join(choices) + "}" if choices else field.metadata["kind"].upper(),
                           help=FLAG_HELP.get(field.name, f"{field.metadata['doc']} (default: {format_default(field)})"))
    return parser


def _choice(flag: str, choices: tuple[str, ...], text: str) -> str:
    """``text`` if it is one of ``choices``; else argparse's error, with the closest choice to the typo."""
    if text in choices:
        return text
    raise argparse.ArgumentTypeError(f"{text!r} is not a {flag} choice; {did_you_mean(text, choices)}"
                                     f"choose from {', '.join(choices)}")


_NOT_FLAGS = ("profile_steps", "memory_budget_bytes")
"""Options without a flag: profiling length is tba's business under Megatron; ``--tba-memory-budget``
is ``memory_budget`` (``memory_budget_bytes`` is its older name)."""


def _flag_value(name: str, text: str) -> Any:
    """The option's value, range-checked now (alone: Note [Options checked against one that comes later] in
    tba/integrations/__init__.py), so that argparse names the flag at parse, not the offloader's build after the model
    is made."""
    try:
        value = parse_text(name, text)
        check_alone({name: value})
        return value
    except TbaConfigError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def options_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The :class:`tba.OffloadConfig` options the ``--tba-*`` flags gave (flags not given are left out)."""
    return {f.name: getattr(args, _dest(f.name)) for f in config_options()
            if getattr(args, _dest(f.name), None) is not None}


def _dest(option: str) -> str:
    return flag_name(option)[2:].replace("-", "_")
