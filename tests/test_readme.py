"""The README a newcomer reads: install, quick start and the minimal API first, the rest in docs/."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest
import torch

import tba

REPO = Path(__file__).resolve().parents[1]
FIRST_SCREEN_LINES = 80


def _headings(text: str) -> dict[str, int]:
    return {line[3:].strip(): number for number, line in enumerate(text.splitlines(), 1) if line.startswith("## ")}


def test_install_quick_start_and_api_come_first():
    headings = _headings((REPO / "README.md").read_text())
    assert list(headings)[:4] == ["Install", "Quick start", "API", "Options"], list(headings)
    assert headings["Options"] <= FIRST_SCREEN_LINES, "the API section must end within the README's first 80 lines"


def test_every_relative_link_resolves():
    for page in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" not in target:
                assert (page.parent / target).exists(), f"{page.relative_to(REPO)} links to missing {target}"


def test_every_doc_is_linked_from_the_readme():
    readme = (REPO / "README.md").read_text()
    for doc in sorted((REPO / "docs").glob("*.md")):
        assert f"docs/{doc.name}" in readme, f"README's Docs section does not list docs/{doc.name}"


def test_the_install_line_names_every_extra():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    extras = set(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]) - {"test"}
    line = re.search(r"# extras: (.*)", (REPO / "README.md").read_text())
    assert line, "README's install block has lost its '# extras:' comment"
    assert set(line.group(1).replace(",", " ").split()) == extras, "README's extras differ from pyproject.toml's"


def test_every_command_has_a_line_in_the_tools_page():
    from tba.cli import COMMANDS

    text = (REPO / "docs" / "tools.md").read_text()
    missing = [name for name in COMMANDS if f"\n- `python -m tba {name}" not in text]
    assert not missing, f"docs/tools.md has no '- `python -m tba NAME ...`' line for {missing}"


SNIPPET_PAGES = {"README.md": 1, "docs/api.md": 1, "docs/checkpoints.md": 1, "docs/policies.md": 4}
"""Pages whose Python blocks run as written, given a model, a batch, a loader and an optimizer, and how many
blocks each has (a new block is then run here too, or this test says so)."""


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(128, 128)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x))


class _Model(torch.nn.Module):
    """Returns the loss, as the snippets' ``loss = model(batch)`` expects."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(_Block() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # the checkpoint snippet's dcp.save
@pytest.mark.parametrize("page", sorted(SNIPPET_PAGES))
def test_python_snippets_run_as_written(page, spill_dir, tmp_path, monkeypatch):
    blocks = re.findall(r"```python\n(.*?)```", (REPO / page).read_text(), re.S)
    assert len(blocks) == SNIPPET_PAGES[page], f"{page} has {len(blocks)} Python blocks; run the new one here"
    monkeypatch.chdir(tmp_path)  # the checkpoint snippet writes under ckpt/
    torch.manual_seed(0)
    model = _Model()
    namespace = {"model": model, "batch": torch.randn(16, 128), "optimizer": torch.optim.Adam(model.parameters()),
                 # 101 batches: the checkpoint snippet saves at steps 0 and 100 and loads step 100
                 "loader": [torch.randn(16, 128) for _ in range(101 if "checkpoints" in page else 3)]}
    for block in blocks:
        exec(compile(block.replace('"/nvme/tba"', repr(spill_dir)), page, "exec"), namespace)
    if "checkpoints" in page:
        assert (tmp_path / "ckpt" / "step100" / ".metadata").exists() and (tmp_path / "ckpt" / "x" / ".metadata").exists()
    else:
        assert any(p.grad is not None for p in model.parameters())


def _doc_texts() -> str:
    return " ".join(page.read_text() for page in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))])


def test_every_repository_path_the_docs_quote_exists():
    quoted = set(re.findall(r"`((?:tests|tools|tba|examples|native|docs)/[\w./-]+)`", _doc_texts()))
    assert quoted, "no quoted path found: the pattern has gone stale"
    missing = [path for path in sorted(quoted) if not (REPO / path).exists()]
    assert not missing, f"the docs quote paths the repository lacks: {missing}"


