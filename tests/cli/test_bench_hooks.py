"""bench-hooks: a quick run on temporary directories, its table and JSON, and its cleanup (no timing asserted)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import subprocess
import sys

import pytest
import torch

from tba.allocator import CACHING, detect, find_library
from tba.cli import COMMANDS, bench_hooks, build_parser, main


def _args(argv):
    parser = argparse.ArgumentParser()
    bench_hooks.add_arguments(parser)
    return parser.parse_args(argv)


def test_quick_run_writes_every_row_and_cleans_up(tmp_path, capsys):
    disk, ram = tmp_path / "disk", tmp_path / "ram"
    disk.mkdir()
    ram.mkdir()
    out = tmp_path / "hooks.json"
    args = _args(["--quick", "--many", "--disk-dir", str(disk), "--ram-dir", str(ram), "--json", str(out)])
    assert bench_hooks.run(args) == 0
    captured = capsys.readouterr()
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert {(r["label"], r["count"]) for r in rows} == {(label, n) for label in ("disk", "ram", "keep") for n in (3, 6)}
    for row in rows:
        assert row["tba_forward_s"] > 0 and row["base_backward_s"] > 0
        assert row["extra_forward_us"] == (row["tba_forward_s"] - row["base_forward_s"]) / row["count"] * 1e6
        # One measured step (--quick): its mean is the best-of figure, and the collector's time is part of it.
        assert row["mean_s"]["tba"] == [row["tba_forward_s"], row["tba_backward_s"]]
        assert 0 <= row["collector_s"]["tba"] <= row["tba_forward_s"] + row["tba_backward_s"]
        assert set(row["full_collections"]) == {"base", "tba"}
    many = report["many"]
    assert many["count"] == 50 and many["backward_ratio"] > 0
    # Note [The disk's floor under the many-storage ratio]: the bytes tba read back, at the rate the same directory
    # gave a probe in this run (none at all when every write was still waiting as backward began: CI under load).
    assert 0 <= many["bytes_read"] <= 50 * 64 << 10 and many["disk_read_gbps"] > 0 and not many["disk_error"]
    assert many["floor_s"] == many["bytes_read"] / (many["disk_read_gbps"] * 1e9)
    assert many["floor_ratio"] == many["floor_s"] / many["base_backward_s"]
    assert (f"{many['floor_ratio']:.2f}x the backward without tba" if many["bytes_read"] else
            "tba read nothing back") in captured.out
    assert "keep_in_memory()" in captured.out and "backward" in captured.out
    assert "mean of the 1 measured steps" in captured.out and "6 x 64 KiB ram:" in captured.out
    assert "6 x 64 KiB" in captured.err
    assert list(disk.iterdir()) == [] and list(ram.iterdir()) == []


def test_sample_profile_prints_where_each_thread_stood(tmp_path, capsys):
    args = _args(["--quick", "--no-disk", "--no-keep", "--ram-dir", str(tmp_path), "--sample-profile"])
    assert bench_hooks.run(args) == 0
    out = capsys.readouterr().out
    assert out.count("sampled stacks, one more step with tba") == 2
    assert "thread MainThread:" in out and "thread tba-control:" in out


def test_python_work_prints_each_row_and_phase_and_writes_the_json(tmp_path, capsys):
    out_json = tmp_path / "out.json"
    args = _args(["--quick", "--no-disk", "--no-keep", "--ram-dir", str(tmp_path), "--python-work", "--json", str(out_json)])
    assert bench_hooks.run(args) == 0
    out = capsys.readouterr().out
    assert "Python work per storage, one step with tba less one without" in out
    for count in (3, 6):
        for phase in ("forward", "backward"):
            assert f"{count} x 64 KiB ram {phase}:" in out
    row = json.loads(out_json.read_text())["rows"][0]
    assert row["python_work"]["forward"]["tba-control"]["lines"] > 0
    assert row["python_work_top"]["forward"]["MainThread"], "no function of the training thread listed"


def test_rows_are_capped_by_max_bytes():
    args = _args(["--sizes", "16M", "--counts", "400,2000", "--max-bytes", "64M", "--no-keep"])
    cases = bench_hooks._cases(args, "/d", "/r")
    assert {(c.label, c.count) for c in cases} == {("ram", 4), ("disk", 4)}


def test_device_reaches_every_case_and_cuda_needs_a_gpu(capsys):
    args = _args(["--device", "cuda", "--counts", "4"])
    assert {c.device for c in bench_hooks._cases(args, "/d", "/r")} == {"cuda"}
    with pytest.raises(SystemExit, match="2"):
        bench_hooks.run(_args(["--device", "cuda", "--many"]))
    assert "python -m tba bench-hooks: error: --many runs on the CPU only" in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="2"):
            bench_hooks.run(args)
        assert "python -m tba bench-hooks: error: --device cuda needs a CUDA build" in capsys.readouterr().err


def test_registered_with_help():
    assert COMMANDS["bench-hooks"][0] == "tba.cli.bench_hooks"
    assert "--many" in build_parser()._subparsers._group_actions[0].choices["bench-hooks"].format_help()


def test_the_default_loop_reads_back_and_hold_outputs_does_not(tmp_path, capsys, monkeypatch):
    """The default loop keeps only sums, so tba reads every saved output back; --hold-outputs keeps the
    outputs, which tba then serves from the program's memory. Both say which loop ran."""
    from tba.bench import hooks
    from tba.runtime._reads import StoreReads

    read_counts = []
    real_start_read = StoreReads._start_read

    def counting(self, entry, watched=False):
        read_counts[-1] += 1
        return real_start_read(self, entry, watched)

    monkeypatch.setattr(StoreReads, "_start_read", counting)
    real_context = hooks._context

    @contextlib.contextmanager
    def written_before_backward(case):
        # On a loaded machine backward could reach a storage before its write had started: tba then serves it from
        # memory and skips the write (Note [A write nobody needs is not started] in tba/device/_protocol.py), and
        # nothing was read (a CI run: 0 reads).
        with real_context(case) as offloader:
            yield offloader
            if case is not None and case.path == "offload":
                offloader.flush()

    monkeypatch.setattr(hooks, "_context", written_before_backward)
    for hold in (False, True):
        read_counts.append(0)
        hooks.measure(hooks.HookCase(64 * 1024, 256, str(tmp_path), "ram", hold_outputs=hold), warmups=0, repeats=1)
    assert read_counts[0] > 0 and read_counts[1] == 0, read_counts  # 16 MiB: more than the window holds
    args = _args(["--quick", "--no-keep", "--no-disk", "--ram-dir", str(tmp_path), "--hold-outputs"])
    assert bench_hooks.run(args) == 0
    assert "held until backward" in capsys.readouterr().out


