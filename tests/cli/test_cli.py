"""bench-io and doctor: argument parsing, a tiny benchmark run, the report, the CLI wiring."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from python_runs import run_python

from tba._units import parse_size
from tba.cli import COMMANDS, bench_io, doctor, main

REPO = Path(__file__).resolve().parents[2]


def _args(module, argv):
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return parser.parse_args(argv)


@pytest.mark.parametrize(
    ("text", "nbytes"),
    [("4096", 4096), ("512K", 512 << 10), ("512M", 512 << 20), ("2G", 2 << 30), ("2GiB", 2 << 30), ("1m", 1 << 20)],
)
def test_parse_size(text, nbytes):
    assert parse_size(text) == nbytes


def test_parse_size_rejects_garbage():
    with pytest.raises(argparse.ArgumentTypeError):
        parse_size("lots")


@pytest.mark.parametrize("text", ["1.5", "1.5B", "0.5 B"])
def test_parse_size_rejects_a_fraction_of_a_byte(text):
    with pytest.raises(argparse.ArgumentTypeError, match="whole number of bytes"):
        parse_size(text)


def test_bench_small_json(tmp_path, capsys):
    args = _args(bench_io, ["--size", "8M", "--block-size", "1M", "--queue-depth", "4",
                            "--directory", str(tmp_path), "--no-fio", "--json"])
    assert bench_io.run(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["fio"] is None
    assert report["backends"]["threads"]["write_gbps"] > 0
    assert list(tmp_path.iterdir()) == []


def test_bench_rejects_unaligned_block(tmp_path, capsys):
    args = _args(bench_io, ["--size", "8M", "--block-size", "1000", "--directory", str(tmp_path)])
    with pytest.raises(SystemExit, match="2"):
        bench_io.run(args)
    assert "python -m tba bench-io: error: --block-size must be a positive multiple of 4096" in capsys.readouterr().err


def test_doctor_reports_and_never_fails(tmp_path, capsys):
    assert doctor.run(_args(doctor, ["--directory", str(tmp_path), "--quick-size", "4M"])) == 0
    out = capsys.readouterr().out
    for label in ("io_uring engine", "O_DIRECT in", "kvikio", "CUDA available", "memlock", "bandwidth",
                  "per-storage path in C"):
        assert label in out


def test_commands_registered():
    assert COMMANDS["bench-io"][0] == "tba.cli.bench_io"
    assert COMMANDS["doctor"][0] == "tba.cli.doctor"


def test_bench_io_help():
    done = run_python(["-m", "tba", "bench-io", "--help"], timeout=60)
    assert done.returncode == 0 and "--queue-depth" in done.stdout


@pytest.mark.skipif(not __import__("shutil").which("fio"), reason="fio not installed")
def test_bench_with_fio_cleans_up(tmp_path, capsys):
    args = _args(bench_io, ["--size", "8M", "--queue-depth", "4", "--directory", str(tmp_path)])
    assert bench_io.run(args) == 0
    table = capsys.readouterr().out
    assert "fio" in table and "%" in table
    assert list(tmp_path.iterdir()) == []


def test_doctor_names_the_malloc_and_the_caching_allocators_found(tmp_path, capsys, monkeypatch):
    from tba import allocator

    monkeypatch.setattr(doctor, "find_library", lambda name: "/x/libmimalloc.so.3" if name == "mimalloc" else None)
    assert doctor.run(_args(doctor, ["--directory", str(tmp_path), "--no-bandwidth"])) == 0
    rows = {line.split("  ")[0]: line.split("  ", 1)[1].strip() for line in capsys.readouterr().out.splitlines()}
    serving = allocator.detect()
    assert rows["malloc in this process"].startswith(str(serving))
    assert rows["caching allocators found"] == "mimalloc (/x/libmimalloc.so.3)"
    if serving.name == "glibc":
        assert "python -m tba run" in rows["malloc in this process"]


def test_a_command_imports_its_own_module_only():
    """``python -m tba --help`` lists every command without importing their modules; a command
    imports its own and no other's."""
    import subprocess
    import sys

    code = ("import sys, contextlib, io\nfrom tba.cli import main\n"
            "for argv in ([\"--help\"], [\"doctor\", \"--help\"]):\n"
            "    with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()) as out:\n"
            "        main(argv)\n"
            "    loaded = sorted(m for m in sys.modules if m.startswith('tba.cli.') and not m.startswith('tba.cli._'))\n"
            "    print(argv[0], 'capacity' in out.getvalue(), ','.join(loaded))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    first, second = done.stdout.splitlines()
    assert first == "--help True "  # every command listed, none imported
    assert second == "doctor False tba.cli.doctor"


@pytest.mark.parametrize("conf", ["", "dirty_decay_ms:-1"])
def test_doctor_says_when_jemalloc_hands_freed_pages_back(tmp_path, conf):
    # Note [jemalloc keeps its dirty pages] in tba/allocator.py.
    import os

    from tba import allocator

    path = allocator.find_library("jemalloc")
    if path is None:
        pytest.skip("jemalloc is not installed here")
    env = dict(os.environ, LD_PRELOAD=path, MALLOC_CONF=conf)
    proc = subprocess.run([sys.executable, "-m", "tba", "doctor", "--directory", str(tmp_path), "--no-bandwidth"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    line = next(line for line in proc.stdout.splitlines() if line.startswith("malloc in this process"))
    assert "jemalloc" in line
    assert ("fault in again every step; set MALLOC_CONF=dirty_decay_ms:-1" in line) == (conf == "")
    if allocator.detect().name != "jemalloc":
        assert allocator.jemalloc_dirty_decay_ms() is None


def test_a_terminated_command_removes_its_scratch_directories(tmp_path):
    """Note [A terminated command cleans up] in tba/cli/_signals.py: SIGTERM unwinds every ``with``."""
    import signal
    import time

    command = [sys.executable, "-m", "tba", "bench-hooks", "--sizes", "64K", "--counts", "400", "--no-disk", "--no-keep",
               "--ram-dir", str(tmp_path), "--warmups", "1000", "--allocator", "system"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONFAULTHANDLER": "1"})
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob("tba-bench-hooks-*")):
        assert process.poll() is None, process.stderr.read()
        assert time.monotonic() < deadline, "bench-hooks made no scratch directory in 120 s"
        time.sleep(0.05)
    time.sleep(0.5)  # into its steps
    process.send_signal(signal.SIGTERM)
    try:
        status = process.wait(timeout=60)
    except subprocess.TimeoutExpired:  # once in CI, not reproduced in 40 tries here: keep its threads' stacks
        process.send_signal(signal.SIGABRT)  # faulthandler prints every thread's stack
        process.wait()
        pytest.fail(f"bench-hooks did not end 60 s after SIGTERM; its stacks:\n{process.stderr.read()[-8000:]}")
    assert status == 128 + signal.SIGTERM
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("slow_hook", [False, True], ids=["", "slow-to-leave-the-hook"])
@pytest.mark.parametrize("signame", ["SIGTERM", "SIGINT"])
def test_a_signal_that_lands_in_a_finalizer_still_ends_the_command(signame, slow_hook):
    """Note [A signal a finalizer swallowed is sent again] in tba/cli/_signals.py: bench-ckpt ran to its end, table
    printed, after a SIGTERM whose SystemExit was raised inside a weakref callback ("Exception ignored in ...")."""
    script = (
        "import os, signal, sys, time\n"
        # As an interactive Python has it: a run started in the background of a shell (`cmd &`) inherits SIGINT
        # ignored, and Python then leaves it so (the SIGINT case failed there, 'ran on' printed).
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "from tba import cli\n"
        # The main thread still in the hook when the signal is sent again (as on a loaded CI machine, which
        # printed "Exception ignored in sys.unraisablehook" and 'ran on'): the hook's thread start takes 0.2 s.
        + ("import threading\n"
           "start = threading.Thread.start\n"
           "threading.Thread.start = lambda self: (start(self), time.sleep(0.2))[0]\n" if slow_hook else "") +
        "def command(args):\n"
        "    class Finalized:\n"
        "        def __del__(self):\n"
        f"            os.kill(os.getpid(), signal.{signame})\n"
        "            for _ in range(1000):\n"
        "                pass  # the handler runs here, inside the finalizer\n"
        "    Finalized()\n"
        "    time.sleep(5)\n"
        "    print('ran on')\n"
        "    return 0\n"
        "cli.COMMANDS['doctor'] = ('tba.cli.doctor', 'x')\n"
        "import tba.cli.doctor as module\n"
        "module.run = command\n"
        "sys.exit(cli.main(['doctor'], command_line=True))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert "ran on" not in done.stdout, done.stderr
    assert done.returncode == {"SIGTERM": 143, "SIGINT": -signal.SIGINT}[signame], done.stderr
    assert "Exception ignored" not in done.stderr


@pytest.mark.parametrize("stop", [SystemExit(143), KeyboardInterrupt()], ids=["SIGTERM", "Ctrl-C"])
def test_a_signal_that_a_library_wrapped_still_ends_the_command(monkeypatch, stop):
    """DCP raises a signal's exception again inside its CheckpointException (Note [A signal wrapped by a library still ends
    the command] in tba/cli/_signals.py): the command ends as the signal would have ended it."""
    from torch.distributed.checkpoint.api import CheckpointException

    def run(args):
        try:
            raise stop
        except BaseException as err:
            raise CheckpointException("save", {0: (err, None)}) from None

    monkeypatch.setattr(bench_io, "run", run)
    with pytest.raises(type(stop)) as caught:
        main(["bench-io", "--size", "1M"])
    assert caught.value is stop


@pytest.mark.parametrize("closed", [["stdout"], ["stdout", "stderr"]], ids=["stdout", "both"])
def test_a_reader_gone_ends_the_command_quietly(tmp_path, closed):
    """Note [A reader gone ends the command quietly] in tba/cli/__init__.py: `doctor | head -1` with the reader gone
    ended with status 1 and a BrokenPipeError traceback (or one the closed stderr lost)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    err_path = tmp_path / "stderr.txt"
    try:
        with open(err_path, "w") as err_file:
            done = subprocess.run([sys.executable, "-m", "tba", "doctor", "--no-bandwidth", "--directory", str(tmp_path)],
                                  stdout=write_end, stderr=write_end if "stderr" in closed else err_file, timeout=120)
    finally:
        os.close(write_end)
    assert done.returncode == 128 + signal.SIGPIPE
    assert err_path.read_text() == ""


def test_a_broken_pipe_of_the_command_own_is_an_error(tmp_path):
    """The same note: a BrokenPipeError while stdout and stderr are open (a child's pipe) is raised, not hidden."""
    script = ("import sys, tba.cli.doctor as d\n"
              "def run(args): raise BrokenPipeError(32, 'a child is gone')\n"
              "d.run = run\n"
              "from tba.cli import main\n"
              "sys.exit(main(['doctor'], command_line=True))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "BrokenPipeError: [Errno 32] a child is gone" in done.stderr, done.stderr


@pytest.mark.parametrize("flags, why", [(["--no-fio"], "--no-fio"), ([], "fio is not installed")])
def test_bench_io_says_why_the_fio_columns_are_empty(tmp_path, capsys, monkeypatch, flags, why):
    monkeypatch.setattr(bench_io.shutil, "which", lambda name: None)
    args = _args(bench_io, ["--size", "8M", "--block-size", "1M", "--queue-depth", "4", "--directory", str(tmp_path),
                            *flags])
    assert bench_io.run(args) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("fio not run: ") and why in last, last


def test_bench_io_header_names_a_small_size_readably(tmp_path, caplog, monkeypatch):
    """The first progress line said '0.01 GiB' for --size 8M (and '0.00 GiB' for 4M): every size under 5 MiB read as
    nothing. It now names the size as the table's other size messages do (tba._units.readable_size)."""
    monkeypatch.setattr(bench_io.shutil, "which", lambda name: None)
    args = _args(bench_io, ["--size", "8M", "--block-size", "1M", "--queue-depth", "4", "--directory", str(tmp_path)])
    with caplog.at_level(logging.INFO, logger="tba"):
        assert bench_io.run(args) == 0
    header = next(record.getMessage() for record in caplog.records if " blocks at queue depth " in record.getMessage())
    assert header.startswith("bench-io: 8.0 MiB in 1024 KiB blocks"), header


def test_doctor_says_when_the_quick_size_is_more_than_the_free_space(tmp_path, capsys, monkeypatch):
    """--quick-size beyond the directory's free space read 'not measured (OSError: [Errno 28] No space left on device)'
    (or errno 27 past the file-size limit), naming neither cause nor fix."""
    monkeypatch.setattr("shutil.disk_usage", lambda path: argparse.Namespace(free=3 << 20))
    assert doctor.run(_args(doctor, ["--directory", str(tmp_path), "--quick-size", "8M"])) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("bandwidth"))
    assert row.endswith(f"not measured (--quick-size 8.0 MiB is more than the 3.0 MiB free in {tmp_path}; pass a "
                        "smaller --quick-size)"), row
    assert list(tmp_path.iterdir()) == []


def test_ctrl_c_ends_the_command_in_one_line():
    """Note [Ctrl-C ends the command in one line] in tba/cli/_signals.py: a Ctrl-C printed Python's traceback from
    wherever the main thread was; Python still ends the process by SIGINT after its exit handlers."""
    script = (
        "import atexit, sys\n"
        "from tba import cli\n"
        "atexit.register(lambda: print('exit handlers ran'))\n"
        "def command(args):\n"
        "    raise KeyboardInterrupt\n"
        "cli.COMMANDS['doctor'] = ('tba.cli.doctor', 'x')\n"
        "import tba.cli.doctor as module\n"
        "module.run = command\n"
        "sys.exit(cli.main(['doctor'], command_line=True))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == -signal.SIGINT, done.stderr
    assert done.stderr == "python -m tba doctor: interrupted\n"
    assert done.stdout == "exit handlers ran\n"


def test_an_error_still_prints_its_traceback():
    """The hook of Note [Ctrl-C ends the command in one line] leaves every other error to the hook before it."""
    script = (
        "import sys\n"
        "from tba import cli\n"
        "def command(args):\n"
        "    raise RuntimeError('a failure to report')\n"
        "import tba.cli.doctor as module\n"
        "module.run = command\n"
        "sys.exit(cli.main(['doctor'], command_line=True))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "Traceback" in done.stderr and "RuntimeError: a failure to report" in done.stderr


def test_bench_io_names_a_full_disk_when_it_cannot_reserve_its_file(tmp_path, caplog, monkeypatch):
    """A scratch file whose reservation failed (the disk filled meanwhile) read "cannot open an O_DIRECT file in ...:
    No space left on device", naming the open it did not fail at and no fix (helper-156)."""
    import errno

    def full(directory, size):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(bench_io, "open_scratch", full)
    monkeypatch.setattr(bench_io.shutil, "which", lambda name: None)
    args = _args(bench_io, ["--size", "8M", "--block-size", "1M", "--queue-depth", "4", "--directory", str(tmp_path)])
    with caplog.at_level(logging.INFO, logger="tba"):
        assert bench_io.run(args) == 1
    error = next(record.getMessage() for record in caplog.records if record.levelno == logging.ERROR)
    assert error == (f"bench-io: cannot make a 8.0 MiB O_DIRECT scratch file in {tmp_path} (opened, then reserved): "
                     "[Errno 28] No space left on device; pass a smaller --size or another --directory")


def test_doctor_says_a_directory_tba_cannot_write_is_refused(tmp_path, capsys):
    """A read-only directory was reported as lacking O_DIRECT ('opening a file with O_DIRECT ... failed: Read-only file
    system'), which reads as "tba falls back to buffered I/O there", and its bandwidth as not measured for want of space;
    offloading there is refused (TbaConfigError: not writable)."""
    directory = tmp_path / "ro"
    directory.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=4m", "tmpfs", str(directory)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs: {done.stderr.decode().strip()}")
    try:
        assert doctor.run(_args(doctor, ["--directory", str(directory), "--quick-size", "1M"])) == 0
    finally:
        subprocess.run(["umount", str(directory)], check=False)
    rows = capsys.readouterr().out.splitlines()
    direct = next(line for line in rows if line.startswith("O_DIRECT in"))
    bandwidth = next(line for line in rows if line.startswith("bandwidth"))
    for row in (direct, bandwidth):
        assert f"{directory} is not writable" in row and "--directory" in row, row
