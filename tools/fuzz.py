#!/usr/bin/env python3
"""Differential fuzzer: random small models and steps with and without tba, compared bit for bit.

Each case is one seed (see ``tba/bench/fuzz.py`` for what is drawn). Prints progress every 50
cases, a reproducer for every case that differs or leaks (with the traceback of one that raised), and
a summary; exits 1 on any finding.

Example:
    python tools/fuzz.py --cases 5000 --seed 0
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback

from tba.bench.fuzz import draw_case, reproducer, run_case
from tba.cli import _checks as cli_checks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=cli_checks.int_at_least(1), default=200, help="number of cases (default 200)")
    parser.add_argument("--seed", type=int, default=0, help="first seed; case i uses seed + i (default 0)")
    parser.add_argument("--time-budget-s", type=float, default=None, help="stop after this many seconds")
    args = parser.parse_args(argv)
    if args.time_budget_s is not None and not args.time_budget_s > 0:
        parser.error(f"--time-budget-s must be > 0, got {args.time_budget_s}; leave it out for no limit")
    start, findings, done = time.monotonic(), 0, 0
    for index in range(args.cases):
        if args.time_budget_s is not None and time.monotonic() - start > args.time_budget_s:
            break
        case = draw_case(args.seed + index)
        try:
            problems = run_case(case)
        except Exception as err:  # noqa: BLE001 - a crash is a finding too, reported with its reproducer
            problems = [f"raised {type(err).__name__}: {err}\n{traceback.format_exc()}"]
        done += 1
        if problems:
            findings += 1
            print(f"case {case.seed}: {'; '.join(problems)}\n{reproducer(case)}", flush=True)
        if done % 50 == 0:
            print(f"fuzz: {done} cases, {findings} findings, {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)
    print(f"fuzz: {done} cases from seed {args.seed}: {findings} findings in {time.monotonic() - start:.1f} s")
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