def _resolve(dotted: str) -> object:
    """The object ``tba.a.b.C`` names: the longest importable module prefix, then attributes (None: the module
    needs a package this environment lacks, such as transformers)."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:end]))
        except ModuleNotFoundError as err:
            if err.name and not err.name.startswith("tba"):
                return None
            continue
        for attribute in parts[end:]:
            obj = getattr(obj, attribute)
        return obj
    raise AssertionError(dotted)


def test_every_tba_name_the_docs_quote_resolves():
    names = sorted(set(re.findall(r"`(tba(?:\.[A-Za-z_]\w*)+)", _doc_texts())))
    assert len(names) > 20, "the pattern has gone stale"
    missing = []
    for name in names:
        try:
            _resolve(name)
        except AttributeError:
            missing.append(name)
    assert not missing, f"the docs name what tba does not have: {missing}"


def test_every_offloader_and_stats_attribute_the_docs_quote_exists(spill_dir):
    """``offloader.prefetch_window_bytes``, ``stats.writes_skipped``: the attributes the docs tell a user to read are the
    offloader's and its stats' (the names above are checked only when spelt ``tba.``)."""
    quoted = set(re.findall(r"`(offloader(?:\.stats)?|stats)\.([A-Za-z_]\w*)", _doc_texts()))
    assert len(quoted) > 15, "the pattern has gone stale"
    offloader = tba.Offloader(spill_dir, layers=[])
    try:
        owners = {"offloader": offloader, "offloader.stats": offloader.stats, "stats": offloader.stats}
        missing = sorted(f"{owner}.{name}" for owner, name in quoted if not hasattr(owners[owner], name))
    finally:
        offloader.close()
    assert not missing, f"the docs name attributes tba does not have: {missing}"


def _anchors(text: str) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces as dashes."""
    return {re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
            for line in text.splitlines() if line.startswith("#")}


def test_every_link_anchor_names_a_heading():
    broken = []
    for page in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for target, anchor in re.findall(r"\]\(([^)#:]*)#([^)]*)\)", page.read_text()):
            if anchor not in _anchors((page.parent / target if target else page).read_text()):
                broken.append(f"{page.relative_to(REPO)} -> {target}#{anchor}")
    assert not broken, f"links to headings that do not exist: {broken}"


_FLAG = re.compile(r"(?<![\w-])(--?[A-Za-z][\w-]*)")


def _quoted_runs(pattern: str) -> list[tuple[str, str, str]]:
    """(page, command, the rest of its line) for each ``pattern`` match in the README and docs/."""
    return [(page.name, match.group(1), match.group(2))
            for page in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
            for match in re.finditer(pattern, page.read_text())]


def test_every_command_and_flag_the_docs_quote_exists():
    """``python -m tba capacity --budgets 1G`` in a doc fails for whoever copies it: each command quoted
    exists, and each flag after it is one of its options (``run``: up to the script it runs)."""
    import argparse

    from tba.cli import build_parser

    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    runs = _quoted_runs(r"python -m tba ([a-z][\w-]*)([^`\n]*)")
    assert len(runs) > 50, "the pattern has gone stale"
    wrong = []
    for page, command, rest in runs:
        if command not in commands:
            wrong.append(f"{page}: python -m tba {command}")
            continue
        if command == "run":
            rest = re.split(r"\S+\.py\b| -m ", rest)[0]
        wrong += [f"{page}: python -m tba {command} {flag}" for flag in _FLAG.findall(rest)
                  if flag not in commands[command]._option_string_actions]
    assert not wrong, f"the docs quote commands or flags that do not exist: {wrong}"


def test_every_flag_of_a_script_the_docs_quote_exists():
    from python_runs import run_python

    runs = _quoted_runs(r"python ((?:tools|examples)/[\w/]+\.py)([^`\n]*)")
    assert len(runs) > 5, "the pattern has gone stale"
    helps: dict[str, str] = {}
    wrong = []
    for page, script, rest in runs:
        if script not in helps:
            done = run_python([str(REPO / script), "--help"], cwd=REPO, timeout=120)
            assert done.returncode == 0, f"{script} --help: {done.stderr}"
            helps[script] = done.stdout
        wrong += [f"{page}: python {script} {flag}" for flag in _FLAG.findall(rest.split(" -- ")[0])
                  if flag.startswith("--") and not re.search(rf"{flag}\b", helps[script])]
    assert not wrong, f"the docs quote flags that these scripts do not have: {wrong}"
