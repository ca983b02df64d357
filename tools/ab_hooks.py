"""A/B of ``python -m tba bench-hooks`` between two checkouts of tba, in alternating rounds.

    python tools/ab_hooks.py A B [--rounds 3] [--json PATH] [-- bench-hooks options]

``A`` and ``B`` are git revisions of this repository (each checked out in a temporary worktree,
removed at the end) or directories holding a checkout. Each side's native extensions are built in
place first (``setup.py build_ext --inplace``); a side whose ``tba`` or extensions would load from
anywhere but its own directory is refused, so that an editable install of another checkout cannot
stand in for it. Every round runs bench-hooks once per side in a fresh process, the order swapped
from one round to the next (A B, B A, ...), so both sides see the same minutes of a machine whose
speed drifts. Bench-hooks options after ``--`` go to both sides (default: ``--sizes 64K --counts
400,2000 --no-disk --no-keep``).

Prints, per row of the table, each side's extra microseconds per storage (forward / backward) in every
round, their medians, and B's median less A's. A difference smaller than the spread of a side's own
rounds is noise (docs/host-cost.md: this 2-core VM moves by 20-30% from run to run).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import shutil
import signal
import site
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence

REPO = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_BENCH = ["--sizes", "64K", "--counts", "400,2000", "--no-disk", "--no-keep"]
NATIVE = ("tba._uring", "tba._shield", "tba._gc", "tba._record", "tba._requests", "tba._save")
"""The optional extensions whose origin is checked on each side."""

Runner = Callable[[pathlib.Path, list[str]], list[dict]]
"""Runs bench-hooks in a checkout with options; returns the JSON rows."""


def row_key(row: dict) -> str:
    """A row's name as the table prints it: count x size, directory kind, path."""
    return f"{row['count']} x {row['size_bytes'] // 1024} KiB {row['label']} {row['path']}"


def summarise(rounds: dict[str, list[list[dict]]]) -> list[str]:
    """Lines comparing the sides: ``rounds[side]`` holds each round's rows of that side."""
    sides = list(rounds)
    keys: list[str] = []
    for side in sides:
        for rows in rounds[side]:
            keys.extend(row_key(row) for row in rows if row_key(row) not in keys)
    lines = []
    for key in keys:
        lines.append(key)
        medians = {}
        for side in sides:
            found = [row for rows in rounds[side] for row in rows if row_key(row) == key]
            forward = [row["extra_forward_us"] for row in found]
            backward = [row["extra_backward_us"] for row in found]
            if not found:
                lines.append(f"  {side}: no row")
                continue
            medians[side] = statistics.median(forward), statistics.median(backward)
            each = ", ".join(f"{f:.1f} / {b:.1f}" for f, b in zip(forward, backward))
            lines.append(f"  {side}: {each}; median {medians[side][0]:.1f} / {medians[side][1]:.1f}")
        if len(medians) == 2:
            (af, ab), (bf, bb) = medians[sides[0]], medians[sides[1]]
            lines.append(f"  {sides[1]} less {sides[0]}: {bf - af:+.1f} / {bb - ab:+.1f} us per storage")
    return lines


def _origin_check() -> str:
    """Python run in a side's checkout: prints where tba and each extension it has would load from."""
    probe = ["import importlib.util, json, tba", "out = {'tba': tba.__file__}"]
    for name in NATIVE:
        probe.append(f"spec = importlib.util.find_spec({name!r}); out[{name!r}] = spec.origin if spec else None")
    probe.append("print(json.dumps(out))")
    return "; ".join(probe)


def check_origin(checkout: pathlib.Path, origins: dict[str, str | None]) -> None:
    """Refuse a side whose ``tba`` or an extension comes from elsewhere than ``checkout``."""
    for name, origin in origins.items():
        if origin is not None and not pathlib.Path(origin).resolve().is_relative_to(checkout.resolve()):
            raise SystemExit(f"ab_hooks: in {checkout}, {name} loads from {origin}; build it there "
                             "(python setup.py build_ext --inplace) or run from a plain virtual environment")


def _environment(checkout: pathlib.Path) -> dict[str, str]:
    """The side's environment: its checkout first, then this interpreter's site-packages, for a Python started
    with ``-S`` (:data:`PYTHON`)."""
    paths = [str(checkout), *site.getsitepackages()]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "PYTHONNOUSERSITE": "1"}


PYTHON = (sys.executable, "-S")
"""How a side's Python starts. ``-S`` runs no ``.pth`` file: an editable install of tba in this environment
installs a finder that served a side's ``import tba._record`` from the installed checkout when the side had no
such module (an older revision), so the two sides ran different code than their own."""


