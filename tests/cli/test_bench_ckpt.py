"""The bench-ckpt command: argument checks and one tiny run."""

from __future__ import annotations

import argparse
import json
import logging
import resource
import subprocess
import sys
from types import SimpleNamespace

import pytest

from tba.cli import bench_ckpt, bench_io, main
from tba.cli.bench_ckpt import gpt_config


@pytest.mark.parametrize("argv, message", [
    (["--size", "12X"], "argument --size: not a size"),  # named the flag (helper-143)
    (["--size", "1M"], "at least 16M"),
    (["--rounds", "0"], "argument --rounds: 0 is too small; pass a whole number >= 1"),
    (["--rounds", ""], "argument --rounds: '' is not a whole number"),
    (["--directory", "{file}/dir"], "--directory {file}/dir does not exist; create it"),
    (["--directory", "{file}"], "is not a directory"),
    (["--directory", "/proc"], "--directory /proc: creating a file in /proc failed (No such file or directory): it is on "
                               "proc, a kernel pseudo file system that holds no files; choose a writable directory on a local"),
    (["--json", "{tmp}"], "is a directory; pass a file path"),
    (["--json", "{tmp}/nodir/x.json"], "no directory"),
    (["--json", "/proc/x.json"], "creating a file in /proc failed (No such file or directory): it is on proc"),
])
def test_bad_arguments_exit_2_with_one_line(argv, message, capsys, tmp_path):
    """An error in the argparse form (``python -m tba bench-ckpt: error: ...``, status 2), not a log record."""
    json_path = tmp_path / "out.json"
    (tmp_path / "file").write_text("")
    argv = [a.replace("{file}", str(tmp_path / "file")).replace("{tmp}", str(tmp_path)) for a in argv]
    message = message.replace("{file}", str(tmp_path / "file"))
    with pytest.raises(SystemExit) as exit_info:
        main(["bench-ckpt", "--json", str(json_path), *argv])
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("python -m tba bench-ckpt: error: ") and message in lines[0], lines
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]
    assert not json_path.exists()


def test_a_missing_directory_is_refused_not_created(tmp_path):
    args = argparse.Namespace(size="16M", rounds=1, directory=str(tmp_path / "new" / "ckpt"), json=None)
    assert "does not exist; create it" in bench_ckpt._validate(args)
    assert not (tmp_path / "new").exists()
    args.directory = str(tmp_path)
    assert bench_ckpt._validate(args) is None


def test_fio_line_is_labelled_bench_ckpt(tmp_path, monkeypatch, caplog):
    job = {"jobs": [{"write": {"bw_bytes": 2e9}}]}
    monkeypatch.setattr(bench_io.subprocess, "run", lambda *a, **k: SimpleNamespace(stdout=json.dumps(job)))
    args = argparse.Namespace(directory=str(tmp_path), no_fio=False, size_bytes=16 << 20)
    monkeypatch.setattr(bench_ckpt.shutil, "which", lambda name: "/usr/bin/fio")
    with caplog.at_level(logging.INFO, logger="tba"):
        assert bench_ckpt._fio(args) == 2.0
    lines = [r.getMessage() for r in caplog.records]
    assert lines and all(line.startswith("bench-ckpt: fio") for line in lines), lines


@pytest.mark.parametrize("size_bytes", [256 << 20, 1 << 30, 3 << 30])
def test_model_size_tracks_the_request(size_bytes):
    config = gpt_config(size_bytes)
    params = 12 * config.layers * config.width ** 2 + 2 * config.vocab_size * config.width
    assert 0.5 * size_bytes <= 12 * params <= size_bytes


@pytest.mark.slow
def test_tiny_run_reports_every_key(tmp_path, capsys):
    json_path = tmp_path / "out.json"
    argv = ["bench-ckpt", "--size", "16M", "--rounds", "1", "--directory", str(tmp_path),
            "--json", str(json_path), "--no-fio"]
    assert main(argv) == 0
    report = json.loads(json_path.read_text())
    for key in ("torch_save_stall_s", "dcp_save_stall_s", "dcp_async_stall_s", "tba_async_stall_s",
                "tba_lazy_stall_s", "tba_write_gbps"):
        assert key in report
    assert report["fio_write_gbps"] is None
    assert report["restore_exact"] is True
    assert report["tba_write_gbps"] > 0 and report["tba_lazy_stall_s"] >= 0
    assert "tba lazy" in capsys.readouterr().out
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]


@pytest.mark.slow
def test_a_restore_that_is_not_exact_fails_the_command(tmp_path, monkeypatch, caplog):
    """The table says so, and so does the exit status (helper-99: it was 0)."""
    from tba.cli import bench_ckpt

    monkeypatch.setattr(bench_ckpt, "_check_restore", lambda *args: False)
    argv = ["bench-ckpt", "--size", "16M", "--rounds", "1", "--directory", str(tmp_path), "--no-fio"]
    assert main(argv) == 1
    assert "differs from the state saved" in caplog.text


@pytest.mark.parametrize("no_fio, why", [(True, "--no-fio"), (False, "fio is not installed (apt-get install fio)")])
def test_the_table_says_why_fio_was_not_run(monkeypatch, no_fio, why):
    monkeypatch.setattr(bench_ckpt.shutil, "which", lambda name: None)
    report = {f"{method}_stall_s": 0.5 for method in bench_ckpt.METHODS}
    report.update(tba_write_gbps=1.0, tba_async_write_gbps=1.0, restore_exact=True, step_s=0.1, state_bytes=10**8,
                  fio_write_gbps=None, fio_not_run=bench_ckpt.fio_skipped(no_fio))
    assert f"fio write not run ({why})" in bench_ckpt._table(report)