def test_gc_freeze_freezes_before_measuring_and_says_so(tmp_path, capsys):
    out = tmp_path / "hooks.json"
    args = _args(["--quick", "--no-keep", "--no-disk", "--ram-dir", str(tmp_path), "--gc-freeze", "--json", str(out)])
    frozen = gc.get_freeze_count()  # Note [The suite's collections skip what earlier tests left]
    try:
        assert bench_hooks.run(args) == 0
        assert gc.get_freeze_count() > frozen
    finally:
        gc.unfreeze()
    assert "gc.freeze() before measuring" in capsys.readouterr().out
    assert json.loads(out.read_text())["gc_freeze"] is True


def test_the_command_line_runs_under_the_allocator_asked_for(tmp_path):
    choice = next((name for name in CACHING if find_library(name) is not None), None)
    if choice is None:
        pytest.skip("no caching allocator is installed here")
    out = tmp_path / "hooks.json"
    proc = subprocess.run([sys.executable, "-m", "tba", "bench-hooks", "--quick", "--no-disk", "--no-keep", "--ram-dir",
                           str(tmp_path), "--allocator", choice, "--json", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"malloc: {choice}")
    assert json.loads(out.read_text())["malloc"].startswith(choice)


def test_called_as_a_function_it_measures_under_the_malloc_serving_the_process(tmp_path, monkeypatch, capsys):
    def no_exec(*args):
        raise AssertionError("bench_hooks.run re-executed the calling process")

    monkeypatch.setattr(os, "execve", no_exec)
    argv = ["--quick", "--no-disk", "--no-keep", "--ram-dir", str(tmp_path), "--allocator", "auto"]
    assert bench_hooks.run(_args(argv)) == 0
    assert capsys.readouterr().out.startswith(f"malloc: {detect()}")
    # Through the command line's entry point too: only `python -m tba` itself may run again (a worker of
    # pytest-xdist that called main() was replaced by a new pytest process, and the run lost the worker).
    assert main(["bench-hooks", *argv]) == 0
    assert capsys.readouterr().out.startswith(f"malloc: {detect()}")


def test_intra_op_threads_are_set_before_measuring_and_said(tmp_path, capsys, monkeypatch):
    out = tmp_path / "hooks.json"
    args = _args(["--quick", "--no-keep", "--no-disk", "--ram-dir", str(tmp_path), "--intra-op-threads", "1",
                  "--json", str(out)])
    before, seen, measure = torch.get_num_threads(), [], bench_hooks.measure
    monkeypatch.setattr(bench_hooks, "measure", lambda *a, **k: (seen.append(torch.get_num_threads()), measure(*a, **k))[1])
    try:
        assert bench_hooks.run(args) == 0
    finally:
        torch.set_num_threads(before)
    assert seen and set(seen) == {1}
    assert "torch intra-op threads: 1;" in capsys.readouterr().out
    assert json.loads(out.read_text())["intra_op_threads"] == 1
    with pytest.raises(SystemExit):
        _args(["--intra-op-threads", "0"])


def test_alone_steps_run_each_loop_in_a_process_of_its_own(tmp_path, capsys):
    ram = tmp_path / "ram"
    ram.mkdir()
    out = tmp_path / "hooks.json"
    args = _args(["--quick", "--no-disk", "--no-keep", "--ram-dir", str(ram), "--alone-steps", "2", "--json", str(out)])
    assert bench_hooks.run(args) == 0
    printed = capsys.readouterr().out
    alone = json.loads(out.read_text())["alone"]
    assert [row["with_tba"] for row in alone] == [True, False]
    for row in alone:
        assert row["count"] == 6 and row["steps"] == 2 and row["step_us"] > 0
        assert 0 <= row["collector_us"] <= row["step_us"] and row["full_collections"] >= 0
    assert "6 x 64 KiB, 2 steps alone in a process of its own, with tba (without)" in printed
    assert list(ram.iterdir()) == []


def test_alone_steps_run_under_tba_without_any_table_directory(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bench_hooks, "DEFAULT_DISK_DIR", str(tmp_path))
    out = tmp_path / "out" / "hooks.json"
    out.parent.mkdir()
    args = _args(["--quick", "--no-disk", "--no-keep", "--ram-dir", "none", "--alone-steps", "1", "--json", str(out)])
    assert bench_hooks.run(args) == 0
    assert "with tba (without)" in capsys.readouterr().out
    assert [row["with_tba"] for row in json.loads(out.read_text())["alone"]] == [True, False]
    out.unlink()
    out.parent.rmdir()
    assert list(tmp_path.iterdir()) == []


def test_the_loop_alone_refuses_bad_values(capsys):
    from tba.bench import collector
    with pytest.raises(SystemExit) as exit_:
        collector.main(["--count", "0", "--size-bytes", "65536", "--steps", "1"])
    assert exit_.value.code == 2 and "--count, --size-bytes and --steps must be >= 1" in capsys.readouterr().err


def test_alone_steps_take_the_table_settings_and_cap(monkeypatch, tmp_path, capsys):
    seen = {}

    def measure_alone(count, size_bytes, directory, steps, **settings):
        seen.update(count=count, steps=steps, **settings)
        raise bench_hooks.AloneRunError("the loop alone with tba failed (exit status 1; ...): MemoryError")

    monkeypatch.setattr(bench_hooks, "measure_alone", measure_alone)
    ram = tmp_path / "ram"
    ram.mkdir()
    args = _args(["--quick", "--no-disk", "--no-keep", "--ram-dir", str(ram), "--alone-steps", "2", "--hold-outputs",
                  "--intra-op-threads", str(torch.get_num_threads()), "--gc-freeze", "--max-bytes", "128K"])
    try:
        assert bench_hooks.run(args) == 1
    finally:
        gc.unfreeze()
    assert seen == {"count": 2, "steps": 2, "hold_outputs": True, "intra_op_threads": torch.get_num_threads(),
                    "gc_freeze": True}
    err = capsys.readouterr().err
    assert "bench-hooks: error: the loop alone with tba failed" in err and "Traceback" not in err
    assert list(ram.iterdir()) == []


def test_alone_steps_refuse_cuda(capsys):
    with pytest.raises(SystemExit, match="2"):
        bench_hooks.run(_args(["--device", "cuda", "--alone-steps", "1"]))
    assert "python -m tba bench-hooks: error: --alone-steps runs on the CPU only" in capsys.readouterr().err


@pytest.mark.parametrize("count", ["0", "-5"])
def test_many_count_below_one_is_refused(count, capsys):
    """--many --many-count -5 ran and printed '-5 x 64 KiB ... backward 0.00 s with tba, 0.00 s without (0.81x)', exit 0."""
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["bench-hooks", "--many", "--many-count", count])
    assert exit_.value.code == 2 and "--many-count" in capsys.readouterr().err


