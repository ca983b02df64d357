"""What each stage of tba's save costs the forward, one stage added at a time, in alternating rounds.

    python tools/hook_stages.py [--count 2000] [--size 64K] [--directory /dev/shm] [--rounds 9] [--json PATH]

The ``bench-hooks`` loop (``tba.bench.hooks.one_step``: each of ``--count`` leaves through ``torch.tanh`` inside
the context, reduced by ``sum()``, one backward after it) runs in four variants and without tba, their order
shuffled in every round so that each sees the same minutes of the machine, and prints each variant's forward
time against the loop without tba (extra µs per storage, the best and the median round):

* ``keep``: inside ``tba.keep_in_memory()``: every tensor goes through the pack hook's checks and stays.
* ``pack``: the pack hook as it is (view, version watch, deferral), its deferred save only keeping the
  tensor in its view (``SavedTensorHooks._save_job`` patched).
* ``bookkeeping``: the save as it is (entry, extent, window, finalizer, the write queued), but the host
  write heard at once as not needed (``HostBatch.write`` patched), so nothing goes to the engine and the
  storage stays in memory: the control thread's Python without the I/O.
* ``full``: tba as it is.

So ``pack`` less ``keep`` is the deferral and the view, ``bookkeeping`` less ``pack`` the save's Python, and
``full`` less ``bookkeeping`` the I/O (the batch, the engine's submissions and completions, the kernel's work).
The patches are the process's while a variant runs, and are undone after it. Timings are wall-clock on a
shared machine: compare the variants of one run. docs/host-cost.md (twenty-fifth pass) has the figures
that first split the forward so.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import sys
import tempfile
from collections.abc import Callable
from unittest import mock

import torch

from tba.bench.hooks import HookCase, one_step
from tba.cli import _checks as cli_checks
from tba.device import WRITE_NOT_NEEDED
from tba.runtime._hooks import SavedTensorHooks
from tba.runtime._host_io import HostBatch

VARIANTS = ("keep", "pack", "bookkeeping", "full")
"""The stages, each adding to the one before (see the module's docstring)."""


def _keep_only(self, view, tensor, *args) -> None:  # noqa: ANN001 - SavedTensorHooks._save_job's signature
    view.keep(tensor)


def _not_needed(self, data, phase_bytes, fd, offset, on_done, wanted=None) -> None:  # noqa: ANN001 - HostBatch.write's
    on_done(WRITE_NOT_NEEDED)


def _variant(name: str) -> contextlib.AbstractContextManager:
    """The patch variant ``name`` runs under (none for ``keep``, ``full`` and ``"base"``)."""
    if name == "pack":
        return mock.patch.object(SavedTensorHooks, "_save_job", _keep_only)
    if name == "bookkeeping":
        return mock.patch.object(HostBatch, "write", _not_needed)
    return contextlib.nullcontext()


def forward_seconds(leaves: list[torch.Tensor], name: str, directory: str) -> float:
    """One step of ``bench-hooks``' loop (:func:`tba.bench.hooks.one_step`) under variant ``name`` (or ``"base"``:
    without tba), its backward under the same patch; the forward's seconds."""
    case = None if name == "base" else HookCase(leaves[0].nbytes, len(leaves), directory, "stages",
                                                path="keep" if name == "keep" else "offload")
    with _variant(name):
        forward_s, _ = one_step(leaves, leaves[0], case)
    return forward_s


def measure(count: int, size_bytes: int, directory: str, rounds: int, warmups: int = 1,
            progress: Callable[[str], None] | None = None) -> dict[str, list[float]]:
    """Forward seconds per round of each variant and of ``"base"``, rounds shuffled, after ``warmups`` unmeasured."""
    leaves = [torch.randn(size_bytes // 4, requires_grad=True) for _ in range(count)]
    names = ["base", *VARIANTS]
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for index in range(warmups + rounds):
        order = random.sample(names, len(names))
        for name in order:
            elapsed = forward_seconds(leaves, name, directory)
            if index >= warmups:
                seconds[name].append(elapsed)
        if progress is not None:
            progress(f"round {index + 1} of {warmups + rounds}")
    return seconds


def report(seconds: dict[str, list[float]], count: int) -> list[tuple[str, float, float]]:
    """(variant, best, median) forward µs per storage over the loop without tba's best and median."""
    base = seconds["base"]
    return [(name, (min(seconds[name]) - min(base)) / count * 1e6,
             (statistics.median(seconds[name]) - statistics.median(base)) / count * 1e6) for name in VARIANTS]


def _size(text: str) -> int:
    value = cli_checks.positive_size(text)
    if value % 4:
        raise argparse.ArgumentTypeError(f"{text!r} must be a multiple of 4 bytes (float32 leaves)")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--count", type=cli_checks.int_at_least(1), default=2000, help="storages per step (default 2000)")
    parser.add_argument("--size", type=_size, default=1 << 16, help="bytes per storage: 64K, 1M, ... (default 64K)")
    parser.add_argument("--directory", default=None,
                        help="where a fresh spill directory is made (default /dev/shm: RAM-backed, no disk cost)")
    parser.add_argument("--rounds", type=cli_checks.int_at_least(1), default=9,
                        help="measured rounds of every variant (default 9)")
    parser.add_argument("--json", metavar="PATH", help="also write every round's forward seconds to PATH")
    args = parser.parse_args(argv)
    parent = args.directory or "/dev/shm"
    try:
        cli_checks.existing_directory("--directory", parent)
        if args.json:
            cli_checks.output_file("--json", args.json)
    except ValueError as err:
        parser.error(str(err))
    with tempfile.TemporaryDirectory(prefix="tba-hook-stages-", dir=parent) as directory:
        seconds = measure(args.count, args.size, directory, args.rounds,
                          progress=lambda text: print(text, file=sys.stderr, flush=True))
    print(f"forward, extra us per storage against the loop without tba ({args.count} x {args.size} bytes in "
          f"{parent}, {args.rounds} rounds, torch threads {torch.get_num_threads()}):")
    print(f"{'variant':12s} {'best':>8s} {'median':>8s}")
    for name, best, median in report(seconds, args.count):
        print(f"{name:12s} {best:8.1f} {median:8.1f}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"count": args.count, "size_bytes": args.size, "directory": parent, "seconds": seconds}, out,
                      indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
