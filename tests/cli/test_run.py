"""python -m tba run: the script or module runs under the allocator asked for, with its own arguments,
output and exit status; a missing allocator or nothing to run is a one-line error with exit status 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tba import allocator
from tba.cli import main

SCRIPT = """\
import json, sys
from tba.allocator import detect
print(json.dumps({"argv": sys.argv[1:], "malloc": detect().name}))
sys.exit(int(sys.argv[1]))
"""


def _tba_run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tba", "run", *argv], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("choice", ["auto", *allocator.CACHING, "system"])
def test_arguments_and_exit_status_pass_through_under_each_allocator(tmp_path, choice):
    if choice in allocator.CACHING and allocator.find_library(choice) is None:
        pytest.skip(f"{choice} is not installed here")
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    proc = _tba_run("--allocator", choice, str(script), "7", "--allocator", "x y", "-m", "")
    assert proc.returncode == 7, proc.stderr
    out = json.loads(proc.stdout)
    assert out["argv"] == ["7", "--allocator", "x y", "-m", ""]
    expected = allocator.resolve(choice)[0]
    if expected == "system":
        assert out["malloc"] not in allocator.CACHING
    else:
        assert out["malloc"] == expected
    said = [line for line in proc.stderr.splitlines() if line.startswith("tba run: malloc")]
    assert len(said) == 1 and said[0].startswith(f"tba run: malloc {expected}")


DECAY_SCRIPT = """\
import ctypes
value, size = ctypes.c_ssize_t(), ctypes.c_size_t(ctypes.sizeof(ctypes.c_ssize_t))
assert ctypes.CDLL(None).mallctl(b"opt.dirty_decay_ms", ctypes.byref(value), ctypes.byref(size), None, 0) == 0
print(value.value)
"""


@pytest.mark.parametrize("user_conf, expected", [(None, -1), ("dirty_decay_ms:5000", 5000)])
def test_jemalloc_keeps_its_dirty_pages_unless_the_user_configured_it(tmp_path, monkeypatch, user_conf, expected):
    # Note [jemalloc keeps its dirty pages] in tba/allocator.py: read back from jemalloc itself.
    if allocator.find_library("jemalloc") is None:
        pytest.skip("jemalloc is not installed here")
    if user_conf is None:
        monkeypatch.delenv("MALLOC_CONF", raising=False)
    else:
        monkeypatch.setenv("MALLOC_CONF", user_conf)
    script = tmp_path / "decay.py"
    script.write_text(DECAY_SCRIPT)
    proc = _tba_run("--allocator", "jemalloc", str(script))
    assert proc.returncode == 0, proc.stderr
    assert int(proc.stdout) == expected
    assert f"MALLOC_CONF={user_conf or 'dirty_decay_ms:-1'}" in proc.stderr


def test_a_module_runs_with_its_arguments(tmp_path):
    (tmp_path / "tba_run_probe.py").write_text(SCRIPT)
    proc = subprocess.run([sys.executable, "-m", "tba", "run", "-m", "tba_run_probe", "3", "--flag"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 3, proc.stderr
    assert json.loads(proc.stdout)["argv"] == ["3", "--flag"]


def test_code_runs_with_its_arguments_under_the_allocator(tmp_path):
    """``run -c`` was refused ('unrecognized arguments: -c'): a one-liner needed a script file."""
    code = "import json, os, sys; print(json.dumps([sys.argv[1:], os.environ.get('LD_PRELOAD', '')])); sys.exit(4)"
    proc = subprocess.run([sys.executable, "-m", "tba", "run", "--allocator", "system", "-c", code, "a", "-m", "b"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 4, proc.stderr
    assert json.loads(proc.stdout)[0] == ["a", "-m", "b"]
    assert "tba run: malloc system" in proc.stderr


def test_an_allocator_that_is_not_installed_is_one_line_and_exit_2(monkeypatch, capsys):
    monkeypatch.setattr(allocator, "find_library", lambda name: None)
    assert main(["run", "--allocator", "tcmalloc", "script.py"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "allocator 'tcmalloc' not found" in err[0] and "libtcmalloc-minimal4" in err[0]


@pytest.mark.parametrize("argv", [["run"], ["run", "-m"], ["run", "-c"], ["run", "--allocator", "system"]])
def test_nothing_to_run_is_one_line_and_exit_2(argv, capsys):
    assert main(argv) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_auto_without_any_caching_allocator_runs_under_the_c_library_and_says_how_to_get_one(monkeypatch, tmp_path):
    monkeypatch.setattr(allocator, "find_library", lambda name: None)
    calls = []
    monkeypatch.setattr("os.execve", lambda path, argv, env: calls.append((argv, env)) or 0)
    script = tmp_path / "s.py"
    assert main(["run", str(script), "a"]) == 0
    (argv, env), = calls
    assert argv[1:] == [str(script), "a"]
    assert not any(name in env.get("LD_PRELOAD", "") for name in allocator.CACHING)


@pytest.mark.parametrize("preload", [None, "/opt/profiler/libprofiler.so"])
def test_auto_without_any_caching_allocator_says_so_whatever_else_is_preloaded(monkeypatch, capsys, tmp_path, preload):
    """A library of the user's own in LD_PRELOAD (a profiler) hid the install hint, and the header said "no preload"."""
    monkeypatch.setattr(allocator, "find_library", lambda name: None)
    if preload is None:
        monkeypatch.delenv("LD_PRELOAD", raising=False)
    else:
        monkeypatch.setenv("LD_PRELOAD", preload)
    calls = []
    monkeypatch.setattr("os.execve", lambda path, argv, env: calls.append(env) or 0)
    assert main(["run", str(tmp_path / "s.py")]) == 0
    err = capsys.readouterr().err
    assert "no caching allocator found" in err
    if preload is not None:
        assert calls[0]["LD_PRELOAD"] == preload and "no preload" not in err and preload in err


def test_nothing_to_run_names_every_form_the_usage_line_does(capsys):
    """'nothing to run' gave only 'script.py [args ...]', though run takes -m module and -c code as its usage line says."""
    assert main(["run", "--allocator", "system"]) == 2
    assert capsys.readouterr().err == ("python -m tba run: error: nothing to run: python -m tba run [--allocator NAME] "
                                       "(script.py | -m module | -c code) [args ...]\n")
