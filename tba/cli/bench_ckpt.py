"""Training stall and write bandwidth of checkpoints: torch.save, DCP, tba's writer and lazy mode.

A GPT built from ``tba.bench.models`` is sized so that its fp32 parameters plus Adam's two moments
total about ``--size``, and trained on one short batch per step (batch 1, sequence 64). Every
method takes ``--rounds`` measured checkpoints (after one warm-up) of ``{"model": ...,
"optim": ...}``, one every ``STEPS_PER_CHECKPOINT`` steps, right after an optimizer step. The
*stall* is the time the training loop is blocked per checkpoint:

* ``torch.save``: the call plus ``fsync`` of the file (durable, as DCP's writer is);
* ``dcp.save`` with ``FileSystemWriter``: the call;
* ``dcp.async_save`` with ``FileSystemWriter`` or with ``TbaStorageWriter`` (both staging with
  DCP's ``BlockingAsyncStager`` defaults; ``cache_staged_state_dict=True`` pins memory, which a
  CPU-only build refuses): the call, plus any wait for the previous checkpoint to finish before
  the next one starts;
* tba's lazy mode (``LazyCheckpointer``, whose host buffer the warm-up checkpoint allocates):
  the call, plus the wait for the snapshot before the next optimizer step, plus any wait for the
  previous one.

``tba_write_gbps`` is the lazy writer's data bytes over the time from opening its file to its
``fsync`` (copy overlapped). fio (``ioengine=io_uring``, ``direct=1``, same block size and
queue depth) writes ``--size`` bytes in the same run. ``restore_exact`` loads the last lazy
checkpoint with DCP's own ``FileSystemReader`` and with ``TbaStorageReader`` and compares every
tensor with a copy taken at save time (``torch.equal``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from tba._units import parse_size, readable_size
from tba.bench.models import GPTConfig, make_batch, make_gpt
from tba.checkpoint import DEFAULT_CHUNK_BYTES, DEFAULT_QUEUE_DEPTH, LazyCheckpointer, TbaStorageReader, TbaStorageWriter
from tba.cli import _checks as cli_checks
from tba.cli.bench_io import FIO_FAILED, bench_fio, fio_skipped

logger = logging.getLogger("tba")

MIN_SIZE_BYTES = 16 << 20
STEPS_PER_CHECKPOINT = 2
LAYERS = 12
VOCAB = 8192
SEQ_LEN = 64
METHODS = ("torch_save", "dcp_save", "dcp_async", "tba_async", "tba_lazy")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the benchmark's options to ``parser``."""
    parser.add_argument("--size", default="1G", help="state dict bytes, e.g. 256M or 1G (default 1G)")
    parser.add_argument("--directory", type=cli_checks.nonempty_path, default=None,
                        help="where checkpoints go (default $TBA_DIR or the system temp dir); " + cli_checks.MISSING_REFUSED)
    parser.add_argument("--rounds", type=cli_checks.int_at_least(1), default=2,
                        help="measured checkpoints per method (default 2)")
    parser.add_argument("--json", type=cli_checks.nonempty_path,
                        metavar="PATH", default=None, help="also write the results as JSON to PATH")
    parser.add_argument("--no-fio", action="store_true", help="skip the fio reference run")


def gpt_config(size_bytes: int) -> GPTConfig:
    """A GPT whose parameters plus two Adam moments (12 bytes per parameter) total about ``size_bytes``."""
    params = size_bytes / 12
    width = 64
    while 12 * LAYERS * (width + 64) ** 2 + 2 * VOCAB * (width + 64) <= params:
        width += 64
    return GPTConfig(vocab_size=VOCAB, seq_len=SEQ_LEN, width=width, layers=LAYERS, heads=width // 64,
                     dropout=0.0, batch_size=1)


def _validate(args: argparse.Namespace) -> str | None:
    try:
        args.size_bytes = parse_size(args.size)
    except argparse.ArgumentTypeError as err:
        return f"argument --size: {err}"
    if args.size_bytes < MIN_SIZE_BYTES:
        return f"--size must be at least {MIN_SIZE_BYTES >> 20}M"
    where = "--directory" if args.directory is not None else "$TBA_DIR" if os.environ.get("TBA_DIR") else "the temp dir"
    try:  # a missing directory is refused, as bench-io and bench-hooks do: nothing is left behind
        args.directory = os.path.abspath(cli_checks.spill_directory(args.directory))
        if getattr(args, "json", None):
            cli_checks.output_file("--json", args.json)
    except ValueError as err:
        return str(err)
    free = shutil.disk_usage(args.directory).free
    if free < 3 * args.size_bytes:
        return (f"{where} {args.directory} has {readable_size(free)} free; --size {readable_size(args.size_bytes)} needs "
                f"3x that ({readable_size(3 * args.size_bytes)}) there: pass a smaller --size or another --directory")
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if available < 6 * args.size_bytes:
        return (f"{readable_size(available)} of free memory; --size {readable_size(args.size_bytes)} needs about 6x that "
                f"({readable_size(6 * args.size_bytes)}): pass a smaller --size")
    return None


