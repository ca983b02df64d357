"""tba.allocator and the runtime's use of it: which malloc serves a process (each library installable
here, preloaded into a fresh process), finding and preloading one, and the glibc warning (once per
process) with pages handed back only under glibc."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tba import allocator
from tba.errors import TbaConfigError
from tba.runtime import _trim

FOUND = {name: allocator.find_library(name) for name in allocator.CACHING}


def _run(code: str, choice: str) -> subprocess.CompletedProcess:
    env, _ = allocator.launch_env(choice)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=120)


def _run_under_installed(code: str, name: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh process with caching allocator ``name`` preloaded (skips where not installed)."""
    if FOUND[name] is None:
        pytest.skip(f"{name} is not installed here ({allocator.INSTALL_HINTS[name]})")
    proc = _run(code, name)
    assert proc.returncode == 0, proc.stderr
    return proc


DETECT = """
    import json
    from tba.allocator import detect
    a = detect()
    print(json.dumps({"name": a.name, "path": a.path, "version": a.version, "caching": a.caching}))
"""


@pytest.mark.parametrize("name", allocator.CACHING)
def test_a_preloaded_library_is_detected(name):
    proc = _run_under_installed(DETECT, name)
    found = json.loads(proc.stdout)
    assert found["name"] == name and found["caching"]
    assert os.path.realpath(found["path"]) == os.path.realpath(FOUND[name])
    assert found["version"] and found["version"][0].isdigit()


def test_the_c_library_malloc_is_detected_without_a_preload():
    proc = _run(DETECT, "system")
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout)
    assert not found["caching"] and found["path"] is None
    if found["name"] == "glibc":
        assert found["version"][0].isdigit()


def test_system_removes_a_known_allocator_from_ld_preload_and_keeps_the_rest():
    env, description = allocator.launch_env("system", {"LD_PRELOAD": "/x/libjemalloc.so.2 /y/libother.so", "A": "1"})
    assert env["LD_PRELOAD"] == "/y/libother.so" and env["A"] == "1"
    assert description.startswith("system")
    env, _ = allocator.launch_env("system", {"LD_PRELOAD": "/x/libtcmalloc_minimal.so.4"})
    assert "LD_PRELOAD" not in env


def test_a_preload_goes_first_and_user_settings_win(monkeypatch):
    monkeypatch.setattr(allocator, "find_library", lambda name: f"/lib/lib{name}.so.2")
    monkeypatch.setitem(allocator.SETTINGS, "jemalloc", {"MALLOC_CONF": "background_thread:true"})
    env, description = allocator.launch_env("jemalloc", {})
    assert env["MALLOC_CONF"] == "background_thread:true" and "MALLOC_CONF=background_thread:true" in description
    env, description = allocator.launch_env("jemalloc", {"LD_PRELOAD": "/y/libother.so", "MALLOC_CONF": "narenas:1"})
    assert env["LD_PRELOAD"] == "/lib/libjemalloc.so.2 /y/libother.so"
    assert env["MALLOC_CONF"] == "narenas:1" and "MALLOC_CONF=narenas:1" in description


def test_auto_takes_the_first_found_in_order_else_system(monkeypatch):
    monkeypatch.setattr(allocator, "find_library", lambda name: "/lib/libmimalloc.so.3" if name == "mimalloc" else None)
    assert allocator.resolve("auto") == ("mimalloc", "/lib/libmimalloc.so.3")
    monkeypatch.setattr(allocator, "find_library", lambda name: None)
    assert allocator.resolve("auto") == ("system", None)


def test_a_named_allocator_that_is_missing_names_how_to_install_it(monkeypatch):
    monkeypatch.setattr(allocator, "find_library", lambda name: None)
    with pytest.raises(TbaConfigError, match="apt-get install libjemalloc2"):
        allocator.resolve("jemalloc")
    with pytest.raises(TbaConfigError, match="choose one of"):
        allocator.resolve("hoard")


OFFLOAD_TWICE = """
    import logging, sys, tempfile
    import torch, tba
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(message)s")
    x = torch.randn(64, 256, requires_grad=True)
    for _ in range(2):
        with tba.offload_activations(directory=tempfile.gettempdir()) as ctx:
            y = (x * 2).sin().sum()
        y.backward()
    print("ALLOCATOR", ctx.stats.allocator)
"""


def test_under_glibc_one_warning_per_process_names_the_fix():
    proc = _run(OFFLOAD_TWICE, "system")
    assert proc.returncode == 0, proc.stderr
    name = proc.stdout.split("ALLOCATOR")[-1].strip()
    if name != "glibc":
        pytest.skip(f"this C library's malloc is {name}, not glibc")
    assert proc.stderr.count("glibc's malloc") == 1, proc.stderr
    assert "python -m tba run" in proc.stderr


@pytest.mark.parametrize("name", allocator.CACHING)
def test_under_a_caching_allocator_nothing_is_said_and_stats_name_it(name):
    proc = _run_under_installed(OFFLOAD_TWICE, name)
    assert proc.stdout.split("ALLOCATOR")[-1].strip() == name
    assert "glibc's malloc" not in proc.stderr


