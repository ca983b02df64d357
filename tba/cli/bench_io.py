"""Measure sequential O_DIRECT write and read bandwidth of each I/O engine, next to fio.

For every usable backend the benchmark writes a file of ``--size`` bytes as ``--block-size``
requests kept ``--queue-depth`` deep, then reads it back, and reports GB/s (10^9 bytes per
second). All backends share one aligned buffer that is allocated and touched once, up front.
Every pass writes a fresh file, preallocated as fio does, that has no name (``O_TMPFILE``, or
unlinked right after opening, via :func:`tba.io._directory.open_anonymous`), so it disappears with its
descriptor. When ``fio`` is on ``PATH`` it runs in the same invocation with the same parameters
(``ioengine=io_uring``, ``direct=1``, ``rw=write`` then ``rw=read``) on a named file that is
deleted afterwards, and each backend's ratio to fio is printed. With ``--repeat N`` every column
is the best of N runs.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys

import torch

from tba._units import parse_size, readable_size
from tba.cli import _checks as cli_checks
from tba.defaults import ALIGN_BYTES, GIB, MIB
from tba.io import FULL_DISK_ERRNOS, Op, available_backends, filled_buffer, make_engine, open_scratch, timed_pass

logger = logging.getLogger("tba")

MAX_SIZE_BYTES = 1 << 62
"""No file is larger (posix_fallocate takes a signed 64-bit length)."""

DEFAULT_SIZE_BYTES = 2 * GIB
DEFAULT_BLOCK_SIZE_BYTES = MIB
BENCH_QUEUE_DEPTH = 32
"""fio's customary depth for a bandwidth test; the runtime's own default is :data:`tba.defaults.QUEUE_DEPTH`."""
BUFFER_BLOCKS_PER_SLOT = 2
"""The shared buffer holds this many blocks per queue slot; requests cycle through it."""

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the benchmark's options to ``parser``."""
    parser.add_argument("--size", type=parse_size, default=DEFAULT_SIZE_BYTES,
                        help="bytes to write then read, e.g. 512M or 2G (default 2G)")
    parser.add_argument("--block-size", type=parse_size, default=DEFAULT_BLOCK_SIZE_BYTES,
                        help="bytes per request, a multiple of 4096 (default 1M)")
    parser.add_argument("--queue-depth", type=cli_checks.queue_depth, default=BENCH_QUEUE_DEPTH,
                        help="requests in flight (default 32)")
    parser.add_argument("--directory", type=cli_checks.nonempty_path, default=None,
                        help="where the test file goes (default $TBA_DIR or the system temp dir); " + cli_checks.MISSING_REFUSED)
    parser.add_argument("--repeat", type=cli_checks.int_at_least(1), default=1,
                        help="runs per measurement; each column reports the best (default 1)")
    parser.add_argument("--no-fio", action="store_true", help="skip the fio reference run")
    parser.add_argument("--no-hugepages", action="store_true",
                        help="do not ask for transparent huge pages for the shared buffer")
    parser.add_argument("--json", action="store_true",
                        help="print a JSON object on stdout (the table then goes to stderr)")


def bench_engine(backend: str, fd: int, buffer: torch.Tensor, args: argparse.Namespace) -> dict:
    """Write then read the scratch file with ``backend``; return GB/s per direction."""
    result = {}
    with make_engine(backend, queue_depth=args.queue_depth) as engine:
        for op in (Op.WRITE, Op.READ):
            seconds = timed_pass(engine, op, fd, buffer, args.size, args.block_size)
            result[f"{op.value}_gbps"] = args.size / seconds / 1e9
            logger.info("bench-io: %-8s %-5s %.2f GB/s", backend, op.value, result[f"{op.value}_gbps"])
    return result


def bench_fio(fio: str, args: argparse.Namespace, *, label: str = "bench-io", rws: tuple[str, ...] = ("write", "read")) -> dict:
    """Run fio's io_uring engine with the same parameters; return GB/s per direction.

    ``label`` starts each progress line (the calling command's name); ``rws`` are the directions.
    """
    path = os.path.join(args.directory, f"tba-bench-fio.{os.getpid()}")
    result = {}
    try:
        for rw in rws:
            command = [
                fio, "--name=tba-bench", f"--filename={path}", f"--rw={rw}",
                f"--bs={args.block_size}", f"--iodepth={args.queue_depth}", f"--size={args.size}",
                "--ioengine=io_uring", "--direct=1", "--output-format=json",
            ]
            done = subprocess.run(command, capture_output=True, text=True, check=True)
            job = json.loads(done.stdout[done.stdout.index("{"):])["jobs"][0]
            result[f"{rw}_gbps"] = job[rw]["bw_bytes"] / 1e9
            logger.info("%s: %-8s %-5s %.2f GB/s", label, "fio", rw, result[f"{rw}_gbps"])
    finally:
        if os.path.exists(path):
            os.unlink(path)
    return result


def _best(runs: list[dict]) -> dict:
    return {key: max(run[key] for run in runs) for key in runs[0]}


