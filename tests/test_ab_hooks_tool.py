"""tools/ab_hooks.py: what it refuses before any work, the order of its rounds, its summary, and the origin check."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest
from utils import load_script

TOOLS = pathlib.Path(__file__).resolve().parents[1] / "tools"


@pytest.fixture
def ab():
    return load_script(TOOLS / "ab_hooks.py")


def worktrees() -> str:
    return subprocess.run(["git", "-C", str(TOOLS.parent), "worktree", "list"], capture_output=True, text=True).stdout


@pytest.mark.parametrize("argv, match", [
    (["HEAD", "HEAD", "--rounds", "0"], "--rounds must be at least 1, got 0"),
    (["HEAD", "no-such-revision-xyz"], "B: 'no-such-revision-xyz' is neither a directory nor a revision"),
    (["HEAD", "HEAD", "--", "--json", "x.json"], "pass --json before --"),
    (["HEAD", "HEAD", "--json", "/proc/none/x.json"], "--json /proc/none/x.json: its directory is not writable"),
])
def test_bad_values_are_refused_before_any_work(ab, argv, match, capsys):
    before = worktrees()
    with pytest.raises(SystemExit) as exit_:
        ab.main(argv)
    assert exit_.value.code == 2
    assert match in capsys.readouterr().err.strip().splitlines()[-1]
    assert worktrees() == before


def _row(count: int, forward: float, backward: float) -> dict:
    return {"count": count, "size_bytes": 65536, "label": "ram", "path": "offload",
            "extra_forward_us": forward, "extra_backward_us": backward}


def test_rounds_alternate_the_order_of_the_sides(ab):
    calls = []

    def runner(path, options):
        calls.append(path.name)
        return [_row(400, 1.0, 2.0)]

    results = ab.compare([pathlib.Path("/a"), pathlib.Path("/b")], ["A", "B"], 3, ["--x"], runner=runner)
    assert calls == ["a", "b", "b", "a", "a", "b"]
    assert [len(rounds) for rounds in results.values()] == [3, 3]


def test_the_summary_gives_each_round_the_medians_and_the_difference(ab):
    rounds = {"A": [[_row(400, 50.0, 60.0)], [_row(400, 70.0, 40.0)], [_row(400, 60.0, 50.0)]],
              "B": [[_row(400, 40.0, 45.0)], [_row(400, 30.0, 55.0)], [_row(400, 35.0, 50.0)]]}
    lines = ab.summarise(rounds)
    assert lines[0] == "400 x 64 KiB ram offload"
    assert lines[1] == "  A: 50.0 / 60.0, 70.0 / 40.0, 60.0 / 50.0; median 60.0 / 50.0"
    assert lines[2] == "  B: 40.0 / 45.0, 30.0 / 55.0, 35.0 / 50.0; median 35.0 / 50.0"
    assert lines[3] == "  B less A: -25.0 / +0.0 us per storage"


def test_a_row_one_side_lacks_is_named(ab):
    lines = ab.summarise({"A": [[_row(400, 1.0, 1.0), _row(2000, 1.0, 1.0)]], "B": [[_row(400, 1.0, 1.0)]]})
    assert "  B: no row" in lines and not any("less" in line for line in lines[lines.index("2000 x 64 KiB ram offload"):])


def test_a_module_loaded_from_another_checkout_is_refused(ab, tmp_path):
    side = tmp_path / "side"
    side.mkdir()
    ab.check_origin(side, {"tba": str(side / "tba" / "__init__.py"), "tba._gc": None})
    with pytest.raises(SystemExit, match=r"tba\._uring loads from /elsewhere/tba/_uring\.so"):
        ab.check_origin(side, {"tba": str(side / "tba" / "__init__.py"), "tba._uring": "/elsewhere/tba/_uring.so"})


def test_an_interrupt_while_a_worktree_is_added_leaves_no_worktree(ab, monkeypatch):
    """Interrupted during ``git worktree add`` (SIGINT to the tool alone), the half-added worktree was not yet
    recorded, so it was never removed: ``git worktree list`` kept a stale entry."""
    before = worktrees()
    real = subprocess.run

    def run(cmd, *args, **kwargs):
        done = real(cmd, *args, **kwargs)
        if "add" in cmd:
            raise KeyboardInterrupt  # as SIGINT arrives just as the add ends
        return done

    monkeypatch.setattr(ab.subprocess, "run", run)
    with pytest.raises(KeyboardInterrupt), ab.checkouts(["HEAD"]):
        pass
    monkeypatch.undo()
    assert worktrees() == before


def test_sigterm_removes_the_worktrees(tmp_path):
    """SIGTERM (``timeout``, a CI runner's cancel) ended the tool without its cleanup: both worktrees stayed, in /tmp
    and in ``git worktree list``."""
    before = worktrees()
    script = (
        "import os, signal, sys; sys.path.insert(0, 'tests'); from utils import load_script; import pathlib\n"
        "ab = load_script(pathlib.Path('tools/ab_hooks.py'))\n"
        "ab.prepare = lambda path: os.kill(os.getpid(), signal.SIGTERM)\n"
        "sys.exit(ab.main(['HEAD', 'HEAD']))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=TOOLS.parent, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert worktrees() == before


def test_a_side_without_an_extension_loads_none_from_the_installed_checkout(ab, tmp_path):
    """A side without ``tba._record`` (an older revision) loaded the installed checkout's through the finder an
    editable install puts in this environment; its Python now starts with ``-S`` (``PYTHON``)."""
    import json
    import shutil

    side = tmp_path / "side"
    shutil.copytree(TOOLS.parent / "tba", side / "tba", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    probe = subprocess.run([*ab.PYTHON, "-c", ab._origin_check()], cwd=side, env=ab._environment(side),
                           capture_output=True, text=True, check=True)
    origins = json.loads(probe.stdout.strip().splitlines()[-1])
    ab.check_origin(side, origins)
    assert origins["tba._record"] is None