class _Trainer:
    def __init__(self, config: GPTConfig) -> None:
        self.model = make_gpt(config)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-4)
        self.batch = make_batch(config)
        self.step_s: list[float] = []

    def forward_backward(self) -> None:
        self.model(*self.batch).backward()

    def step(self, before_step: Callable[[], float] = lambda: 0.0) -> float:
        """Forward, backward and optimizer step; returns the stall ``before_step`` reported."""
        start = time.perf_counter()
        self.forward_backward()
        stall = before_step()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step_s.append(time.perf_counter() - start)
        return stall

    def state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.optimizer.state_dict()}


def _run_method(name: str, trainer: _Trainer, root: str, rounds: int) -> dict[str, float]:
    stalls: list[float] = []
    pending: list[Callable[[], None]] = []
    lazy = LazyCheckpointer() if name == "tba_lazy" else None
    writers = {"dcp_async": FileSystemWriter, "tba_async": TbaStorageWriter}
    writer = writers[name](root) if name in writers else None
    write_gbps: list[float] = []
    try:
        for index in range(rounds + 1):
            path = os.path.join(root, f"{name}-{index % 2}")
            trainer.step()
            start = time.perf_counter()
            while pending:
                pending.pop()()
            waiter: Callable[[], float] = lambda: 0.0
            if name == "torch_save":
                with open(path, "wb") as stream:
                    torch.save(trainer.state(), stream)
                    stream.flush()
                    os.fsync(stream.fileno())
            elif name == "dcp_save":
                dcp.save(trainer.state(), storage_writer=FileSystemWriter(path), no_dist=True)
            elif writer is not None:
                future = dcp.async_save(trainer.state(), checkpoint_id=path, storage_writer=writer, no_dist=True)
                pending.append(future.result)
                if isinstance(writer, TbaStorageWriter) and index > 0:
                    future.add_done_callback(lambda _: write_gbps.append(
                        writer.last_write_bytes / writer.last_write_s / 1e9))
            else:
                handle = lazy.save(trainer.state(), path, on_done=(lambda h: write_gbps.append(
                    h.bytes_written / h.write_s / 1e9)) if index > 0 else None)
                waiter = handle.wait_snapshot
                pending.append(handle.wait)
            stall = time.perf_counter() - start
            for _ in range(STEPS_PER_CHECKPOINT):
                stall += trainer.step(waiter)
                waiter = lambda: 0.0
            if index > 0:
                stalls.append(stall)
            logger.info("bench-ckpt: %-10s checkpoint %d/%d stall %.3f s%s", name, index, rounds, stall,
                        " (warm-up)" if index == 0 else "")
        while pending:
            pending.pop()()
    except BaseException:
        # Note: [A save in the background is waited for before its directory goes]
        # A signal (or any error) in the step after dcp.async_save or a lazy save started left the save's thread
        # writing into the scratch directory run() then removed, which its writes created again
        # (tba-bench-ckpt-*/tba_async-0/ left behind after `timeout -s TERM 7`). Every save started is waited for
        # first, whatever it raises; a second signal during that wait ends the command as the first would have.
        for wait in pending:
            with contextlib.suppress(BaseException):
                wait()
        raise
    result = {f"{name}_stall_s": sum(stalls) / len(stalls)}
    if write_gbps:
        result[f"{name}_write_gbps"] = max(write_gbps)
    if lazy is not None:
        result["restore_exact"] = _check_restore(trainer, lazy, root)
        lazy.close()
    if writer is not None:
        writer.close()
    return result


def _check_restore(trainer: _Trainer, lazy: LazyCheckpointer, root: str) -> bool:
    expected = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    optim = trainer.optimizer.state_dict()
    expected_optim = {i: {k: v.clone() for k, v in s.items()} for i, s in optim["state"].items()}
    path = os.path.join(root, "restore")
    handle = lazy.save(trainer.state(), path)
    trainer.step(handle.wait_snapshot)
    handle.wait()
    exact = True
    for reader in (FileSystemReader(path), TbaStorageReader(path)):
        target = {"model": {k: torch.zeros_like(v) for k, v in expected.items()},
                  "optim": {"state": {i: {k: torch.zeros_like(v) for k, v in s.items()}
                                      for i, s in expected_optim.items()},
                            "param_groups": optim["param_groups"]}}
        dcp.load(target, storage_reader=reader, no_dist=True)
        exact &= all(torch.equal(target["model"][k], v) for k, v in expected.items())
        exact &= all(torch.equal(target["optim"]["state"][i][k], v)
                     for i, s in expected_optim.items() for k, v in s.items())
    return exact


