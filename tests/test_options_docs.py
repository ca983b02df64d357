"""Every place that documents an option agrees with the schema (``tba.OffloadConfig``).

The schema is the source; these tests read what each other place shows a user (the signatures and
docstrings ``help()`` prints, the README's table, DeepSpeed's accepted keys, Megatron's ``--help``)
and compare each option's name and default with it.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import pathlib
import re

import pytest

import tba
from tba import TbaConfigError
from tba.config import env_name, format_default, option_names, options_table_markdown
from tba.integrations import _megatron_flags
from tba.integrations import deepspeed as tba_ds
from tba.integrations import megatron as tba_megatron

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
FIELDS = {field.name: field for field in dataclasses.fields(tba.OffloadConfig)}


@pytest.mark.parametrize("function", [tba.offload_activations, tba.Offloader])
def test_signatures_show_every_option_with_the_schema_default(function):
    parameters = inspect.signature(function).parameters
    for name, field in FIELDS.items():
        assert name in parameters, f"{function.__name__} does not show {name}"
        assert parameters[name].default == field.default, name
    assert not [p for p in parameters if p.startswith("_")], "test seams are not shown to users"


@pytest.mark.parametrize("function", [tba.offload_activations, tba.Offloader, tba.OffloadConfig])
def test_signatures_show_that_sizes_take_strings(function):
    """``help()`` shows ``memory_budget: int | str | None``: the README passes ``memory_budget="2GiB"``."""
    parameters = inspect.signature(function).parameters
    sizes = [name for name, field in FIELDS.items() if field.metadata["kind"] == "size"]
    assert "memory_budget" in sizes and "block_size_bytes" in sizes
    for name in sizes:
        shown = str(parameters[name].annotation)
        assert "int | str" in shown and ("None" in shown) == FIELDS[name].metadata["optional"], (name, shown)
    # Note [A field that takes more than it holds] in tba/config.py: the type checkers' spelling is not shown.
    assert [str(p.annotation) for p in parameters.values() if "Accepts" in str(p.annotation)] == []
    assert "PathLike" in str(parameters["directory"].annotation)


@pytest.mark.parametrize("name", sorted(FIELDS))
def test_docstrings_give_the_schema_default(name):
    line = f"{name} (default {format_default(FIELDS[name])})"
    assert line in tba.offload_activations.__doc__
    assert line in tba.OffloadConfig.__doc__


def test_readme_table_is_the_schema():
    text = README.read_text()
    table = re.search(r"<!-- tba-options:begin -->\n(.*?)\n<!-- tba-options:end -->", text, re.S)
    assert table, "README has lost its option table markers"
    assert table.group(1).strip() == options_table_markdown().strip(), \
        "README's option table differs from the schema: paste tba.config.options_table_markdown() between the markers"
    rows = {row.split("`")[1]: row for row in table.group(1).splitlines()[2:]}
    assert list(rows) == list(option_names())
    for name, row in rows.items():
        assert f"`{format_default(FIELDS[name])}`" in row and f"`{env_name(name)}`" in row


def test_deepspeed_accepts_every_option_and_applies_the_schema_default():
    assert set(option_names()) <= set(tba_ds.block_keys())
    settings = tba_ds.parse_config({"tba": {}})
    assert settings.offloader_options == {}, "an empty block leaves every option to the schema"
    block = {"min_offload_bytes": "1M", "prefetch_budget_bytes": "64M", "verify": False, "staging_bytes": 8 << 20}
    options = tba_ds.parse_config({"tba": block}).offloader_options
    assert tba.OffloadConfig(**options).min_offload_bytes == 1 << 20
    with pytest.raises(TbaConfigError, match="unknown key"):
        tba_ds.parse_config({"tba": {"min_offload": 1}})


MEGATRON_DEFAULTS = {"policy": "'offload'", "prefetch_depth_layers": "1"}
"""Options whose default under Megatron is not the schema's: ``offloader_from_args`` and ``MegatronOffloader``
offload unless told to plan, and read the prefetch depth from Megatron's full uniform recompute."""


def test_megatron_help_gives_each_flag_the_default_it_runs_with():
    parser = tba_megatron.add_tba_arguments(argparse.ArgumentParser())
    helps = {flag: " ".join((action.help or "").split()) for action in parser._actions for flag in action.option_strings}
    for name, field in FIELDS.items():
        if name in _megatron_flags._NOT_FLAGS:
            continue
        flag = tba_megatron.flag_name(name)
        assert flag in helps, f"Megatron has no flag for {name}"
        default = MEGATRON_DEFAULTS.get(name, format_default(field))
        assert f"(default: {default}" in helps[flag], f"{flag}: {helps[flag]}"
    assert "TBA_POLICY is not read" in helps["--tba-policy"]
    assert "recompute_num_layers" in helps["--tba-prefetch-depth-layers"]


