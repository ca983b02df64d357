"""A/B on a GPU: the device path's host cost per storage with and without shared staging blocks.

    python tools/ab_block_groups.py [--rounds 2] [bench-hooks options, default --sizes 64K,1M --counts 400 --no-disk]

Runs ``python -m tba bench-hooks --device cuda`` in this process, alternating rounds with staged
transfers grouped into shared blocks (tba's behaviour, Note [Storages queued together share a
block] in ``tba/device/_block_groups.py``) and with every storage alone in its block (the
behaviour before, the groups' ``takes`` patched to refuse), so both sides see the same machine
minute. Prints each round's table under its label. The groups were built and tested on the
simulated device, where they cut the CUDA calls per 64 KiB storage (``tests/device/test_sim_call_counts.py``);
what that saves in host microseconds needs a GPU: this script is that measurement.
Exits 2 without CUDA.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator

import torch

from tba.cli import bench_hooks
from tba.device._block_groups import BlockGroup, ReadGroup

DEFAULT_BENCH = ["--sizes", "64K,1M", "--counts", "400", "--no-disk", "--no-keep"]


@contextlib.contextmanager
def storages_alone() -> Iterator[None]:
    """Every staged storage takes a block of its own, as before the groups."""
    saved = BlockGroup.takes, ReadGroup.takes
    BlockGroup.takes = ReadGroup.takes = lambda self, job: False
    try:
        yield
    finally:
        BlockGroup.takes, ReadGroup.takes = saved


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--rounds", type=int, default=2, help="rounds of each side, alternating (default 2)")
    args, bench = parser.parse_known_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if not torch.cuda.is_available():
        print("ab_block_groups: needs a CUDA device (the staged route runs only for CUDA storages)", file=sys.stderr)
        return 2
    hooks = argparse.ArgumentParser(prog="bench-hooks")
    bench_hooks.add_arguments(hooks)
    options = hooks.parse_args([*(bench or DEFAULT_BENCH), "--device", "cuda"])
    status = 0
    for round_index in range(args.rounds):
        for label, context in (("grouped", contextlib.nullcontext()), ("alone", storages_alone())):
            print(f"== round {round_index + 1}, {label}", flush=True)
            with context:
                status = bench_hooks.run(options) or status
    return status


if __name__ == "__main__":
    sys.exit(main())