@pytest.mark.parametrize(("option", "value"), [("--counts", "400,,2000"), ("--counts", "400,"), ("--sizes", "64K,,1M")])
def test_an_empty_item_in_a_list_is_refused(option, value, capsys):
    """'--counts 400,,2000' ran as '--counts 400,2000' (helper-85's minor item): a typo is named instead."""
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["bench-hooks", option, value])
    assert exit_.value.code == 2 and option in capsys.readouterr().err


@pytest.mark.parametrize("size", ["0", "-1M"])
def test_doctor_quick_size_below_one_byte_is_refused(size, capsys):
    """'doctor --quick-size 0' read 1 MiB instead (helper-85's minor item)."""
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["doctor", "--quick-size", size])
    assert exit_.value.code == 2 and "--quick-size" in capsys.readouterr().err


def test_quick_keeps_the_options_given(tmp_path, monkeypatch):
    """--quick replaced --sizes, --counts, --warmups and --repeats given with it: `--quick --sizes 1M` ran 64 KiB."""
    seen = []

    def cases(args, *directories):
        seen.append((args.sizes, args.counts, args.warmups, args.repeats))
        raise RuntimeError("stop before measuring")

    monkeypatch.setattr(bench_hooks, "_cases", cases)
    for argv, want in ((["--sizes", "1M", "--counts", "5"], ([1 << 20], [5], 1, 1)),
                       (["--repeats", "2"], ([64 << 10], [3, 6], 1, 2))):
        with pytest.raises(RuntimeError, match="stop before measuring"):
            bench_hooks.run(_args(["--quick", "--no-disk", "--ram-dir", str(tmp_path), *argv]))
        assert seen.pop() == want
    assert os.listdir(tmp_path) == []


