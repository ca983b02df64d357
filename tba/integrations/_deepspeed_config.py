"""The ``"tba"`` block of a DeepSpeed config: its keys, and the settings :class:`~tba.integrations.deepspeed.TbaDeepSpeed`
takes from it and from ZeRO's NVMe offload (the directory beside DeepSpeed's swap folders, its ``aio`` request size and
queue depth). Every :class:`tba.OffloadConfig` option is a key of the block, checked by the same schema.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

from tba.config import GOALS, option_names
from tba.errors import TbaConfigError, did_you_mean
from tba.integrations import check_alone, option_chosen

CONFIG_KEY = "tba"
DEEPSPEED_AIO_BLOCK_SIZE_BYTES = 1 << 20
"""DeepSpeed's ``aio.block_size`` when its config has none."""
DEEPSPEED_AIO_QUEUE_DEPTH = 8
"""DeepSpeed's ``aio.queue_depth`` when its config has none."""
NVME_SUBDIRECTORY = "tba"
"""tba's folder under DeepSpeed's ``nvme_path``."""

BLOCK_KEYS = ("enabled", "check_bandwidth")
"""Keys of the ``"tba"`` block beside the :class:`tba.OffloadConfig` options (every option is a key too)."""


def block_keys() -> tuple[str, ...]:
    """Every key the ``"tba"`` block accepts: its own two, then each :class:`tba.OffloadConfig` option."""
    return (*BLOCK_KEYS, *option_names())


def block_error(message: str) -> TbaConfigError:
    return TbaConfigError(f"DeepSpeed config \"{CONFIG_KEY}\" block: {message}")


@dataclasses.dataclass(frozen=True)
class TbaSettings:
    """What a ``"tba"`` block resolves to, with DeepSpeed's config filling the defaults."""

    enabled: bool
    directory: str | None
    policy: str
    offloader_options: dict[str, Any]
    nvme_path: str | None
    optimizer_on_nvme: bool
    """DeepSpeed swaps optimizer states through ``nvme_path``: only ZeRO-3 does; ZeRO-1/2 keep an
    ``offload_optimizer`` of device ``"nvme"`` in host memory, writing nothing."""
    params_on_nvme: bool
    check_bandwidth: bool


def load_config(config: str | os.PathLike | Mapping[str, Any]) -> dict[str, Any]:
    """The DeepSpeed config as a dict: ``config`` itself, or the JSON file it names."""
    if isinstance(config, Mapping):
        return dict(config)
    if not isinstance(config, (str, bytes, os.PathLike)):  # open(5) would read file descriptor 5
        raise TbaConfigError(f"the DeepSpeed config must be a dict or the path of a JSON file, got "
                             f"{type(config).__name__} {config!r}")
    try:
        with open(config) as file:
            loaded = json.load(file)
    except (OSError, ValueError) as err:
        raise TbaConfigError(f"cannot read the DeepSpeed config {config!s} as JSON ({err}); pass it as a dict") from err
    if not isinstance(loaded, dict):
        raise TbaConfigError(f"the DeepSpeed config {config!s} holds {type(loaded).__name__}, not a JSON object; "
                             "write its settings as one object ({...})")
    return loaded


def _check_options(options: dict[str, Any]) -> None:
    for key in BLOCK_KEYS:
        if key in options and not isinstance(options[key], bool):
            raise block_error(f"\"{key}\" must be true or false, got {options[key]!r}")
    try:  # the block size may be DeepSpeed's aio.block_size: Note [Options checked against one that comes later]
        check_alone({key: value for key, value in options.items() if key not in BLOCK_KEYS})
    except TbaConfigError as err:
        raise block_error(str(err)) from None


def _section(config: Mapping[str, Any], key: str, where: str) -> Mapping[str, Any]:
    """``config[key]`` (``{}`` where missing or null), refused naming ``where`` unless a JSON object: tba read each one's
    keys with ``.get``, and ``"zero_optimization": 3`` failed with ``AttributeError`` deep in tba (helper-125)."""
    section = config.get(key)
    if section is None:
        return {}
    if not isinstance(section, Mapping):
        raise TbaConfigError(f"DeepSpeed config {where} must be an object ({{...}}), got {section!r:.80}")
    return section