def _table(report: dict) -> str:
    fio = report.get("fio") or {}
    lines = [f"{'backend':<10} {'write GB/s':>10} {'read GB/s':>10} {'write/fio':>10} {'read/fio':>10}"]
    for name, row in report["backends"].items():
        if "error" in row:
            lines.append(f"{name:<10} unavailable: {row['error']}")
            continue
        ratios = [
            f"{row[f'{d}_gbps'] / fio[f'{d}_gbps']:>10.0%}" if fio else f"{'-':>10}"
            for d in ("write", "read")
        ]
        lines.append(f"{name:<10} {row['write_gbps']:>10.2f} {row['read_gbps']:>10.2f} " + " ".join(ratios))
    if fio:
        lines.append(f"{'fio':<10} {fio['write_gbps']:>10.2f} {fio['read_gbps']:>10.2f}")
    else:
        lines.append(f"fio not run: {report['fio_not_run']}")
    return "\n".join(lines)


def _validate(args: argparse.Namespace) -> str | None:
    if args.block_size <= 0 or args.block_size % ALIGN_BYTES:
        return f"--block-size must be a positive multiple of {ALIGN_BYTES}"
    if args.size < args.block_size or args.size % args.block_size:
        return (f"--size {args.size} bytes is not a positive multiple of --block-size {args.block_size} bytes "
                f"({args.block_size / MIB:g} MiB); pass a --size that is, e.g. "
                f"--size {max(args.size // args.block_size, 1) * args.block_size}")
    if args.queue_depth < 1:
        return "--queue-depth must be >= 1"
    if args.repeat < 1:
        return f"--repeat must be >= 1, got {args.repeat}"
    try:
        args.directory = os.path.abspath(cli_checks.spill_directory(args.directory))
    except ValueError as err:
        return str(err)
    free = shutil.disk_usage(args.directory).free if os.path.isdir(args.directory) else MAX_SIZE_BYTES
    if args.size > min(free, MAX_SIZE_BYTES):
        return (f"--size {readable_size(args.size)} is more than the {readable_size(min(free, MAX_SIZE_BYTES))} free in "
                f"{args.directory}; pass a smaller --size or another --directory")
    return None


FIO_FAILED = "fio failed (its error is above)"
"""Why the fio columns are empty when fio ran and failed."""


def fio_skipped(no_fio: bool) -> str | None:
    """Why fio will not run (``--no-fio``, or not installed), or None when it will; bench-ckpt says it the same way."""
    if no_fio:
        return "--no-fio"
    return None if shutil.which("fio") else "fio is not installed (apt-get install fio)"


def run(args: argparse.Namespace) -> int:
    """Run the benchmark described by ``args``; print the table (and JSON). Returns exit status."""
    problem = _validate(args)
    if problem:
        cli_checks.usage_error("bench-io", problem)
    backends = available_backends()
    fio = None if args.no_fio else shutil.which("fio")
    fio_not_run = fio_skipped(args.no_fio)
    buffer_bytes = min(args.size, BUFFER_BLOCKS_PER_SLOT * args.queue_depth * args.block_size)
    logger.info("bench-io: %s in %d KiB blocks at queue depth %d in %s, best of %d, %s",
                readable_size(args.size), args.block_size >> 10, args.queue_depth, args.directory, args.repeat,
                "huge pages asked for" if not args.no_hugepages else "no huge pages")
    buffer = filled_buffer(buffer_bytes, hugepages=not args.no_hugepages)
    runs: dict[str, list[dict]] = {name: [] for name, reason in backends.items() if reason is None}
    fio_runs: list[dict] = []
    for _ in range(args.repeat):
        for name in runs:
            try:
                fd = open_scratch(args.directory, args.size)
            except OSError as err:
                logger.error("bench-io: cannot make a %s O_DIRECT scratch file in %s (opened, then reserved): %s%s",
                             readable_size(args.size), args.directory, err,
                             "; pass a smaller --size or another --directory" if err.errno in FULL_DISK_ERRNOS else "")
                return 1
            try:
                runs[name].append(bench_engine(name, fd, buffer, args))
            finally:
                os.close(fd)
        if fio:
            try:
                fio_runs.append(bench_fio(fio, args))
            except (subprocess.CalledProcessError, ValueError, KeyError) as err:
                detail = getattr(err, "stderr", "") or err
                logger.warning("bench-io: fio failed, reporting without it: %s", str(detail).strip()[-300:])
                fio, fio_not_run = None, FIO_FAILED
    report = {
        "size_bytes": args.size, "block_size_bytes": args.block_size,
        "queue_depth": args.queue_depth, "repeat": args.repeat, "hugepages": not args.no_hugepages,
        "backends": {name: _best(runs[name]) if reason is None else {"error": reason}
                     for name, reason in backends.items()},
        "fio": _best(fio_runs) if fio_runs else None,
        "fio_not_run": fio_not_run,
    }
    table = _table(report)
    if args.json:
        print(table, file=sys.stderr)
        print(json.dumps(report, indent=2))
    else:
        print(table)
    return 0