def test_the_disk_rows_go_under_tba_dir_when_it_is_set(tmp_path, capsys, monkeypatch):
    """$TBA_DIR names the user's offload disk: the disk rows' fresh directory goes there (it went to /var/tmp)."""
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    monkeypatch.setenv("TBA_DIR", str(nvme))
    args = _args(["--quick", "--ram-dir", "none", "--no-keep"])
    assert bench_hooks.run(args) == 0
    assert f"{nvme} (disk)" in capsys.readouterr().out
    assert list(nvme.iterdir()) == []  # the fresh directory was removed


def test_a_missing_tba_dir_is_refused_naming_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TBA_DIR", str(tmp_path / "missing"))
    with pytest.raises(SystemExit) as stop:
        bench_hooks.run(_args(["--quick", "--ram-dir", "none", "--no-keep"]))
    assert stop.value.code == 2
    assert "$TBA_DIR (used where --disk-dir is not given)" in capsys.readouterr().err


def test_many_measures_a_directory_without_o_direct_through_the_page_cache(tmp_path, monkeypatch):
    """Note [The disk's floor under the many-storage ratio] where the file system has no O_DIRECT (tmpfs before
    Linux 6.6, some FUSE and network file systems): the probe's O_DIRECT open would fail and leave the ratio without
    its floor; it reads buffered instead, and the line says so."""
    from tba.bench import hooks_many
    from tba.cli._hooks_report import format_many

    opened = []
    real = hooks_many.directory_bandwidth
    monkeypatch.setattr(hooks_many, "probe_direct_io", lambda directory: "O_DIRECT is refused (EINVAL)")
    monkeypatch.setattr(hooks_many, "directory_bandwidth",
                        lambda *args, direct, **kw: opened.append(direct) or real(*args, direct=direct, **kw))
    result = hooks_many.measure_many(20, 64 << 10, str(tmp_path))
    assert opened == [False] and os.listdir(tmp_path) == []
    assert not result.disk_direct and result.disk_read_gbps > 0 and result.floor_ratio is not None
    # 20 storages may all be taken from memory: the line is read as it is for a step that read some back.
    assert "1 MiB buffered reads, the best of 2, this run" in format_many(dataclasses.replace(result, bytes_read=1 << 20))


