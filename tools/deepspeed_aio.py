"""Build DeepSpeed's ``async_io`` op for ``tests/integrations/test_deepspeed_nvme.py``, without debug info and
with torch's header precompiled once.

``make deepspeed-aio`` (which CI runs) calls this script. DeepSpeed's builder compiles its twelve
C++ files at ``-O0`` (the op is bound by I/O) but with ``-g``, and every file includes
``torch/extension.h``: parsing that header is most of each file's time. Two changes, measured on
the 2-core VM, one file (``deepspeed_py_aio.cpp``):

* ``-g`` is dropped: torch's templates' debug information made each file take about 48 s of one
  core against 34 s without it.
* ``torch/extension.h`` is parsed once, into a precompiled header (Note [One precompiled torch
  header for the op's twelve files]): 41 s of one core per file without it, 16 s with it, after
  65 s for the header itself.
* The files that include no torch header are compiled without it (Note [Files without torch
  compile without its header]): 0.5-0.9 s each instead of about 9.5 s.

Note: [The NVMe test loads the op built with these flags]
torch's JIT loader keys a built extension by its sources and flags: an op built with other flags
than the loading process asks for is rebuilt, under a new name, at load time. So the test patches
DeepSpeed's builder with the same function (:func:`patch_flags`) before DeepSpeed loads the op; a
test run that did not would rebuild it, slowly, and still pass.

Note: [One precompiled torch header for the op's twelve files]
Each file is compiled with ``-include <build root>/async_io_pch/torch_extension.h``, a header
that includes ``torch/extension.h``. GCC looks for ``torch_extension.h.gch`` beside it and uses
it when it was made with the same options; otherwise (missing, or other options) it reads the
header as text, which is correct and only slower. So the ``.gch`` is built from the very
compiler and ``cflags`` line of the op's ``build.ninja``, just before ninja runs, written under
a temporary name and renamed, so that a killed build never leaves a truncated one; a failed
build of it is reported and the op is built without it. It is rebuilt when its command or torch's
version changes (GCC checks the options, not whether the headers it holds changed since). The header
file is written only when missing: ninja's dependency files name it, and a new modification time
would rebuild every file. DeepSpeed builds its ``pin_memory`` op first, and GCC refuses a header
made under another ``-DTORCH_EXTENSION_NAME`` ("not used because `TORCH_EXTENSION_NAME' defined as
pin_memory not async_io") but takes one made without it: so the header is made without the op's
name and its own ``-I`` directories, and ``pin_memory`` is compiled with ``async_io``'s flags, one
header for both ops.

Note: [Files without torch compile without its header]
``-include`` puts torch's header in front of every file, and GCC then instantiates the templates
that header left pending (most of a file's time with the precompiled header, about 8 of 12 s) even
in a file that never uses torch: four of the fifteen (DeepSpeed's ``aio/common`` and
``page_alloc.cpp``) took about 9.5 s each with it and 0.5-0.9 s without. Torch writes one ``cflags``
for all files, so :func:`build_hook` rewrites ``build.ninja`` before ninja runs: the compile edge
of each file that includes no torch, pybind11 or Python header, directly or through the headers it
includes in quotes, gets its own ``cflags`` without the ``-include``. The NVMe test runs ninja
through the same hook: ninja rebuilds a file whose command changed, so the test would otherwise
recompile those four with the header.

Usage: ``python tools/deepspeed_aio.py`` (exit status 1, naming the fix, when libaio is missing).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
from typing import Any

DEBUG_INFO_FLAG = "-g"
PCH_HEADER_NAME = "torch_extension.h"
PCH_HEADER_TEXT = "#include <torch/extension.h>\n"
OP_NAME = "async_io"
TORCH_HEADER_PREFIXES = ("torch/", "ATen/", "c10/", "pybind11/", "Python.h")
"""Angle-bracket includes that make a file need the precompiled torch header."""
INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]', re.MULTILINE)


def pch_header_path() -> str:
    """Where the header that ``-include`` names lives: beside the op's build directory, in torch's extension root."""
    from torch.utils.cpp_extension import _get_build_directory

    root = os.path.dirname(_get_build_directory(OP_NAME, verbose=False))
    return os.path.join(root, f"{OP_NAME}_pch", PCH_HEADER_NAME)


def patch_flags(aio_class: Any, pin_class: Any) -> None:
    """Patch DeepSpeed's ``AsyncIOBuilder`` (``aio_class``) to compile without ``-g`` and with the precompiled
    header's ``-include``, and its ``PinMemoryBuilder`` (``pin_class``, the op it builds first) to compile with
    the same flags, so that one precompiled header serves both. Calling it twice patches once; a caller restores
    both classes' ``cxx_args``."""
    original = aio_class.cxx_args
    if getattr(original, "_tba_patched", False):
        return
    header = pch_header_path()

    def cxx_args(self: Any) -> list[str]:
        return [flag for flag in original(self) if flag != DEBUG_INFO_FLAG] + ["-include", header]

    def pin_cxx_args(self: Any) -> list[str]:
        return cxx_args(aio_class())

    for function in (cxx_args, pin_cxx_args):
        function._tba_patched = True  # type: ignore[attr-defined]
    aio_class.cxx_args = cxx_args
    pin_class.cxx_args = pin_cxx_args


