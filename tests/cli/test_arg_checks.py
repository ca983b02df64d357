"""Bad command-line values are refused before any work: one line naming the fix, exit status 2, nothing left behind."""

from __future__ import annotations

import pytest

from tba.cli import main


def refused(argv: list[str], capsys) -> str:
    """The one error line ``argv`` gets; fails unless the command exits 2 with exactly one line on stderr."""
    try:
        code = main(list(argv))
    except SystemExit as exit_:
        code = exit_.code
    stderr = capsys.readouterr().err
    lines = stderr.strip().splitlines()
    assert code == 2 and len(lines) == 1, stderr
    return lines[0]


@pytest.mark.parametrize("argv, match", [
    (["demo", "--steps", "0"], "argument --steps: 0 is too small; pass a whole number >= 1"),
    (["demo", "--steps", "-2"], "argument --steps: -2 is too small"),
    (["demo", "--warmup", "-1"], "argument --warmup: -1 is too small; pass a whole number >= 0"),
    (["demo", "--steps", "x"], "argument --steps: 'x' is not a whole number"),
    (["rok", "--steps", "0"], "argument --steps: 0 is too small"),
    (["rok", "--warmup", "-1"], "argument --warmup: -1 is too small"),
    (["gpu-report", "--out", "x", "--steps", "-1"], "argument --steps: -1 is too small"),
    (["bench-io", "--size", "-1M"], "argument --size: '-1M' is negative; pass a positive size"),
    (["capacity", "--budget", "-1M"], "argument --budget: '-1M' is negative; pass a positive size"),
    # float() takes these: inf reached int() (an OverflowError traceback, --budgets after the baselines ran)
    (["rok", "--budgets-mib", "inf"], "argument --budgets-mib: inf is not a finite number; pass --budgets-mib"),
    (["rok", "--budgets", "0.5,1e999"], "argument --budgets: 1e999 is not a finite number"),
    (["rok", "--budgets", "nan"], "argument --budgets: nan is not positive"),
])
def test_bad_counts_and_sizes_are_refused_at_parse_time(argv, match, capsys):
    assert match in refused(argv, capsys)