def test_many_that_read_nothing_back_names_no_floor():
    from tba.bench.hooks_many import ManyResult
    from tba.cli._hooks_report import format_many

    text = format_many(ManyResult(50, 64 << 10, "/d", 1.0, 1.5, 1.0, 1.2, bytes_read=0, disk_read_gbps=1.0))
    assert "tba read nothing back (backward took every storage from memory): the disk sets no floor" in text
    assert "the disk alone" not in text


def test_many_says_why_the_ratio_has_no_floor(tmp_path, monkeypatch):
    from tba.bench import hooks_many
    from tba.cli._hooks_report import format_many

    def full(directory, size_bytes, direct=True):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(hooks_many, "disk_read_gbps", full)
    result = hooks_many.measure_many(10, 64 << 10, str(tmp_path))
    assert result.floor_s is None and result.floor_ratio is None and result.as_dict()["floor_ratio"] is None
    text = format_many(result)
    assert "the disk's read rate was not measured (OSError: [Errno 28] No space left on device)" in text
    assert "the disk alone" not in text


def test_options_that_leave_nothing_to_measure_are_refused(tmp_path, capsys, monkeypatch):
    """--no-disk --no-keep --ram-dir none ran, printed an empty table under its header and exited 0."""
    monkeypatch.setattr(bench_hooks, "DEFAULT_DISK_DIR", str(tmp_path))
    with pytest.raises(SystemExit) as exit_:
        bench_hooks.run(_args(["--quick", "--no-disk", "--no-keep", "--ram-dir", "none"]))
    captured = capsys.readouterr()
    assert exit_.value.code == 2 and captured.out == "", captured.out
    assert captured.err == ("python -m tba bench-hooks: error: --no-disk, --no-keep and --ram-dir none leave no row to "
                            "measure; drop one of them, or add --many or --alone-steps N\n")
    assert list(tmp_path.iterdir()) == []