def pch_command(build_ninja: str, header: str, output: str) -> list[str]:
    """The command that precompiles ``header`` into ``output`` with the compiler and ``cflags`` of ``build_ninja``,
    less what differs between the two ops and does not touch torch's header: the op's name, its own ``-I``
    directories (torch's are ``-isystem``), and the ``-include`` of the header itself."""
    values = {}
    for line in build_ninja.splitlines():
        key, sep, value = line.partition(" = ")
        if sep and key in ("cxx", "cflags"):
            values[key] = value
    kept = []
    skip = False
    for flag in shlex.split(values["cflags"]):
        if skip:
            skip = False
        elif flag in ("-include", "-I"):
            skip = True
        elif not flag.startswith(("-DTORCH_EXTENSION_NAME=", "-I")):
            kept.append(flag)
    return [*shlex.split(values.get("cxx", "c++")), "-x", "c++-header", *kept, header, "-o", output]


def build_pch(build_directory: str, header: str) -> None:
    """Precompile ``header`` for the op in ``build_directory`` (Note [One precompiled torch header for the op's twelve
    files]); on failure, say so and leave no ``.gch``."""
    with open(os.path.join(build_directory, "build.ninja")) as ninja:
        command = pch_command(ninja.read(), header, header + ".gch.tmp")
    import torch

    signature = f"{shlex.join(command)}\ntorch {torch.__version__}\n"
    if os.path.exists(header + ".gch") and _read(header + ".cmd") == signature:
        return
    try:
        subprocess.run(command, check=True, capture_output=True, text=True)
    except (OSError, subprocess.CalledProcessError) as err:
        detail = getattr(err, "stderr", "") or str(err)
        print(f"deepspeed_aio: the precompiled header did not build; the op builds without it:\n{detail[-2000:]}",
              file=sys.stderr)
        for path in (header + ".gch.tmp", header + ".gch"):
            if os.path.exists(path):
                os.remove(path)
        return
    os.replace(header + ".gch.tmp", header + ".gch")
    with open(header + ".cmd", "w") as out:
        out.write(signature)


def _read(path: str) -> str | None:
    try:
        with open(path) as file:
            return file.read()
    except OSError:
        return None


