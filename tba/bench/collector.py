"""The cycle collector's cost of the ``bench-hooks`` loop, with and without tba, each in a process of its own.

``bench-hooks`` runs its two loops interleaved in one process, so that both see the same machine;
but the cycle collector's full collections are triggered by what *both* loops leave alive (the
objects promoted since the last full one, against a quarter of those that survived it), and each
lands in whichever loop crosses the line, so its per-loop figures split them by chance. Here each
loop runs ``steps`` steps after ``warmups`` alone, in a fresh interpreter (``python -m
tba.bench.collector``), as a training script would: the full collections a loop's own objects bring
are its own (docs/host-cost.md, sixteenth pass).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import os
import subprocess
import sys
import tempfile

import torch

import tba
from tba.bench import hooks
from tba.bench.gc_clock import CollectorClock


@dataclasses.dataclass(frozen=True)
class AloneResult:
    """One loop run alone: means per storage and step over the measured steps."""

    with_tba: bool
    count: int
    size_bytes: int
    steps: int
    step_us: float
    """Wall microseconds per storage of a whole step (forward, backward, tba's bookkeeping after it)."""
    collector_us: float
    """Microseconds per storage and step that the cycle collector ran."""
    full_collections: int
    """Full collections over the measured steps."""


class AloneRunError(RuntimeError):
    """A loop run alone failed in its process, or printed no result; the message ends with its stderr."""


def loop_alone(count: int, size_bytes: int, directory: str | None, steps: int, warmups: int = 2,
               hold_outputs: bool = False) -> AloneResult:
    """Run the ``bench-hooks`` loop (:func:`~tba.bench.hooks.one_step`) in this process: under tba when ``directory``
    is given, else without it; ``hold_outputs`` as ``bench-hooks --hold-outputs`` (the outputs, not their sums, are
    kept until backward)."""
    leaves = [torch.randn(size_bytes // 4, requires_grad=True) for _ in range(count)]
    grad = torch.ones(size_bytes // 4)
    case = None if directory is None else hooks.HookCase(size_bytes, count, directory, "alone", hold_outputs=hold_outputs)
    clock = CollectorClock()
    total_s = collector_s = 0.0
    full = 0
    for step in range(warmups + steps):
        with clock:
            forward_s, backward_s = hooks.one_step(leaves, grad, case, hold_outputs)
        if step >= warmups:
            total_s += forward_s + backward_s
            collector_s += clock.seconds
            full += clock.full
    per_storage = 1e6 / (steps * count)
    return AloneResult(directory is not None, count, size_bytes, steps, total_s * per_storage,
                       collector_s * per_storage, full)


def measure_alone(count: int, size_bytes: int, directory: str, steps: int, warmups: int = 2, *,
                  hold_outputs: bool = False, intra_op_threads: int | None = None,
                  gc_freeze: bool = False) -> list[AloneResult]:
    """:func:`loop_alone` with tba (in ``directory``) and without, each in a fresh interpreter of its own, under
    the same settings as the table's loops: ``hold_outputs``, ``intra_op_threads`` (``torch.set_num_threads``)
    and ``gc_freeze`` (``gc.freeze()`` before the loop). The children inherit this process's environment (its
    malloc preload among it) and import this process's tba (its root leads their ``PYTHONPATH``)."""
    options = ["--count", str(count), "--size-bytes", str(size_bytes), "--steps", str(steps), "--warmups", str(warmups)]
    options += ["--hold-outputs"] * hold_outputs + ["--gc-freeze"] * gc_freeze
    options += ["--intra-op-threads", str(intra_op_threads)] if intra_op_threads is not None else []
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(tba.__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    results = []
    for where in (directory, None):
        command = [sys.executable, "-m", "tba.bench.collector", *options] + (["--directory", where] if where else [])
        done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
        lines = done.stdout.strip().splitlines()
        try:
            if done.returncode != 0 or not lines:
                raise ValueError
            results.append(AloneResult(**json.loads(lines[-1])))
        except (ValueError, TypeError):
            raise AloneRunError(f"the loop alone {'with' if where else 'without'} tba failed (exit status "
                                f"{done.returncode}; {' '.join(command)}): {done.stderr.strip()[-2000:]}") from None
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tba.bench.collector",
                                     description="One bench-hooks loop alone in this process; prints one JSON line.")
    parser.add_argument("--count", type=int, required=True, help="storages per step")
    parser.add_argument("--size-bytes", type=int, required=True, help="bytes per storage")
    parser.add_argument("--steps", type=int, required=True, help="measured steps")
    parser.add_argument("--warmups", type=int, default=2, help="unmeasured steps first (default 2)")
    parser.add_argument("--directory", default=None, help="run under tba, spilling here (default: without tba)")
    parser.add_argument("--hold-outputs", action="store_true", help="keep the outputs until backward, not their sums")
    parser.add_argument("--intra-op-threads", type=int, default=None, help="torch.set_num_threads(N) first")
    parser.add_argument("--gc-freeze", action="store_true", help="gc.freeze() before the loop")
    args = parser.parse_args(argv)
    if min(args.count, args.size_bytes, args.steps) < 1 or args.warmups < 0:
        parser.error("--count, --size-bytes and --steps must be >= 1 and --warmups >= 0")
    if args.intra_op_threads is not None and args.intra_op_threads < 1:
        parser.error("--intra-op-threads must be >= 1")
    if args.intra_op_threads is not None:
        torch.set_num_threads(args.intra_op_threads)
    if args.gc_freeze:
        gc.collect()
        gc.freeze()
    loop = functools.partial(loop_alone, args.count, args.size_bytes, steps=args.steps, warmups=args.warmups,
                             hold_outputs=args.hold_outputs)
    if args.directory is None:
        result = loop(None)
    else:
        with tempfile.TemporaryDirectory(prefix="tba-collector-", dir=args.directory) as directory:
            result = loop(directory)
    print(json.dumps(dataclasses.asdict(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
