"""The distribution is ``tba-offload`` (PyPI's ``tba`` is an unrelated project); the import name is ``tba``."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import tba

REPO = Path(__file__).resolve().parents[1]
DIST = "tba-offload"
# tba/device/ is being rewritten on the issue-22 branch; its kvikio hint is fixed when that lands.
PENDING: set[str] = set()


def test_distribution_name_and_version():
    assert re.search(r"^name = \"([^\"]+)\"", (REPO / "pyproject.toml").read_text(), re.M).group(1) == DIST
    assert importlib.metadata.version(DIST) == tba.__version__


def test_no_install_hint_names_the_wrong_package():
    wrong = re.compile(r"pip install ['\"]?tba(\[|['\"\s`]|$)")
    offenders = [f"{path.relative_to(REPO)}:{number}"
                 for pattern in ("tba/**/*.py", "examples/**/*.py", "*.md", "docs/*.md")
                 for path in REPO.glob(pattern)
                 for number, line in enumerate(path.read_text().splitlines(), 1) if wrong.search(line)]
    assert sorted(set(offenders) - PENDING) == [], f"install hints naming PyPI's unrelated 'tba': {offenders}"