def _nvme_path(zero: Mapping[str, Any], section: str) -> str | None:
    offload = _section(zero, section, f"zero_optimization.{section}")
    if str(offload.get("device", "none")).lower() != "nvme":
        return None
    path = offload.get("nvme_path")
    if not path:
        raise TbaConfigError(f"zero_optimization.{section}.device is \"nvme\" but it has no nvme_path; set one")
    if not isinstance(path, (str, os.PathLike)):
        raise TbaConfigError(f"zero_optimization.{section}.nvme_path must be a path (a string), got {path!r:.80}")
    return os.fspath(path)


_AIO_KEYS = {"block_size_bytes": ("block_size", DEEPSPEED_AIO_BLOCK_SIZE_BYTES),
             "queue_depth": ("queue_depth", DEEPSPEED_AIO_QUEUE_DEPTH)}


def _take_aio(options: dict[str, Any], aio: Mapping[str, Any]) -> None:
    """The options the block leaves out that default to DeepSpeed's ``aio`` settings; one tba cannot take is
    refused naming ``aio`` (it was blamed on the block, which never set it)."""
    for option, (aio_key, default) in _AIO_KEYS.items():
        if option_chosen(options, option):  # Note [An integration's default yields to a chosen option]
            continue
        options[option] = aio.get(aio_key, default)
        try:  # beside the block's options (a staging pool): Note [Options checked against one that comes later]
            check_alone({**options, option: options[option]})
        except TbaConfigError as err:
            raise TbaConfigError(f"DeepSpeed config aio.{aio_key} {options[option]!r}, which tba's {option} defaults to with "
                                 f"NVMe offload, does not suit tba ({err}); set \"{option}\" in the \"{CONFIG_KEY}\" "
                                 "block") from None


def parse_config(config: str | os.PathLike | Mapping[str, Any]) -> TbaSettings | None:
    """Validate the ``"tba"`` block of a DeepSpeed config; None when there is none.

    Keys (all optional): ``enabled`` (default true), ``check_bandwidth`` (default true), and every
    :class:`tba.OffloadConfig` option under its own name, with the schema's default, except that
    ``directory`` defaults to ``<nvme_path>/tba`` with NVMe offload and ``block_size_bytes`` /
    ``queue_depth`` to DeepSpeed's ``aio`` settings then, where their ``TBA_<NAME>`` variables do not set them.
    Sizes may be strings (``"64K"``).

    Raises:
        TbaConfigError: an unknown key or a value of the wrong type, naming the fix.
    """
    config = load_config(config)
    block = config.get(CONFIG_KEY)
    if block is None:
        return None
    if not isinstance(block, Mapping):
        raise block_error(f"must be an object, got {block!r}")
    unknown = sorted(set(block) - set(block_keys()))
    if unknown:
        raise block_error(f"unknown key(s) {', '.join(map(repr, unknown))}; {did_you_mean(unknown[0], block_keys())}"
                          f"valid keys: {', '.join(block_keys())}")
    _check_options(dict(block))
    zero = _section(config, "zero_optimization", "zero_optimization")
    param_path = _nvme_path(zero, "offload_param")
    optimizer_path = _nvme_path(zero, "offload_optimizer")
    nvme_path = param_path or optimizer_path
    options = {key: block[key] for key in option_names() if key in block and key not in ("directory", "policy")}
    if nvme_path is not None:
        _take_aio(options, _section(config, "aio", "aio"))
    policy = block.get("policy", "offload")
    goals = [key for key in GOALS if block.get(key) is not None]
    if goals and policy != "adaptive":  # the offloader refused it naming 'offload' (not in the block); "keep" hid it
        raise block_error(f"\"{goals[0]}\" is a goal of \"policy\": \"adaptive\", and this block's policy is "
                          f"\"{policy}\"{' (the default here)' if 'policy' not in block else ''}: add \"policy\": "
                          f"\"adaptive\", or drop \"{goals[0]}\"")
    if policy != "offload":
        options["policy"] = policy
    directory = block.get("directory")
    if directory is None and nvme_path is not None and not option_chosen(block, "directory"):  # else $TBA_DIR's
        directory = os.path.join(nvme_path, NVME_SUBDIRECTORY)
    return TbaSettings(
        enabled=block.get("enabled", True),
        directory=directory,
        policy=policy,
        offloader_options=options,
        nvme_path=nvme_path,
        optimizer_on_nvme=optimizer_path is not None and zero.get("stage") == 3,
        params_on_nvme=param_path is not None and zero.get("stage") == 3,
        check_bandwidth=block.get("check_bandwidth", True),
    )
