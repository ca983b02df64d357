"""User errors on the command line: one line naming the fix, exit status 2, before any work."""

from __future__ import annotations

import argparse
import subprocess

import pytest
from python_runs import run_python

import tba
from tba.cli import COMMANDS, build_parser, main


def tba_cli(*args: str) -> subprocess.CompletedProcess:
    return run_python(["-m", "tba", *args], timeout=60)


@pytest.mark.parametrize(
    "args, match",
    [
        (["bench-io", "--queue-depth", "99999"], "pass a queue depth in 1..4096"),
        (["demo", "--backend", "bogus"], "unknown backend 'bogus'; choose one of auto, io_uring, threads"),
        (["demo", "--backend", "uring"], "unknown backend 'uring'; did you mean 'io_uring'? choose one of auto"),
        (["rok", "--budgets", "abc"], "'abc' is not a number; pass --budgets as comma-separated numbers"),
        (["rok", "--budgets-mib", "-5"], "-5 is not positive; pass --budgets-mib > 0"),
        (["rok", "--model", "nosuchmod:make", "--batch", "nosuchmod:batch"], "cannot import module 'nosuchmod'"),
        (["rok", "--model", "tba.bench.models:make_gpt"], "--model needs --batch: pass --batch MODULE:FUNC"),
        (["rok", "--batch", "tba.bench.models:make_batch"], "--batch needs --model: pass --model MODULE:FUNC"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(args, match, capsys):
    try:
        code = main(list(args))
    except SystemExit as exit_:
        code = exit_.code
    stderr = capsys.readouterr().err
    assert code == 2, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and match in lines[0], stderr


def test_a_bad_argument_in_a_fresh_process_prints_no_traceback():
    done = tba_cli("rok", "--budgets", "abc")
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "'abc' is not a number" in lines[0] and "Traceback" not in done.stderr


def test_doctor_on_missing_directory(tmp_path):
    missing = tmp_path / "nope"
    done = tba_cli("doctor", "--directory", str(missing), "--no-bandwidth")
    assert f"{missing} (from --directory) does not exist" in done.stdout + done.stderr
    assert not missing.exists()
    measured = tba_cli("doctor", "--directory", str(missing), "--quick-size", "1M")
    assert measured.returncode == 0 and "FileNotFoundError" not in measured.stdout, measured.stdout
    assert f"not measured ({missing} (from --directory) does not exist; create it or pass another --directory)" \
        in measured.stdout


@pytest.mark.parametrize("given, source, fix", [
    (None, "$TBA_DIR", "create it or set TBA_DIR to an existing directory, or pass --directory"),
    ("flag", "--directory", "create it or pass another --directory"),
])
def test_doctor_names_where_the_directory_came_from(given, source, fix, tmp_path, monkeypatch, capsys):
    missing = tmp_path / "nope"
    monkeypatch.setenv("TBA_DIR", str(missing))
    assert main(["doctor", "--no-bandwidth", *(["--directory", str(missing)] if given else [])]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("offload directory "))
    assert row.split(maxsplit=2)[2] == f"{missing} (from {source})", row
    assert f"no ({missing} (from {source}) does not exist; {fix})" in out, out


def test_doctor_names_the_directory_whose_file_system_it_read(tmp_path, capsys):
    """A missing directory has no file system of its own: the row names the nearest existing parent it read."""
    missing = tmp_path / "nope" / "deeper"
    for directory, read in ((missing, f" (of {tmp_path}, the nearest existing parent)"), (tmp_path, "")):
        assert main(["doctor", "--no-bandwidth", "--directory", str(directory)]) == 0
        row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("file system of "))
        assert row.endswith(read) and row.count("(of ") == (1 if read else 0), row


def test_bare_command_prints_help():
    done = tba_cli()
    assert done.returncode == 2
    assert done.stdout.startswith("usage: python -m tba") and all(name in done.stdout for name in COMMANDS)
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("argv", [["--version"], ["doctor", "--version"], ["bench-hooks", "--version"]])
def test_version(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 0 and capsys.readouterr().out.strip() == f"tba {tba.__version__}"


@pytest.mark.parametrize("argv, verbose", [(["doctor"], False), (["-v", "doctor"], True), (["doctor", "-v"], True),
                                           (["doctor", "--verbose"], True)])
def test_verbose_before_or_after_the_command(argv, verbose):
    assert build_parser().parse_args(argv).verbose is verbose


def test_verbose_after_the_command_runs(tmp_path, capsys):
    assert main(["doctor", "--no-bandwidth", "--directory", str(tmp_path), "-v"]) == 0
    assert "O_DIRECT in" in capsys.readouterr().out


def test_help_is_plain_text():
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert set(commands) == set(COMMANDS)
    for command, parser in commands.items():
        text = parser.format_help()
        for markup in ("``", ":class:`", ":func:`", ":mod:`", ":meth:`", ":data:`"):
            assert markup not in text, f"{command} --help shows {markup}"


def test_bench_ckpt_on_a_directory_that_does_not_exist(tmp_path):
    (tmp_path / "file").write_text("")
    done = tba_cli("bench-ckpt", "--directory", str(tmp_path / "file" / "dir"), "--size", "16M")
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "does not exist; create it" in lines[0], done.stderr


@pytest.mark.parametrize("command", [["rok"], ["capacity", "--budget", "1GiB"]])
def test_device_defaults_to_what_torch_sees(command, monkeypatch):
    import torch

    for visible, expected in ((False, "cpu"), (True, "cuda")):
        monkeypatch.setattr(torch.cuda, "is_available", lambda visible=visible: visible)
        assert build_parser().parse_args(command).device == expected
    assert build_parser().parse_args([*command, "--device", "cpu"]).device == "cpu"


class _Ran(Exception):
    """Raised by a stand-in for a command's measurement: the command got past its checks."""


def _stop_at_the_measurement(monkeypatch, directories: list) -> None:
    from tba.cli import capacity, demo, rok

    def measure(*args, **kwargs):
        directories.append(kwargs.get("directory", getattr(args[0], "directory", None) if args else None))
        raise _Ran

    monkeypatch.setattr(demo, "run_isolated", measure)
    monkeypatch.setattr(capacity, "measure_capacity", measure)
    monkeypatch.setattr(rok, "sweep", measure)


COMMANDS_WITH_A_SPILL_DIRECTORY = [["demo"], ["capacity", "--budget", "64M"], ["rok"]]


@pytest.mark.parametrize("argv", COMMANDS_WITH_A_SPILL_DIRECTORY, ids=lambda argv: argv[0])
def test_tba_dir_is_the_spill_directory_where_directory_is_not_given(argv, tmp_path, monkeypatch):
    """The demo ran in the temp directory where $TBA_DIR was set, though its help said "default: $TBA_DIR"."""
    directories: list = []
    _stop_at_the_measurement(monkeypatch, directories)
    monkeypatch.setenv("TBA_DIR", str(tmp_path))
    with pytest.raises(_Ran):
        main([*argv, "--out", str(tmp_path / "out")] if argv[0] == "rok" else argv)
    assert directories == [str(tmp_path)]


@pytest.mark.parametrize("argv", COMMANDS_WITH_A_SPILL_DIRECTORY, ids=lambda argv: argv[0])
def test_a_bad_tba_dir_is_refused_before_any_work(argv, tmp_path, monkeypatch, capsys):
    """$TBA_DIR naming a file failed each tba run one by one (capacity: every strategy "unavailable", status 1)."""
    _stop_at_the_measurement(monkeypatch, [])
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("TBA_DIR", str(tmp_path / "file"))
    with pytest.raises(SystemExit) as stop:
        main([*argv, "--out", str(tmp_path / "out")] if argv[0] == "rok" else argv)
    assert stop.value.code == 2
    assert "$TBA_DIR (used where --directory is not given)" in capsys.readouterr().err


@pytest.mark.parametrize("argv", COMMANDS_WITH_A_SPILL_DIRECTORY, ids=lambda argv: argv[0])
def test_a_tba_variable_tba_cannot_read_is_refused_before_any_work(argv, tmp_path, monkeypatch, capsys):
    """TBA_QUEUE_DEPTH=abc reached only the measured processes: the demo ended in an IsolatedRunError traceback."""
    _stop_at_the_measurement(monkeypatch, [])
    monkeypatch.setenv("TBA_QUEUE_DEPTH", "abc")
    with pytest.raises(SystemExit) as stop:
        main([*argv, "--out", str(tmp_path / "out")] if argv[0] == "rok" else argv)
    assert stop.value.code == 2
    assert "TBA_QUEUE_DEPTH='abc': write a whole number; fix the variable or unset it" in capsys.readouterr().err


@pytest.mark.parametrize("argv, match", [
    (["bench-hooks", "--countz", "4"], "python -m tba bench-hooks: error: unrecognized arguments: --countz 4; "
                                       "did you mean '--counts'? run 'python -m tba bench-hooks --help'"),
    (["doctor", "--no-bandwith"], "python -m tba doctor: error: unrecognized arguments: --no-bandwith; "
                                  "did you mean '--no-bandwidth'?"),
    (["doctor", "--quick-sise=1M"], "did you mean '--quick-size'?"),
    (["doctor", "extra"], "python -m tba doctor: error: unrecognized arguments: extra; run 'python -m tba doctor --help'"),
    (["bench-hok"], "python -m tba: error: unknown command 'bench-hok'; did you mean 'bench-hooks'? choose one of demo"),
    (["bogus"], "python -m tba: error: unknown command 'bogus'; choose one of demo"),
])
def test_a_mistyped_word_names_the_command_and_the_closest_match(argv, match, capsys):
    """Note [A mistyped word gets a suggestion] in tba/cli/__init__.py."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(lines) == 1 and match in lines[0], lines


@pytest.mark.parametrize("argv, out", [(["--version", "bogus"], "tba "), (["-h", "bogus"], "usage: python -m tba")])
def test_help_or_the_version_asked_before_a_mistyped_command_is_given(argv, out, capsys):
    """argparse answers --version and --help where it meets them, before the command after them: Note [A mistyped
    word gets a suggestion] refused the command first ('unknown command', status 2) where tba had printed the answer."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 0 and capsys.readouterr().out.startswith(out)
