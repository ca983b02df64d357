#!/usr/bin/env python3
"""Soak test: a small GPT trained for many steps under random injected faults, per I/O backend.

Faults, drawn at random for each step:

* engine errors: the engine fails a fraction of its requests (writes with ENOSPC, which tba
  answers by keeping those tensors in memory; reads with EIO, which raise ``TbaReadError``);
* asynchronous exceptions: a one-shot timer signal whose handler raises, at a random point of the
  step (forward, backward, or tba's own bookkeeping);
* dropped losses: forward runs, backward never does.

Every layer is offloaded (``policy="offload"``), and half the steps wait for their writes before
backward (``flush()``), so that backward reads the file and read faults can strike.

Checked: every step that completed has gradients ``torch.equal`` to a reference computed without
tba; no spill file and no descriptor is left once the offloader and engine are closed; RSS at the
end is within a tolerance of RSS after warm-up. Prints progress, then one summary line per backend;
exits with status 1 when any check fails. Not part of CI (minutes, not seconds).

Example:
    python tools/soak.py --steps 500 --backend io_uring
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import gc
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future

import torch

import tba
from tba._control import settle
from tba.bench.models import PRESETS, make_batch, make_gpt
from tba.cli import _checks as cli_checks
from tba.errors import TbaError, TbaReadError
from tba.io import Engine, Op, Request, available_backends, make_engine

MIB = 1 << 20
BATCHES = 4
"""Distinct batches (and dropout seeds) the steps cycle through, each with its own reference."""


class InjectedInterrupt(Exception):
    """Raised by the timer signal's handler."""


class FlakyEngine(Engine):
    """Wraps a real engine; fails each write with ENOSPC and each read with EIO at the given rates."""

    name = "flaky"

    def __init__(self, inner: Engine, write_rate: float, read_rate: float, seed: int) -> None:
        self.inner = inner
        self.rates = {Op.WRITE: write_rate, Op.READ: read_rate}
        self.active = False
        """Faults are injected only while this is set (not during warm-up)."""
        self.failed = 0
        self._rng = random.Random(seed)
        self._lock = threading.Lock()

    def submit_many(self, requests: Sequence[Request]) -> list[Future]:
        with self._lock:
            fail = [self.active and self._rng.random() < self.rates[r.op] for r in requests]
        passed = iter(self.inner.submit_many([r for r, f in zip(requests, fail) if not f]))
        futures = []
        for request, failing in zip(requests, fail):
            if failing:
                code = errno.ENOSPC if request.op is Op.WRITE else errno.EIO
                future: Future = Future()
                future.set_exception(OSError(code, os.strerror(code)))
                self.failed += 1
                futures.append(future)
            else:
                futures.append(next(passed))
        return futures

    def close(self) -> None:
        self.inner.close()



DISCARDED_REENTRY = "this offloader cannot be entered again"
"""How entering an Offloader whose previous with block raised begins (``Offloader._not_idle_message``):
a signal that lands inside the block retires the offloader, and the soak builds a new one."""


def is_discarded_reentry(err: BaseException) -> bool:
    """Whether ``err`` is the expected refusal to enter an offloader a signal's exception retired."""
    return isinstance(err, TbaError) and str(err).startswith(DISCARDED_REENTRY)

