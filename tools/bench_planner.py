"""Time the adaptive planner (``tba.policy.Adaptive.plan``, what the runtime calls per new input shape).

Builds a synthetic but realistic :class:`tba.Profile` per layer count (a GPT-like block: forward about
10 ms with a seeded jitter, backward about twice that, 96 MiB saved and 12 MiB of input per layer, an NVMe
disk writing 1.5 GB/s and reading 2.5 GB/s, a profile's calibrations) and prints, per layer count and goal,
the seconds one plan takes (the best of ``--repeat`` runs) and the plan chosen. Pure: no torch, no disk.

    python tools/bench_planner.py --layers 24,48,96,192
    python tools/bench_planner.py --layers 96 --profile    # cProfile's top functions for one plan
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import time

from tba.errors import TbaConfigError
from tba.policy import Adaptive, LayerProfile, Profile

MIB = 1 << 20
GB = 10**9


def realistic_profile(layer_count: int, seed: int = 0) -> Profile:
    """A GPT-like profile of ``layer_count`` blocks (seconds, bytes, bytes per second)."""
    rng = random.Random(seed)
    layers = []
    for _ in range(layer_count):
        forward_s = 0.010 * rng.uniform(0.9, 1.1)
        layers.append(LayerProfile(forward_s=forward_s, backward_s=2 * forward_s * rng.uniform(0.95, 1.05),
                                   saved_bytes=int(96 * MIB * rng.uniform(0.98, 1.02)), input_bytes=12 * MIB,
                                   backward_measured=True))
    return Profile(tuple(layers), write_bytes_per_s=1.5 * GB, read_bytes_per_s=2.5 * GB, max_storage_bytes=12 * MIB,
                   memory_slack_bytes=64 * MIB, memory_headroom_per_io_byte=0.05, io_overhead_s_per_byte=2e-12,
                   outside_s=0.05)


def goals(profile: Profile) -> dict[str, Adaptive]:
    """The default goal and a memory budget of 30% of keep-all's activations."""
    keep_bytes = sum(layer.saved_bytes for layer in profile.layers)
    return {"default (overhead_bound=0.05)": Adaptive(),
            "memory_budget=0.3x keep-all": Adaptive(memory_budget_bytes=int(0.3 * keep_bytes))}


def layer_counts(text: str) -> list[int]:
    """``--layers``: comma-separated whole numbers >= 1."""
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"give layer counts >= 1 separated by commas, such as 24,48, got {text!r}")
    return counts


def positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"give a whole number >= 1, got {text!r}")
    return int(text)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=layer_counts, default="24,48,96,192",
                        help="comma-separated layer counts (default: %(default)s)")
    parser.add_argument("--repeat", type=positive, default=1, help="runs per plan, the best is printed (default: %(default)s)")
    parser.add_argument("--profile", action="store_true", help="print cProfile's top 15 functions per plan")
    args = parser.parse_args(argv)
    for count in args.layers:
        profile = realistic_profile(count)
        for name, policy in goals(profile).items():
            best, outcome = float("inf"), ""
            for _ in range(args.repeat):
                profiler = cProfile.Profile() if args.profile else None
                start = time.perf_counter()
                if profiler:
                    profiler.enable()
                try:
                    chosen = policy.plan(profile)
                    outcome = f"{chosen.code} window {chosen.window_bytes / MIB:.0f} MiB"
                except TbaConfigError as err:  # a budget too small for so few layers: timed all the same
                    outcome = f"refused: {str(err).split(':')[0]}"
                if profiler:
                    profiler.disable()
                best = min(best, time.perf_counter() - start)
            print(f"{count:4d} layers  {name:30s} {best:8.3f} s  {outcome}")
            if profiler:
                pstats.Stats(profiler).sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main()