def includes_torch(source: str, include_dirs: list[str], seen: set[str] | None = None) -> bool:
    """Whether ``source``, or a header it includes in quotes (found beside it or in ``include_dirs``), includes a
    torch, pybind11 or Python header (Note [Files without torch compile without its header])."""
    seen = set() if seen is None else seen
    seen.add(source)
    with open(source, errors="replace") as file:
        text = file.read()
    for bracket, name in INCLUDE.findall(text):
        if bracket == "<":
            if name.startswith(TORCH_HEADER_PREFIXES):
                return True
            continue
        for directory in (os.path.dirname(source), *include_dirs):
            path = os.path.normpath(os.path.join(directory, name))
            if os.path.isfile(path):
                if path not in seen and includes_torch(path, include_dirs, seen):
                    return True
                break
    return False


def without_header_for_torch_free_files(build_ninja: str, header: str) -> str:
    """``build_ninja`` with its own ``cflags``, less ``-include header``, on each compile edge of a file that includes
    no torch header (Note [Files without torch compile without its header]); unchanged where done already."""
    lines = build_ninja.splitlines()
    cflags = next((line.partition(" = ")[2] for line in lines if line.startswith("cflags = ")), None)
    if cflags is None or f"-include {header}" not in cflags:
        return build_ninja
    flags = shlex.split(cflags)
    include_dirs = [flag[2:] or following for flag, following in zip(flags, [*flags[1:], ""]) if flag.startswith("-I")]
    plain = cflags.replace(f" -include {header}", "")
    out = []
    for index, line in enumerate(lines):
        out.append(line)
        edge = re.match(r"build \S+\.o: compile (\S+)$", line)
        following = lines[index + 1] if index + 1 < len(lines) else ""
        if edge and not following.startswith("  cflags = ") and not includes_torch(edge.group(1), include_dirs):
            out.append(f"  cflags = {plain}")
    return "\n".join(out) + "\n"


def build_hook(header: str, run_ninja: Any) -> Any:
    """``run_ninja`` (torch's ``_run_ninja_build``) after precompiling ``header`` (unless done already) and giving
    torch-free files their own ``cflags`` (Notes [One precompiled torch header for the op's twelve files], [Files
    without torch compile without its header])."""

    def run_ninja_after_pch(build_directory: str, verbose: bool, error_prefix: str) -> None:
        build_pch(build_directory, header)
        path = os.path.join(build_directory, "build.ninja")
        with open(path) as ninja:
            text = ninja.read()
        edited = without_header_for_torch_free_files(text, header)
        if edited != text:
            with open(path + ".tmp", "w") as ninja:
                ninja.write(edited)
            os.replace(path + ".tmp", path)
        run_ninja(build_directory, verbose, error_prefix)

    return run_ninja_after_pch


def write_header(header: str) -> None:
    """Write the header ``-include`` names, unless it is there already (its modification time is a dependency)."""
    os.makedirs(os.path.dirname(header), exist_ok=True)
    if not os.path.exists(header):
        with open(header, "w") as out:
            out.write(PCH_HEADER_TEXT)


def main(argv: list[str] | None = None) -> int:
    # It takes no options, but --help (or a typo) must not start a build of several minutes that, killed,
    # leaves torch's build lock behind for the next one to wait on for ever (the Makefile clears it; a user does not).
    argparse.ArgumentParser(prog="tools/deepspeed_aio.py", description=__doc__.split("\n\n")[0],
                            epilog="Usage: python tools/deepspeed_aio.py (make deepspeed-aio runs it)").parse_args(argv)
    import torch.utils.cpp_extension as cpp_extension
    from deepspeed.ops.op_builder import AsyncIOBuilder, PinMemoryBuilder

    patch_flags(AsyncIOBuilder, PinMemoryBuilder)
    builder = AsyncIOBuilder()
    if not builder.is_compatible(False):
        print("deepspeed_aio: libaio is missing: apt-get install libaio-dev", file=sys.stderr)
        return 1
    header = pch_header_path()
    write_header(header)
    run_ninja = cpp_extension._run_ninja_build
    cpp_extension._run_ninja_build = build_hook(header, run_ninja)
    try:
        builder.load(verbose=False)
    finally:
        cpp_extension._run_ninja_build = run_ninja
    return 0


if __name__ == "__main__":
    sys.exit(main())
