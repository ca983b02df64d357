"""``tools/deepspeed_aio.py``: the precompiled header's command and when it is reused (Note [One precompiled torch header for
the op's twelve files]); the build itself runs in CI (``make deepspeed-aio``) and is checked by the NVMe test."""

from __future__ import annotations

import pathlib
import shlex
import sys

import pytest
import torch
from utils import load_script

SCRIPT = load_script(pathlib.Path(__file__).resolve().parents[1] / "tools" / "deepspeed_aio.py")


def ninja_text(name: str, includes: str, extra: str = "") -> str:
    return (f"ninja_required_version = 1.3\ncxx = c++\n\ncflags = -DTORCH_EXTENSION_NAME={name} "
            f"-DTORCH_API_INCLUDE_EXTENSION_H {includes} -isystem /t/include -fPIC -std=c++20 -O0 -fopenmp "
            f"-include /x/async_io_pch/torch_extension.h {extra}-UC10_USE_GLOG\npost_cflags = \n")


def test_both_ops_precompile_the_same_command_without_their_name_includes_or_the_header_itself():
    aio = SCRIPT.pch_command(ninja_text("async_io", "-I/d/py_lib -I/d/common -I /d/pin"), "/x/h.h", "/x/h.h.gch")
    pin = SCRIPT.pch_command(ninja_text("pin_memory", "-I/d/pin"), "/x/h.h", "/x/h.h.gch")
    assert aio == pin == shlex.split("c++ -x c++-header -DTORCH_API_INCLUDE_EXTENSION_H -isystem /t/include -fPIC "
                                     "-std=c++20 -O0 -fopenmp -UC10_USE_GLOG /x/h.h -o /x/h.h.gch")
    other = SCRIPT.pch_command(ninja_text("pin_memory", "-I/d/pin", "-march=native "), "/x/h.h", "/x/h.h.gch")
    assert "-march=native" in other and other != aio


def test_a_failed_precompile_leaves_nothing_and_a_built_one_serves_until_flags_or_torch_change(tmp_path, monkeypatch, capsys):
    header = tmp_path / "torch_extension.h"
    SCRIPT.write_header(str(header))
    (tmp_path / "build.ninja").write_text(ninja_text("async_io", "-I/d"))
    calls = []

    def fake_compiler(command, **kwargs):
        calls.append(command)
        if fail:
            (tmp_path / "torch_extension.h.gch.tmp").write_bytes(b"partial")
            raise SCRIPT.subprocess.CalledProcessError(1, command, stderr="c++: fatal error: out of memory")
        pathlib.Path(command[-1]).write_bytes(b"pch")

    monkeypatch.setattr(SCRIPT.subprocess, "run", fake_compiler)
    fail = True
    SCRIPT.build_pch(str(tmp_path), str(header))
    assert "out of memory" in capsys.readouterr().err
    assert sorted(path.name for path in tmp_path.iterdir()) == ["build.ninja", "torch_extension.h"]
    fail = False
    SCRIPT.build_pch(str(tmp_path), str(header))
    SCRIPT.build_pch(str(tmp_path), str(header))  # the same command: not built again
    assert len(calls) == 2 and (tmp_path / "torch_extension.h.gch").read_bytes() == b"pch"
    mtime = header.stat().st_mtime_ns
    SCRIPT.write_header(str(header))  # ninja's dependency: never rewritten
    assert header.stat().st_mtime_ns == mtime and header.read_text() == SCRIPT.PCH_HEADER_TEXT
    (tmp_path / "build.ninja").write_text(ninja_text("async_io", "-I/d", "-march=native "))
    SCRIPT.build_pch(str(tmp_path), str(header))  # other flags: built again
    assert len(calls) == 3
    monkeypatch.setattr(torch, "__version__", torch.__version__ + ".other")
    SCRIPT.build_pch(str(tmp_path), str(header))  # another torch, the same flags: built again
    assert len(calls) == 4



@pytest.mark.parametrize("argv, status", [(["--help"], 0), (["--bogus"], 2)])
def test_help_and_unknown_options_build_nothing(argv, status, monkeypatch, capsys):
    # --help started the build of several minutes; killed, it left torch's lock file for the next build to wait on.
    monkeypatch.setitem(sys.modules, "deepspeed.ops.op_builder", None)  # an import would mean a build was starting
    with pytest.raises(SystemExit) as exit_:
        SCRIPT.main(argv)
    assert exit_.value.code == status
    out, err = capsys.readouterr()
    assert ("usage: tools/deepspeed_aio.py" in out) if status == 0 else ("unrecognized arguments: --bogus" in err)


def test_files_that_include_no_torch_header_compile_without_it(tmp_path):
    """Note [Files without torch compile without its header]: a file reaching torch through a quoted header keeps the
    ``-include``; one that never does gets ``cflags`` of its own without it; a second pass changes nothing."""
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "uses.h").write_text('#pragma once\n#include "deeper.h"\n')
    (tmp_path / "lib" / "deeper.h").write_text("#include <torch/extension.h>\n")
    (tmp_path / "lib" / "plain.h").write_text("#include <cmath>\n#include \"plain.h\"\n")  # a cycle ends
    (tmp_path / "a.cpp").write_text('#include "uses.h"\n')
    (tmp_path / "b.cpp").write_text('  #  include "plain.h"\n#include <vector>\n')
    (tmp_path / "c.cpp").write_text("#include <pybind11/pybind11.h>\n")
    header = "/x/async_io_pch/torch_extension.h"
    ninja = (ninja_text("async_io", f"-I /elsewhere -I {tmp_path / 'lib'}")
             + "\nrule compile\n  command = $cxx $cflags -c $in -o $out\n\n"
             + "".join(f"build {name}.o: compile {tmp_path / name}.cpp\n" for name in "abc") + "\nbuild t.so: link a.o\n")
    edited = SCRIPT.without_header_for_torch_free_files(ninja, header)
    lines = edited.splitlines()
    own = [(lines[i - 1], line) for i, line in enumerate(lines) if line.startswith("  cflags = ")]
    assert [edge for edge, _ in own] == [f"build b.o: compile {tmp_path / 'b'}.cpp"]
    top = next(line for line in lines if line.startswith("cflags = "))
    assert own[0][1] == "  " + top.replace(f" -include {header}", "") and f"-include {header}" in top
    assert SCRIPT.without_header_for_torch_free_files(edited, header) == edited