def _fio(args: argparse.Namespace) -> float | None:
    fio = shutil.which("fio")
    if args.no_fio or fio is None:
        return None
    fio_args = argparse.Namespace(directory=args.directory, block_size=DEFAULT_CHUNK_BYTES,
                                  queue_depth=DEFAULT_QUEUE_DEPTH, size=args.size_bytes)
    try:
        return bench_fio(fio, fio_args, label="bench-ckpt", rws=("write",))["write_gbps"]
    except (subprocess.CalledProcessError, ValueError, KeyError) as err:
        logger.warning("bench-ckpt: fio failed, reporting without it: %s", str(err)[-300:])
        return None


LABELS = {"torch_save": "torch.save + fsync", "dcp_save": "dcp.save FileSystemWriter",
          "dcp_async": "dcp.async_save FileSystemWriter", "tba_async": "dcp.async_save TbaStorageWriter",
          "tba_lazy": "tba lazy (save_lazy)"}
"""Each method's name in the table and in errors."""


def _table(report: dict[str, Any]) -> str:
    torch_stall = report["torch_save_stall_s"]
    lines = [f"{'method':<34} {'stall s':>9} {'x torch.save':>13}"]
    for method in METHODS:
        stall = report[f"{method}_stall_s"]
        lines.append(f"{LABELS[method]:<34} {stall:>9.4f} {stall / torch_stall:>13.4f}")
    fio = report["fio_write_gbps"]
    lines.append(f"tba lazy write {report['tba_write_gbps']:.2f} GB/s, tba async write "
                 f"{report['tba_async_write_gbps']:.2f} GB/s, fio write "
                 + (f"{fio:.2f} GB/s ({report['tba_write_gbps'] / fio:.0%} of fio)" if fio
                    else f"not run ({report['fio_not_run']})"))
    lines.append(f"lazy stall / dcp.async_save stall: {report['tba_lazy_stall_s'] / report['dcp_async_stall_s']:.3f}; "
                 f"restore exact: {report['restore_exact']}; step {report['step_s']:.3f} s; "
                 f"state {report['state_bytes'] / 1e9:.2f} GB")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark described by ``args``; print the table (and write JSON). Returns exit status."""
    problem = _validate(args)
    if problem:
        cli_checks.usage_error("bench-ckpt", problem)
    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    warnings.filterwarnings("ignore", message="Detected an existing checkpoint")
    config = gpt_config(args.size_bytes)
    trainer = _Trainer(config)
    state_bytes = 3 * sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    logger.info("bench-ckpt: GPT width %d, %d layers: %.2f GB of parameters + Adam states in %s",
                config.width, config.layers, state_bytes / 1e9, args.directory)
    report: dict[str, Any] = {"size_bytes": args.size_bytes, "state_bytes": state_bytes, "rounds": args.rounds}
    root = tempfile.mkdtemp(prefix="tba-bench-ckpt-", dir=args.directory)
    try:
        for method in METHODS:
            try:
                report.update(_run_method(method, trainer, root, args.rounds))
            except BaseException as err:  # DCP's CheckpointException is a BaseException
                full = cli_checks.disk_full_in(err)
                if full is None:
                    raise
                sys.stderr.write(f"python -m tba bench-ckpt: error: writing a checkpoint with {LABELS[method]} in "
                                 f"{args.directory} failed: {os.strerror(full.errno)}; free space there, or pass a "
                                 "smaller --size or another --directory\n")
                return 1
            shutil.rmtree(root, ignore_errors=True)
            os.makedirs(root, exist_ok=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report["tba_write_gbps"] = report.pop("tba_lazy_write_gbps")
    report["step_s"] = sorted(trainer.step_s)[len(trainer.step_s) // 2]
    report["fio_not_run"] = fio_skipped(args.no_fio)
    if report["fio_not_run"] is None:
        logger.info("bench-ckpt: fio write, %d MiB", args.size_bytes >> 20)
    report["fio_write_gbps"] = _fio(args)
    if report["fio_write_gbps"] is None and report["fio_not_run"] is None:
        report["fio_not_run"] = FIO_FAILED
    print(_table(report))
    if args.json:
        with open(args.json, "w") as stream:
            json.dump(report, stream, indent=2)
    if not report["restore_exact"]:  # a script or CI reading only the status must not take this run as good
        logger.error("bench-ckpt: the restored model or optimizer state differs from the state saved; this is a bug "
                     "in tba, please report it with this output")
        return 1
    return 0