@pytest.mark.parametrize("method", ["torch_save", "dcp_save", "tba_async", "tba_lazy"])
def test_a_full_disk_ends_in_one_line_naming_the_fix(tmp_path, method):
    """A checkpoint that cannot be written (here a file-size limit: EFBIG, as ENOSPC on a full disk) ended bench-ckpt
    in a traceback: torch.save's RuntimeError 'unexpected pos', DCP's CheckpointException of a whole traceback per
    rank (tba_lazy's log line of its failed save too). It ends in one line naming the method, the directory, the OS
    error and the fix, status 1, nothing left."""
    script = ("import sys\n"
              "from tba.cli import bench_ckpt, main\n"
              f"bench_ckpt.METHODS = ({method!r},)\n"
              "sys.exit(main(sys.argv[1:], command_line=True))\n")
    directory = tmp_path / "ckpt"
    directory.mkdir()
    limit = lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (4 << 20, 4 << 20))  # noqa: E731
    done = subprocess.run([sys.executable, "-c", script, "bench-ckpt", "--size", "16M", "--rounds", "1", "--no-fio",
                           "--directory", str(directory)], capture_output=True, text=True, timeout=240,
                          preexec_fn=limit)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr, done.stderr  # tba_lazy's own log line too (it printed DCP's report)
    label = bench_ckpt.LABELS[method]
    assert done.stderr.splitlines()[-1:] == [f"python -m tba bench-ckpt: error: writing a checkpoint with {label} in "
                     f"{directory} failed: File too large; free space there, or pass a smaller --size or another "
                     "--directory"], done.stderr
    assert list(directory.iterdir()) == []


@pytest.mark.parametrize("given", [True, False], ids=["--directory", "$TBA_DIR"])
def test_too_little_space_or_memory_names_the_source_the_sizes_and_the_fix(tmp_path, monkeypatch, capsys, given):
    """'--directory D has 19 MiB free; needs 3x --size' named --directory when $TBA_DIR gave D, and neither it nor the
    memory refusal ('N MiB of free memory; --size needs about 6x its bytes') said how much was needed or the fix."""
    monkeypatch.setattr(bench_ckpt.shutil, "disk_usage", lambda path: SimpleNamespace(free=20 << 20))
    monkeypatch.setenv("TBA_DIR", str(tmp_path))
    with pytest.raises(SystemExit):
        main(["bench-ckpt", "--size", "16M", *(["--directory", str(tmp_path)] if given else [])])
    where = "--directory" if given else "$TBA_DIR"
    assert capsys.readouterr().err == (f"python -m tba bench-ckpt: error: {where} {tmp_path} has 20.0 MiB free; --size "
                                       "16.0 MiB needs 3x that (48.0 MiB) there: pass a smaller --size or another "
                                       "--directory\n")
    monkeypatch.setattr(bench_ckpt.shutil, "disk_usage", lambda path: SimpleNamespace(free=1 << 40))
    monkeypatch.setattr(bench_ckpt.os, "sysconf", lambda name: 4096 if name == "SC_PAGE_SIZE" else 5120)
    with pytest.raises(SystemExit):
        main(["bench-ckpt", "--size", "16M"])
    assert capsys.readouterr().err == ("python -m tba bench-ckpt: error: 20.0 MiB of free memory; --size 16.0 MiB needs "
                                       "about 6x that (96.0 MiB): pass a smaller --size\n")


@pytest.mark.parametrize("method", ["dcp_async", "tba_async", "tba_lazy"])
def test_a_stop_while_a_save_runs_in_the_background_leaves_nothing(tmp_path, monkeypatch, method):
    """SIGTERM (or Ctrl-C) in the training step right after a background save started: run() removed its scratch
    directory while the save's thread still wrote there, which then left tba-bench-ckpt-*/tba_async-0/ behind (seen
    with `timeout -s TERM 7`). The save is now waited for before the directory is removed."""
    import threading

    from torch.distributed.checkpoint import FileSystemWriter

    from tba.checkpoint import TbaStorageWriter

    release, finished = threading.Event(), threading.Event()
    writer_class = FileSystemWriter if method == "dcp_async" else TbaStorageWriter
    write_data, finish = writer_class.write_data, writer_class.finish

    def held_write_data(self, *args, **kwargs):
        if threading.current_thread() is threading.main_thread():  # tba_lazy's warm-up, in the caller
            return write_data(self, *args, **kwargs)
        release.wait(5)  # until the command has ended (before the fix) or 5 s (after it: the command waits for this)
        return write_data(self, *args, **kwargs)

    def finish_and_say(self, *args, **kwargs):
        try:
            return finish(self, *args, **kwargs)
        finally:
            if threading.current_thread() is not threading.main_thread():
                finished.set()

    monkeypatch.setattr(writer_class, "write_data", held_write_data)
    monkeypatch.setattr(writer_class, "finish", finish_and_say)
    monkeypatch.setattr(bench_ckpt, "METHODS", (method,))
    steps = []
    step = bench_ckpt._Trainer.step

    def interrupted_step(self, *args, **kwargs):
        steps.append(1)
        if len(steps) == 2:  # the step right after the first checkpoint started
            raise KeyboardInterrupt
        return step(self, *args, **kwargs)

    monkeypatch.setattr(bench_ckpt._Trainer, "step", interrupted_step)
    with pytest.raises(KeyboardInterrupt):
        main(["bench-ckpt", "--size", "16M", "--rounds", "1", "--no-fio", "--directory", str(tmp_path)])
    release.set()
    assert finished.wait(60)  # the save's last write (its metadata) is over
    assert list(tmp_path.iterdir()) == []
