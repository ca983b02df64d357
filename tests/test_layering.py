"""The package's layering, checked on the source: lower packages never import higher ones, and no
module reaches into another package's private (``_name``) modules.

Order, low to high (a package may import its own modules and any lower package's public face):
``tba`` core modules (``defaults``, ``errors``, ``_units``, ``_trace``, ``_control``, ``_option_values``, ...)
-> ``io`` -> ``device`` -> ``policy`` -> ``config`` -> ``runtime`` -> ``checkpoint``, ``integrations``
-> ``bench`` -> ``cli``.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "tba"

LEVELS = {
    "core": 0, "io": 1, "device": 2, "policy": 3, "config": 4, "runtime": 5,
    "checkpoint": 6, "integrations": 6, "bench": 7, "cli": 8,
}
"""Each top-level part of ``tba`` and its level; a module may import parts of its level or lower."""


def part_of(module: str) -> str:
    """``tba.io._spill`` -> ``io``; top-level private modules and ``tba`` itself are ``core``."""
    names = module.split(".")
    if len(names) < 2 or names[1] not in LEVELS:
        return "core"
    return names[1]


def module_name(path: pathlib.Path) -> str:
    relative = path.relative_to(ROOT.parent).with_suffix("")
    names = list(relative.parts)
    if names[-1] == "__init__":
        names.pop()
    return ".".join(names)


def imports(path: pathlib.Path, text: str) -> list[tuple[int, str]]:
    """(line, imported module) for every ``import tba...`` / ``from tba... import`` in ``path``, lazy ones too."""
    found = []
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names if alias.name.startswith("tba")]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            if base.startswith("tba"):
                found.append((node.lineno, base))
                found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names
                          if alias.name.startswith("_") and not alias.name.startswith("__")]
    return found


SOURCES = sorted(p for p in ROOT.rglob("*.py") if p.name != "__main__.py")


def violations(sources: dict[pathlib.Path, str]) -> tuple[list[str], list[str]]:
    """(upward imports, cross-package private imports) among ``sources`` (path -> text)."""
    upward, private = [], []
    for path, text in sources.items():
        part = part_of(module_name(path))
        for line, target in imports(path, text):
            where = f"{path.relative_to(ROOT.parent)}:{line} imports {target}"
            other = part_of(target)
            if LEVELS[other] > LEVELS[part] and part != "core":
                upward.append(where)
            if other != part and other != "core" and any(n.startswith("_") for n in target.split(".")[2:]):
                private.append(where)
    return upward, private


def test_sources_are_found():
    assert len(SOURCES) > 40
    assert any(path.name == "_offloader.py" for path in SOURCES)


def tree() -> dict[pathlib.Path, str]:
    return {path: path.read_text() for path in SOURCES}


def test_no_package_imports_a_higher_one():
    upward, _ = violations(tree())
    assert not upward, "imports from a lower package to a higher one:\n" + "\n".join(upward)


def test_no_module_imports_another_packages_private_modules():
    _, private = violations(tree())
    assert not private, "cross-package imports of private modules (use the package's public face):\n" + "\n".join(private)


@pytest.mark.parametrize("source, line, expected", [
    ("policy/_x.py", "from tba.runtime._offloader import Offloader", ("upward", "private")),
    ("io/_x.py", "from tba.runtime import Offloader", ("upward",)),
    ("runtime/_x.py", "from tba.io._spill import SpillFile", ("private",)),
    ("runtime/_x.py", "from tba.io import _spill", ("private",)),
    ("runtime/_x.py", "import tba.cli", ("upward",)),
    ("runtime/_x.py", "from tba.io import SpillFile", ()),
    ("runtime/_x.py", "from tba.runtime._store import StorageStore", ()),
    ("runtime/_x.py", "from ._store import StorageStore", ()),
    ("cli/_x.py", "from tba.defaults import MIB", ()),
])
def test_the_checker_flags_what_it_should(source, line, expected):
    upward, private = violations({ROOT / source: line + "\n"})
    assert (("upward",) if upward else ()) + (("private",) if private else ()) == expected
