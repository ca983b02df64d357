"""Named Notes: every ``Note [Title]`` a docstring or comment points to exists, in the file it names."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFINITION = re.compile(r"Note: \[([^\]]+)\]")
REFERENCE = re.compile(r"Note \[([^\]]+)\](?:\s+in\s+``?([\w/.]+\.py)``?)?")


def _sources() -> dict[Path, str]:
    return {path: path.read_text() for path in sorted((REPO / "tba").rglob("*.py"))}


def test_every_referenced_note_is_defined_where_it_is_said_to_be():
    sources = _sources()
    defined = {title: path for path, text in sources.items() for title in DEFINITION.findall(text)}
    problems = []
    for path, text in sources.items():
        flat = re.sub(r"\s*\n\s*(#\s*)?", " ", text)  # references wrap across lines and comments
        for title, named in REFERENCE.findall(flat):
            where = f"{path.relative_to(REPO)}: Note [{title}]"
            if title not in defined:
                problems.append(f"{where} is not defined anywhere")
            elif named and (REPO / named) != defined[title]:
                problems.append(f"{where} points to {named}, but it is in {defined[title].relative_to(REPO)}")
    assert problems == []
