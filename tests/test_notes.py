"""Named Notes: every ``Note [Title]`` a docstring or comment points to exists, in the file it names."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFINITION = re.compile(r"Note: \[([^\]]+)\]")
REFERENCE = re.compile(r"Note \[([^\]]+)\](?:\s+in\s+`{0,2}([\w/.]+\.(?:py|c|h))`{0,2})?")
DEFINERS = (".py", ".c", ".h")
"""Where Notes are defined: Python modules and the native sources (whose comments wrap with `` * ``)."""


def _readers() -> dict[Path, str]:
    """Where Notes are pointed to from: tba's code, its native sources, its tests, its tools and its documents
    (not this file, whose messages hold placeholders)."""
    paths = [*(REPO / "tba").rglob("*.py"), *(REPO / "tests").rglob("*.py"), *(REPO / "tools").rglob("*.py"),
             *(REPO / "native").glob("*.[ch]"), *(REPO / "docs").glob("*.md"), REPO / "README.md"]
    return {path: path.read_text() for path in sorted(paths) if path != Path(__file__).resolve()}


def test_every_referenced_note_is_defined_where_it_is_said_to_be():
    readers = _readers()
    defined = {title: path for path, text in readers.items() if path.suffix in DEFINERS
               for title in DEFINITION.findall(text)}
    problems = []
    for path, text in readers.items():
        flat = re.sub(r"\s*\n\s*(#\s*|\*\s+)?", " ", text)  # references wrap across lines and comments
        for title, named in REFERENCE.findall(flat):
            where = f"{path.relative_to(REPO)}: Note [{title}]"
            if title not in defined:
                problems.append(f"{where} is not defined anywhere")
            elif named and defined[title] not in (REPO / named, path.parent / named):  # or beside the reader
                problems.append(f"{where} points to {named}, but it is in {defined[title].relative_to(REPO)}")
    assert problems == []
