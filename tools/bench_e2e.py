#!/usr/bin/env python3
"""End-to-end benchmark: one GPT, each placement strategy in a fresh process, ratios against keep-all.

Strategies: keep-all, tba (offload), full recompute (torch.utils.checkpoint on every layer) and
torch.autograd.graph.save_on_cpu. Prints median step time and activation peak (peak RSS during a
step minus RSS before it) with their ratios to keep-all, and whether losses are identical.

Measured as a user would by default (``--measure user``): every process runs in a plain
environment (no glibc malloc tuning), no warm-up step, and the activation peak is the worst of all
measured steps, the first included. ``--measure controlled`` is the earlier mode: a fixed glibc
mmap threshold, one warm-up step, and the median peak of the measured steps.

``--allocator`` preloads one malloc into every mode's process alike (``auto``, the default, is the
best caching allocator found, as ``python -m tba run`` picks it; ``system`` is glibc's malloc);
the header names it and each row the malloc that served its process.

``--usage bare`` runs tba exactly as ``with tba.offload_activations(directory=d):`` around each
step's forward, with nothing else passed (no layers, no budget, a new context every step);
``--usage reusable`` (default) enters one ``tba.Offloader(d, layers=model)`` every step.

Examples:
    python tools/bench_e2e.py --preset bench --usage bare --allocator jemalloc --steps 4
    python tools/bench_e2e.py --preset bench --usage bare --allocator system --steps 4
    python tools/bench_e2e.py --preset bench --steps 5 --measure controlled

Then, unless ``--no-turns``, every mode (but ``keep_io``) runs once more, all in one process, one
step of each in turn (``tba/bench/interleaved.py``): the ``turns s`` columns. On a VM one
process can run the same steps up to 25% slower than another (Note [Speeds are compared step by
step]), so step-time ratios between separate processes also compare the host's state in each; by
turns they do not. Peaks come only from the separate processes.

After the modes, ``keep_io`` (unless ``--no-io-baseline``) runs keep-all again while another
process writes and reads in the spill directory at the rates tba's row measured: what that disk
traffic alone costs this machine's compute (``tba/bench/io_load.py``, Note [What the traffic alone
costs]). tba's step time over ``keep_io``'s is what tba's own work adds.

With ``--compile per-block`` every mode runs the model with each block under ``torch.compile``
(inductor), so ratios are against compiled keep-all; compilation happens in the warm-up step.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from tba.allocator import CHOICES as ALLOCATORS
from tba.allocator import launch_env
from tba.bench.harness import ALL_MODES, COMPILE_MODES, MODES, USAGES
from tba.bench.interleaved import run_interleaved_isolated
from tba.bench.isolated import run_isolated
from tba.bench.models import PRESETS
from tba.cli import _checks as cli_checks
from tba.cli._report import comparison_rows, format_table, losses_match
from tba.defaults import MIB
from tba.errors import TbaConfigError

logger = logging.getLogger("tba")


def _mode_list(text: str) -> list[str]:
    modes = [mode.strip() for mode in text.split(",")]
    unknown = [mode for mode in modes if mode not in ALL_MODES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown mode {', '.join(unknown)!r}; choose from {', '.join(ALL_MODES)}")
    return modes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="bench",
                        help="model: bench = 8 layers, width 512, sequence 256, batch 8 (default)")
    parser.add_argument("--modes", type=_mode_list, default=",".join(MODES),
                        help=f"comma-separated subset of {','.join(ALL_MODES)} (tba-verify: tba with verify=True)")
    parser.add_argument("--steps", type=cli_checks.int_at_least(1), default=5, help="measured steps per mode (default: 5)")
    parser.add_argument("--warmup", type=cli_checks.int_at_least(0), default=None,
                        help="unmeasured steps first (default: 0 with --measure user, 1 with controlled)")
    parser.add_argument("--usage", choices=USAGES, default="reusable",
                        help="how tba is entered: reusable = tba.Offloader(d, layers=model) entered every step "
                             "(default); bare = `with tba.offload_activations(directory=d):` per step, nothing else")
    parser.add_argument("--measure", choices=("user", "controlled"), default="user",
                        help="user = plain process, peak over every measured step, first included (default); "
                             "controlled = fixed glibc mmap threshold, median peak of the measured steps")
    parser.add_argument("--directory", default=None,
                        help="spill directory, an existing one (default: $TBA_DIR or the temp dir)")
    parser.add_argument("--backend", default="auto", help="tba I/O backend (default: auto)")
    parser.add_argument("--compile", choices=COMPILE_MODES, default="none",
                        help="none (eager, default) or per-block: torch.compile each repeated block")
    parser.add_argument("--allocator", choices=ALLOCATORS, default="auto",
                        help="malloc preloaded into every mode's process: auto = best caching allocator found "
                             "(default), system = the C library's (glibc)")
    parser.add_argument("--no-turns", dest="turns", action="store_false",
                        help="skip the run in which every mode takes a step in turn in one process (the turns columns)")
    parser.add_argument("--no-io-baseline", dest="io_baseline", action="store_false",
                        help="skip the keep_io row (keep-all beside tba's disk traffic from another process)")
    parser.add_argument("--json", metavar="PATH", help="also write the rows and raw results as JSON")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        _, malloc = launch_env(args.allocator)
        if args.directory is not None:
            cli_checks.existing_directory("--directory", args.directory)
        if args.json:
            cli_checks.output_file("--json", args.json)
    except (TbaConfigError, ValueError) as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    logger.info("malloc: %s, the same for every mode", malloc)
    user = args.measure == "user"
    warmup = args.warmup if args.warmup is not None else (0 if user else 1)
    modes = list(args.modes)
    if "keep" not in modes:
        modes.insert(0, "keep")
    if "keep_io" in modes or (args.io_baseline and "tba" in modes):  # last: it takes the tba row's rates
        modes = [mode for mode in modes if mode != "keep_io"] + ["keep_io"]
    results = []
    for index, mode in enumerate(modes, 1):
        io_rates = None
        if mode == "keep_io":
            io_rates = next((r.io_rates() for r in results if r.mode == "tba"), None)
            if io_rates is None:
                logger.info("[%d/%d] keep_io: skipped (no tba row measured its traffic)", index, len(modes))
                continue
            logger.info("        keep_io's load: %.0f MiB/s written, %.0f MiB/s read (tba's rates)",
                        io_rates[0] / MIB, io_rates[1] / MIB)
        logger.info("[%d/%d] %s: %d warm-up + %d measured steps ...", index, len(modes), mode, warmup, args.steps)
        results.append(run_isolated(mode, args.preset, steps=args.steps, warmup=warmup, directory=args.directory,
                                    backend=args.backend, compile_mode=args.compile, usage=args.usage,
                                    malloc_env=not user, allocator=args.allocator, io_rates=io_rates))
        logger.info("        median step %.3f s", results[-1].median_step_s)
    turns = None
    turn_modes = [r.mode for r in results if r.mode != "keep_io"]
    if args.turns and len(turn_modes) > 1:
        logger.info("[turns] %s: %d warm-up + %d measured steps each, one step of each in turn, in one process ...",
                    ", ".join(turn_modes), warmup, args.steps)
        turns = run_interleaved_isolated(turn_modes, args.preset, rounds=args.steps, warmup=warmup,
                                         directory=args.directory, backend=args.backend, usage=args.usage,
                                         compile_mode=args.compile, malloc_env=not user, allocator=args.allocator)
    rows = comparison_rows(results, peak="max" if user else "median", turns=turns)
    print(format_table(rows))
    how = "plain process, peak over all measured steps" if user else "fixed mmap threshold, median peak"
    print(f"measure: {args.measure} ({how}), usage: {args.usage}, {warmup} warm-up + {args.steps} measured steps, "
          f"malloc: {malloc}")
    by_mode = {r.mode: r for r in results}
    if turns is not None:
        print("turns s: the median step of each mode in one process, the modes taking one step each in turn; "
              "its x keep against keep-all's steps there")
    if "tba" in by_mode and by_mode["tba"].plan:
        print(f"tba's plan: {by_mode['tba'].plan['code']} (per layer after profiling: K keep, O offload, R recompute, "
              "S offloaded recompute)")
    if "keep_io" in by_mode and "tba" in by_mode:
        print(f"keep_io: keep-all beside tba's disk traffic from another process; tba's step time is "
              f"{by_mode['tba'].median_step_s / by_mode['keep_io'].median_step_s:.2f}x keep_io's "
              "(separate processes: compare with care)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"preset": args.preset, "backend": args.backend, "compile": args.compile, "usage": args.usage,
                       "allocator": malloc, "measure": args.measure, "warmup": warmup, "rows": rows,
                       "results": [r.__dict__ for r in results],
                       "turns": None if turns is None else {m: r.__dict__ for m, r in turns.items()}}, f, indent=2)
    return 0 if all(losses_match(row) for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