def test_the_table_stays_aligned_with_a_long_directory():
    """A --disk-dir longer than the 26-character directory column pushed that row's figures right of their headers."""
    from tba.bench.hooks import HookCase, HookResult
    from tba.cli._hooks_report import format_table

    cases = [HookCase(64 << 10, 3, "/tmp/a much longer directory name é/deeper/tba-bench-hooks-x", "disk"),
             HookCase(64 << 10, 3, "/dev/shm/tba-bench-hooks-y", "ram"),
             HookCase(64 << 10, 3, "/dev/shm/tba-bench-hooks-y", "keep", path="keep")]
    lines = format_table([HookResult(case, 0.001, 0.002, 0.003, 0.004) for case in cases]).splitlines()
    assert {len(line) for line in lines} == {len(lines[0])}, "\n".join(lines)


def test_many_names_the_disk_directory_not_its_removed_scratch_directory():
    """The --many line named the run's scratch directory (/var/tmp/tba-bench-hooks-k5dvo3qg), removed when the command
    ends, where the table's rows name the directory given (/var/tmp (disk))."""
    from tba.bench.hooks_many import ManyResult
    from tba.cli._hooks_report import format_many

    text = format_many(ManyResult(50, 64 << 10, "/var/tmp/tba-bench-hooks-k5dvo3qg", 1.0, 1.5, 1.0, 1.2))
    assert text.startswith("50 x 64 KiB in /var/tmp (disk): backward"), text


def test_a_default_disk_directory_in_memory_is_named(tmp_path, capsys, monkeypatch):
    """With no --disk-dir and no $TBA_DIR, a /var/tmp on tmpfs was reported as 'the disk rows' directory None is on
    tmpfs'."""
    monkeypatch.delenv("TBA_DIR", raising=False)
    monkeypatch.setattr(bench_hooks, "DEFAULT_DISK_DIR", str(tmp_path))
    monkeypatch.setattr(bench_hooks, "memory_backed", lambda path: "tmpfs")
    assert bench_hooks.run(_args(["--quick", "--ram-dir", "none", "--no-keep"])) == 0
    assert f"the disk rows' directory {tmp_path} is on tmpfs" in capsys.readouterr().err


def test_quick_help_names_every_value_it_sets():
    """--quick also sets --many-count (to 50), which its help did not say: `--quick --many` timed 50 storages, not the
    100,000 that --many's help promises."""
    parser = argparse.ArgumentParser()
    bench_hooks.add_arguments(parser)
    quick = next(action.help for action in parser._actions if "--quick" in action.option_strings)
    counts = ",".join(map(str, bench_hooks.QUICK["counts"]))
    for said in (f"--counts {counts}", "--sizes 64K", "--warmups 1", "--repeats 1",
                 f"--many-count {bench_hooks.QUICK['many_count']}"):
        assert said in quick, (said, quick)


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm (tmpfs) for the RAM rows")
def test_the_benchmark_is_not_warned_about_its_own_set_up(caplog, capsys):
    """Note [A benchmark is not warned about its own set-up] in tba/bench/hooks.py: its RAM rows printed tba's "the
    offload directory ... is on tmpfs" and its loop of leaf tensors "found no repeated blocks", warnings meant for a
    user's training; the filter is gone once the command ends."""
    import logging

    args = _args(["--quick", "--no-disk", "--no-keep", "--ram-dir", "/dev/shm"])
    with caplog.at_level(logging.WARNING, logger="tba"):
        assert bench_hooks.run(args) == 0
        notices = [record.getMessage() for record in caplog.records if getattr(record, "tba_notice", None)]
        assert notices == []
        logging.getLogger("tba").warning("after", extra={"tba_notice": "memory-backed"})
    assert caplog.records[-1].getMessage() == "after"