def run_bench(checkout: pathlib.Path, options: list[str]) -> list[dict]:
    """bench-hooks in ``checkout`` (a fresh process); its JSON rows."""
    with tempfile.TemporaryDirectory(prefix="tba-ab-") as scratch:
        path = pathlib.Path(scratch) / "rows.json"
        done = subprocess.run([*PYTHON, "-m", "tba", "bench-hooks", *options, "--json", str(path)], cwd=checkout,
                              env=_environment(checkout), check=False, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True)
        if done.returncode != 0:
            tail = done.stderr.strip().splitlines()[-1:] or ["(nothing on stderr)"]
            raise SystemExit(f"ab_hooks: bench-hooks failed in {checkout} (exit {done.returncode}): {tail[0]}")
        return json.loads(path.read_text())["rows"]


def prepare(checkout: pathlib.Path) -> None:
    """Build ``checkout``'s extensions in place and check where its modules load from."""
    subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=checkout,
                   env=_environment(checkout), check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    probe = subprocess.run([*PYTHON, "-c", _origin_check()], cwd=checkout, env=_environment(checkout),
                           check=True, capture_output=True, text=True)
    check_origin(checkout, json.loads(probe.stdout.strip().splitlines()[-1]))


@contextlib.contextmanager
def checkouts(specs: Sequence[str]) -> Iterator[list[pathlib.Path]]:
    """A directory per spec: the directory itself, or a detached worktree of the revision (removed after)."""
    made: list[pathlib.Path] = []
    scratch = pathlib.Path(tempfile.mkdtemp(prefix="tba-ab-worktrees-"))
    try:
        paths = []
        for index, spec in enumerate(specs):
            if pathlib.Path(spec).is_dir():
                paths.append(pathlib.Path(spec))
                continue
            path = scratch / f"side{index}"
            made.append(path)  # before the add: one interrupted half way is removed too
            subprocess.run(["git", "-C", str(REPO), "worktree", "add", "-q", "--detach", str(path), spec], check=True)
            paths.append(path)
        yield paths
    finally:
        for path in made:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(path)], check=False,
                           stderr=subprocess.DEVNULL)
        shutil.rmtree(scratch, ignore_errors=True)
        if made:  # what a remove could not take (a worktree added half way) is left to prune, its directory gone
            subprocess.run(["git", "-C", str(REPO), "worktree", "prune"], check=False)


def compare(paths: Sequence[pathlib.Path], labels: Sequence[str], rounds: int, options: list[str],
            runner: Runner = run_bench) -> dict[str, list[list[dict]]]:
    """``rounds`` rounds of ``runner`` on each side, the order swapped every round."""
    results: dict[str, list[list[dict]]] = {label: [] for label in labels}
    for index in range(rounds):
        order = list(zip(labels, paths))
        if index % 2:
            order.reverse()
        for label, path in order:
            print(f"ab_hooks: round {index + 1} of {rounds}, {label}", file=sys.stderr, flush=True)
            results[label].append(runner(path, options))
    return results


def is_revision(spec: str) -> bool:
    """Whether ``spec`` names a commit of this repository."""
    found = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--verify", "--quiet", f"{spec}^{{commit}}"],
                           capture_output=True, check=False)
    return found.returncode == 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tools/ab_hooks.py", description=__doc__.split("\n\n")[0], allow_abbrev=False,
                                     usage="%(prog)s A B [--rounds N] [--json PATH] [-- bench-hooks options]")
    parser.add_argument("a", metavar="A", help="a git revision of this repository, or a directory holding a checkout")
    parser.add_argument("b", metavar="B", help="the same for the other side")
    parser.add_argument("--rounds", type=int, default=3, help="rounds; each runs both sides once (default 3)")
    parser.add_argument("--json", metavar="PATH", default=None, help="also write every round's rows to PATH")
    return parser


def _terminated(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # SIGTERM (timeout, a cancelled job) ends the tool through its cleanup


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    bench = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    parser = _parser()
    args = parser.parse_args(own)
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    if "--json" in bench:
        parser.error("pass --json before --: each side's rows are collected by this tool")
    if args.json is not None and not os.access(os.path.dirname(os.path.abspath(args.json)), os.W_OK):
        parser.error(f"--json {args.json}: its directory is not writable")
    for name, spec in (("A", args.a), ("B", args.b)):
        if not pathlib.Path(spec).is_dir() and not is_revision(spec):
            parser.error(f"{name}: {spec!r} is neither a directory nor a revision of {REPO}")
    labels = [f"A ({args.a})", f"B ({args.b})"]
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        with checkouts([args.a, args.b]) as paths:
            for path in paths:
                prepare(path)
            results = compare(paths, labels, args.rounds, bench or DEFAULT_BENCH)
    except subprocess.CalledProcessError as err:
        print(f"ab_hooks: {' '.join(map(str, err.cmd[:4]))} ... failed (exit {err.returncode}); "
              "run it by hand in that checkout to see why", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
    print("\n".join(summarise(results)))
    if args.json is not None:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