def test_pages_are_handed_back_only_when_the_allocator_is_not_a_caching_one(monkeypatch):
    import torch

    data = torch.ones(8 * 4096, dtype=torch.uint8)
    monkeypatch.setattr(_trim, "_hand_back", False)
    assert _trim.discard_pages(data.data_ptr(), data.numel()) == 0
    assert bool(data.all())
    trimmer = _trim.HeapTrimmer(every_bytes=1)
    trimmer.note_released(10)
    assert trimmer._thread is None
    monkeypatch.setattr(_trim, "_hand_back", True)
    if _trim._madvise is not None:
        assert _trim.discard_pages(data.data_ptr(), data.numel()) >= 7 * 4096


def test_hands_back_pages_follows_the_detected_allocator(monkeypatch):
    monkeypatch.setattr(_trim, "_hand_back", None)
    monkeypatch.setattr(_trim, "detect", lambda: allocator.Allocator("jemalloc", "/lib/libjemalloc.so.2"))
    assert not _trim.hands_back_pages()
    monkeypatch.setattr(_trim, "_hand_back", None)
    monkeypatch.setattr(_trim, "detect", lambda: allocator.Allocator("glibc", None, "2.36"))
    assert _trim.hands_back_pages()


REEXEC = """
    import sys
    from tba import allocator
    if sys.argv[1] == "refused":
        allocator.find_library = lambda name: "/nonexistent/libjemalloc.so.2"
    try:
        print("SERVED", allocator.run_script_under(sys.argv[2]).name, sys.argv[3:])
    except allocator.TbaConfigError as err:
        print("ERROR", err)
"""


@pytest.mark.parametrize("name", ["jemalloc", "system"])
def test_a_script_runs_itself_again_under_the_allocator_once(name, tmp_path):
    if name != "system" and FOUND[name] is None:
        pytest.skip(f"{name} is not installed here")
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(REEXEC))
    env, _ = allocator.launch_env("system" if name != "system" else "jemalloc" if FOUND["jemalloc"] else "system")
    proc = subprocess.run([sys.executable, str(script), "ok", name, "a b"], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("SERVED")
    served = proc.stdout.split()[1]
    assert allocator.serves(allocator.Allocator(served), name)
    assert "['a b']" in proc.stdout


def test_a_preload_the_loader_refuses_is_an_error_not_a_loop(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(REEXEC))
    env, _ = allocator.launch_env("system")
    proc = subprocess.run([sys.executable, str(script), "refused", "jemalloc"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("ERROR") and "refused the preload" in proc.stdout


NON_PIE_PYTHON = "/usr/bin/python3"
DETECT_WITHOUT_TORCH = f"""
    import sys, types
    package = types.ModuleType("tba")
    package.__path__ = [{os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tba")!r}]
    sys.modules["tba"] = package  # tba.allocator alone: this Python has no torch
    from tba.allocator import detect
    print(detect().name)
"""


def _non_pie(path: str) -> bool:
    with open(path, "rb") as file:
        header = file.read(18)
    return header[:4] == b"\x7fELF" and int.from_bytes(header[16:18], "little") == 2  # ET_EXEC


@pytest.mark.parametrize("preload", [None, "jemalloc", "tcmalloc"])
def test_glibc_is_detected_under_a_non_pie_python(preload):
    # Note [A non-PIE executable's malloc is a PLT entry] in tba/_elf.py: such a Python (Debian's, the
    # H200 image's) was reported as "malloc: python3", and tba handed no pages back under its glibc.
    if not os.path.exists(NON_PIE_PYTHON) or not _non_pie(os.path.realpath(NON_PIE_PYTHON)):
        pytest.skip(f"{NON_PIE_PYTHON} is not a non-PIE executable here")
    env = dict(os.environ)
    if preload is not None:
        if FOUND[preload] is None:
            pytest.skip(f"{preload} is not installed here")
        env["LD_PRELOAD"] = FOUND[preload]
    else:
        env.pop("LD_PRELOAD", None)
    proc = subprocess.run([NON_PIE_PYTHON, "-c", textwrap.dedent(DETECT_WITHOUT_TORCH)], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == (preload or "glibc")


def test_imports_symbol_reads_the_dynamic_symbols(tmp_path):
    from tba import _elf

    source = tmp_path / "m.c"
    source.write_text("#include <stdlib.h>\nint main(void) { return malloc(8) == 0; }\n"
                      "void *my_own(unsigned long n) { return 0; }\n")
    program = tmp_path / "m"
    try:
        built = subprocess.run(["cc", "-no-pie", "-rdynamic", "-o", str(program), str(source)], capture_output=True,
                               timeout=60)
    except FileNotFoundError:
        pytest.skip("no C compiler")
    assert built.returncode == 0, built.stderr
    assert _elf.imports_symbol(str(program), "malloc") is True
    assert _elf.imports_symbol(str(program), "my_own") is False  # defined, exported by -rdynamic
    assert _elf.imports_symbol(str(program), "no_such_symbol") is False
    assert _elf.imports_symbol(str(source), "malloc") is None