def test_demo_directory_must_be_a_writable_directory(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("")
    assert f"--directory {afile} is not a directory" in refused(["demo", "--directory", str(afile)], capsys)
    missing = tmp_path / "missing"
    assert "does not exist; create it" in refused(["demo", "--directory", str(missing)], capsys)
    proc = "creating a file in /proc failed (No such file or directory): it is on proc, a kernel pseudo file system"
    assert proc in refused(["demo", "--directory", "/proc"], capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


@pytest.mark.parametrize("option", ["--json", "--png"])
def test_capacity_output_in_an_unwritable_folder_is_refused_up_front(option, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    line = refused(["capacity", "--preset", "tiny", "--budget", "1M", option, "/proc/x.out"], capsys)
    assert f"{option} /proc/x.out: creating a file in /proc failed" in line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("out, match", [
    ("{file}", "is a file; pass a directory"),
    ("/proc/x", "cannot create --out /proc/x: creating a directory in /proc failed (No such file or directory): it is on proc"),
    ("/proc", "--out /proc: creating a file in /proc failed (No such file or directory): it is on proc"),
])
def test_gpu_report_out_is_checked_up_front(out, match, tmp_path, capsys):
    (tmp_path / "afile").write_text("")
    line = refused(["gpu-report", "--simulate", "--skip-rok", "--out", out.replace("{file}", str(tmp_path / "afile"))],
                   capsys)
    assert match in line


@pytest.mark.parametrize("argv, match", [
    (["--sizes", "0"], "argument --sizes: '0': pass values > 0"),
    (["--counts", "0"], "argument --counts: '0': pass values > 0"),
    (["--counts=-5"], "argument --counts: '-5': pass values > 0"),
    (["--counts", "abc"], "argument --counts: 'abc' is not a whole number; pass counts such as 400,2000"),
    (["--max-bytes", "0"], "argument --max-bytes: '0' is not positive"),
    (["--disk-dir", "/nonexistent"], "--disk-dir /nonexistent does not exist; create it"),
    (["--disk-dir", "{file}"], "is not a directory"),
    (["--disk-dir", "/proc"], "--disk-dir /proc: creating a file in /proc failed"),
    (["--ram-dir", "{file}"], "--ram-dir {file} is not a directory"),
    (["--json", "{tmp}"], "is a directory; pass a file path"),
    (["--json", "{tmp}/nodir/x.json"], "no directory"),
    (["--json", "/proc/x.json"], "creating a file in /proc failed (No such file or directory): it is on proc"),
    # said "--warmups must be >= 0 and --repeats >= 1", naming neither the one given nor its value (helper-143)
    (["--warmups", "-1"], "argument --warmups: -1 is too small; pass a whole number >= 0"),
    (["--repeats", "0"], "argument --repeats: 0 is too small; pass a whole number >= 1"),
])
def test_bench_hooks_refuses_bad_values_before_measuring(argv, match, tmp_path, capsys):
    (tmp_path / "afile").write_text("")
    fill = {"{file}": str(tmp_path / "afile"), "{tmp}": str(tmp_path)}
    for key, value in fill.items():
        argv, match = [a.replace(key, value) for a in argv], match.replace(key, value)
    assert match in refused(["bench-hooks", "--no-keep", "--ram-dir", "none", "--sizes", "64K", "--counts", "2",
                             "--warmups", "0", "--repeats", "1", *argv], capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


@pytest.mark.parametrize("argv, match", [
    # printed "--size 102399999999998976.0 GiB": a size in the unit that it reaches, read at a glance
    (["--size", "99999999T"], "--size 95.4 EiB is more than the "),
    (["--size", "99999999999999T"], "--size 90.9 YiB is more than the "),
    (["--size", "4M", "--repeat", "0"], "argument --repeat: 0 is too small; pass a whole number >= 1"),
    (["--size", "4M", "--repeat", "x"], "argument --repeat: 'x' is not a whole number"),
    # said "--size must be a positive multiple of --block-size", the default block size shown nowhere (helper-143)
    (["--size", "1K"], "--size 1024 bytes is not a positive multiple of --block-size 1048576 bytes (1 MiB)"),
    (["--size", "3M", "--block-size", "2M"], "--size 3145728 bytes is not a positive multiple of --block-size 2097152"),
    # these two printed the run's header, then "cannot open an O_DIRECT file in ...: [Errno 20] Not a directory", exit 1
    (["--size", "4M", "--directory", "{tmp}/nope"], "does not exist; create it or pass an existing directory"),
    (["--size", "4M", "--directory", pytest.__file__], "is not a directory; pass a directory"),
])
def test_bench_io_refuses_bad_values_before_measuring(argv, match, tmp_path, capsys):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    error = refused(["bench-io", "--no-fio", "--directory", str(tmp_path), *argv], capsys)
    assert error.startswith("python -m tba bench-io: error: ") and match in error and "queue-depth" not in error
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv", [
    ["bench-io", "--directory", ""], ["bench-ckpt", "--directory", " "], ["bench-ckpt", "--json", ""],
    ["bench-hooks", "--json", ""], ["bench-hooks", "--disk-dir", ""], ["doctor", "--directory", ""],
    ["demo", "--directory", ""], ["rok", "--out", ""], ["capacity", "--budget", "1G", "--png", ""],
    ["gpu-report", "--simulate", "--out", ""],
])
def test_an_empty_path_is_refused(argv, capsys):
    """``--directory ''`` ran bench-io and bench-ckpt in the current directory; ``--json ''`` wrote no JSON, silently."""
    assert f"argument {argv[-2]}: the path is empty (an unset shell variable?); pass a path" in refused(argv, capsys)


@pytest.mark.parametrize("command", [["bench-io", "--no-fio", "--size", "4M"], ["bench-ckpt", "--no-fio", "--size", "16M"]])
def test_a_missing_tba_dir_is_named_as_such(command, tmp_path, monkeypatch, capsys):
    """bench-io and bench-ckpt blamed --directory, which was not given, for a bad $TBA_DIR."""
    monkeypatch.setenv("TBA_DIR", str(tmp_path / "nope"))
    assert f"error: $TBA_DIR (used where --directory is not given) {tmp_path / 'nope'} does not exist" in refused(
        command, capsys)


@pytest.mark.parametrize("command", ["bench-io", "bench-ckpt", "demo", "rok", "capacity", "gpu-report"])
def test_help_says_a_missing_directory_is_refused(command, capsys):
    """Note [The command line refuses a missing directory]: the help said nothing while directory= creates it."""
    with pytest.raises(SystemExit):
        main([command, "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "a missing one is refused, not created as Python's directory= does" in help_text