def raise_injected(signum: int, frame: object) -> None:
    raise InjectedInterrupt


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def soak(backend: str, args: argparse.Namespace) -> bool:
    """Run ``args.steps`` faulty steps on ``backend``; print progress and a summary; True when all checks pass."""
    torch.manual_seed(0)
    config = PRESETS["tiny"]
    model = make_gpt(config)
    batches = [make_batch(config, seed=i) for i in range(BATCHES)]

    def step(index: int, ctx: object, drop: bool = False, written_first: bool = False) -> list[torch.Tensor] | None:
        model.zero_grad(set_to_none=True)
        torch.manual_seed(index % BATCHES)
        with ctx:
            loss = model(*batches[index % BATCHES])
            if written_first:
                ctx.flush()  # every write done before backward, which then reads the file
        if drop:
            return None
        loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    want = [step(i, contextlib.nullcontext()) for i in range(BATCHES)]
    rng = random.Random(args.seed)
    settle()
    fds_before = set(os.listdir("/proc/self/fd"))
    engine = FlakyEngine(make_engine(backend), args.write_fault_rate, args.read_fault_rate, args.seed)
    directory = tempfile.mkdtemp(prefix="tba-soak-", dir=args.directory)  # after the engine: nothing left if it fails

    def new_offloader() -> tba.Offloader:
        # Offload-all: the adaptive default plans keep-all for so small a model, and nothing would be
        # written or read back.
        return tba.Offloader(directory, backend=engine, layers=list(model.blocks), min_offload_bytes=0,
                             policy="offload")

    off = None
    try:
        off = new_offloader()
        step(0, off)
        start = time.perf_counter()
        for i in range(3):
            step(i, off)
        step_s = (time.perf_counter() - start) / 3
        engine.active = True
        signal.signal(signal.SIGALRM, raise_injected)
        counts = dict(completed=0, exact=0, wrong=0, signals=0, read_faults=0, dropped=0, reopened=0, unexpected=0)
        warm_rss = None
        warmup = max(1, args.steps // 10)
        for index in range(args.steps):
            drop = rng.random() < args.drop_rate
            written_first = rng.random() < 0.5
            timer_s = rng.uniform(0.0001, 1.5 * step_s) if rng.random() < args.signal_rate else 0.0
            try:
                try:
                    signal.setitimer(signal.ITIMER_REAL, timer_s)
                    grads = step(index, off, drop, written_first)
                finally:
                    signal.setitimer(signal.ITIMER_REAL, 0)
                if drop:
                    counts["dropped"] += 1
                else:
                    counts["completed"] += 1
                    same = all(torch.equal(g, w) for g, w in zip(grads, want[index % BATCHES]))
                    counts["exact" if same else "wrong"] += 1
            except InjectedInterrupt:
                counts["signals"] += 1
            except TbaReadError:
                counts["read_faults"] += 1
            except TbaError as err:
                if not is_discarded_reentry(err):
                    counts["unexpected"] += 1
                    print(f"  step {index}: unexpected {type(err).__name__}: {err}", flush=True)
                off.close()
                off = new_offloader()
                counts["reopened"] += 1
            except Exception as err:  # noqa: BLE001 - a soak test reports whatever escapes
                counts["unexpected"] += 1
                print(f"  step {index}: unexpected {type(err).__name__}: {err}", flush=True)
            grads = None
            if index + 1 == warmup:
                gc.collect()
                warm_rss = rss_bytes()
            if (index + 1) % args.progress_every == 0 or index + 1 == args.steps:
                print(f"  {backend} step {index + 1}/{args.steps}: " + ", ".join(f"{k} {v}" for k, v in counts.items())
                      + f", rss {rss_bytes() / MIB:.1f} MiB", flush=True)
    except BaseException:  # Ctrl-C, SIGTERM (main), a crash: the spill directory goes with the run
        signal.setitimer(signal.ITIMER_REAL, 0)
        for opened in (off, engine):
            with contextlib.suppress(Exception):
                if opened is not None:
                    opened.close()
        shutil.rmtree(directory, ignore_errors=True)
        raise
    off.close()
    engine.close()
    off = engine = None
    gc.collect()
    settle()
    end_rss = rss_bytes()
    fds_left = sorted(set(os.listdir("/proc/self/fd")) - fds_before)
    files_left = os.listdir(directory)
    if not files_left:
        os.rmdir(directory)
    rss_ok = end_rss - warm_rss <= max(args.rss_tolerance_mib * MIB, warm_rss // 20)
    ok = counts["wrong"] == 0 and counts["unexpected"] == 0 and not fds_left and not files_left and rss_ok
    faulted = counts["signals"] + counts["read_faults"] + counts["reopened"] + counts["unexpected"]
    print(f"soak {backend}: {args.steps} steps: completed {counts['completed']} (exact {counts['exact']}, wrong "
          f"{counts['wrong']}), faulted {faulted} (signals {counts['signals']}, read faults {counts['read_faults']}, "
          f"reopened after a discarded step {counts['reopened']}, unexpected {counts['unexpected']}), "
          f"dropped {counts['dropped']}; fds left {len(fds_left)}, files left "
          f"{len(files_left)}; RSS after warm-up {warm_rss / MIB:.1f} MiB, at end {end_rss / MIB:.1f} MiB "
          f"({(end_rss - warm_rss) / MIB:+.1f}): {'PASS' if ok else 'FAIL'}", flush=True)
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=cli_checks.int_at_least(1), default=500, help="steps per backend (default: 500)")
    parser.add_argument("--backend", default="all", help="io_uring, threads, or all available (default: all)")
    parser.add_argument("--directory", default=None, help="where the spill directory is made (default: temp dir)")
    parser.add_argument("--write-fault-rate", type=cli_checks.fraction, default=0.01,
                        help="fraction of write requests that fail with ENOSPC (default: 0.01)")
    parser.add_argument("--read-fault-rate", type=cli_checks.fraction, default=0.2,
                        help="fraction of read requests that fail with EIO (default: 0.2)")
    parser.add_argument("--signal-rate", type=cli_checks.fraction, default=0.3,
                        help="fraction of steps interrupted by a timer-signal exception (default: 0.3)")
    parser.add_argument("--drop-rate", type=cli_checks.fraction, default=0.1,
                        help="fraction of steps whose loss is dropped (default: 0.1)")
    parser.add_argument("--rss-tolerance-mib", type=float, default=32.0,
                        help="allowed RSS growth after warm-up, MiB (or 5%% of RSS if larger; default: 32)")
    parser.add_argument("--progress-every", type=cli_checks.int_at_least(1), default=50,
                        help="steps between progress lines (default: 50)")
    parser.add_argument("--seed", type=int, default=0, help="random seed of the faults (default: 0)")
    args = parser.parse_args(argv)
    usable = [name for name, reason in available_backends().items() if reason is None]
    if args.backend not in ("all", "auto", *usable):
        parser.error(f"--backend {args.backend!r} is not usable here; choose all or one of {', '.join(usable)}")
    if args.directory is not None:
        try:
            cli_checks.existing_directory("--directory", args.directory)
        except ValueError as err:
            parser.error(str(err))
    torch.set_num_threads(1)
    backends = usable if args.backend == "all" else [args.backend]
    previous = signal.signal(signal.SIGTERM, _terminated)  # timeout, a cancelled job: end through the cleanup
    previous_alarm = signal.getsignal(signal.SIGALRM)  # soak() makes SIGALRM raise its injected interrupt
    try:
        results = [soak(backend, args) for backend in backends]
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGALRM, previous_alarm)
    return 0 if all(results) else 1


def _terminated(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    sys.exit(main())