def test_megatron_flags_left_out_run_with_the_defaults_the_help_gives(monkeypatch):
    monkeypatch.setenv("TBA_POLICY", "adaptive")
    args = tba_megatron.add_tba_arguments(argparse.ArgumentParser()).parse_args(["--tba-offload-activations"])
    captured = {}
    monkeypatch.setattr(tba_megatron, "MegatronOffloader", lambda model, **options: captured.update(options))
    tba_megatron.offloader_from_args(args, model=None)
    assert captured == {"policy": "offload"}


def test_megatron_parses_the_flags_into_options():
    parser = tba_megatron.add_tba_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--tba-offload-activations", "--tba-queue-depth", "16", "--tba-min-offload-bytes", "1M",
                              "--tba-direct-io", "false"])
    assert tba_megatron.options_from_args(args) == {"queue_depth": 16, "min_offload_bytes": 1 << 20, "direct_io": False}


def test_environment_variables_fill_options_and_arguments_win(monkeypatch):
    monkeypatch.setenv("TBA_QUEUE_DEPTH", "16")
    monkeypatch.setenv("TBA_MIN_OFFLOAD_BYTES", "1M")
    monkeypatch.setenv("TBA_VERIFY", "0")
    config = tba.OffloadConfig.from_env()
    assert (config.queue_depth, config.min_offload_bytes, config.verify) == (16, 1 << 20, False)
    assert tba.OffloadConfig.from_env(queue_depth=4).queue_depth == 4
    assert tba.Offloader(layers=[]).queue_depth == 16
    assert tba.OffloadConfig().queue_depth == 8, "the plain constructor reads no environment"
    monkeypatch.setenv("TBA_QUEUE_DEPTH", "many")
    with pytest.raises(TbaConfigError, match="TBA_QUEUE_DEPTH='many'"):
        tba.offload_activations()


def test_a_config_object_and_keywords_combine():
    config = tba.OffloadConfig(min_offload_bytes="1M", queue_depth=4)
    offloader = tba.Offloader(config=config, queue_depth=2, layers=[])
    assert (offloader.min_offload_bytes, offloader.queue_depth) == (1 << 20, 2)
    assert offloader.config.queue_depth == 2 and config.queue_depth == 4
    with pytest.raises(TbaConfigError, match="config must be a tba.OffloadConfig"):
        tba.Offloader(config={"queue_depth": 2})


def test_every_environment_variable_the_docs_name_is_read():
    """A ``TBA_*`` variable in the README or docs/ is an option's, or the source (tba/, tests/, tools/) reads it."""
    repo = README.parent
    named = set(re.findall(r"\bTBA_[A-Z_]+\b", " ".join(p.read_text() for p in [README, *repo.glob("docs/*.md")])))
    source = " ".join(p.read_text() for folder in ("tba", "tests", "tools") for p in (repo / folder).rglob("*")
                      if p.suffix in (".py", ".sh") and p.name != "test_options_docs.py")
    unknown = sorted(v for v in named - {env_name(name) for name in option_names()} if v not in source)
    assert not unknown, f"the docs name variables nothing reads: {unknown}"


_SET_FROM_TEXT = {"size": ("1M", 1 << 20), "count": ("3", 3), "float": ("0.2", 0.2), "flag": ("1", True),
                  "tristate": ("0", False)}
"""Per kind, a text a variable may hold and the value it is read as, unlike every such option's default."""
_NAMES_FROM_TEXT = {"backend": "threads", "policy": "offload"}
_BY_NAME = {"staging_bytes": ("8M", 8 << 20)}  # a staging pool holds at least one 4 MiB block


@pytest.mark.parametrize("name", sorted(FIELDS))
def test_every_option_is_read_from_the_variable_the_table_names(name, tmp_path):
    """The README's table names one variable per option; test_environment_variables_fill_options_and_arguments_win
    sets three of them. Each one sets its option, and an argument still wins over it."""
    field = FIELDS[name]
    kind = field.metadata["kind"]
    text, value = ((_NAMES_FROM_TEXT[name],) * 2 if kind == "name" else (str(tmp_path),) * 2 if kind == "path"
                   else _BY_NAME.get(name, _SET_FROM_TEXT[kind]))
    assert value != field.default, name
    config = tba.OffloadConfig.from_env({env_name(name): text})
    assert getattr(config, name) == value, f"${env_name(name)}={text} left {name} at {getattr(config, name)!r}"
    assert getattr(tba.OffloadConfig.from_env({env_name(name): text}, **{name: field.default}), name) == field.default
