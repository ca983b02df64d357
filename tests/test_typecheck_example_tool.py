"""tools/typecheck_example.py, the user program that type checkers read (docs/api.md), also runs: what it shows a
checker is the documented API as it works. mypy itself is not run here (not a dependency of the suite)."""

from __future__ import annotations

import pathlib

from utils import load_script

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "tools" / "typecheck_example.py"


def test_the_type_checked_example_runs(tmp_path, capsys):
    load_script(EXAMPLE).main(str(tmp_path))
    out = capsys.readouterr().out
    assert "budget 2147483648 B" in out  # memory_budget="2GiB", held as bytes
    assert "plan SSSS, window 8388608 B" in out  # window_bytes="8MiB", saved and loaded
    assert "durable:" in out
