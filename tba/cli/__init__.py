"""Command line: ``python -m tba <command>``.

Each command lives in its own module, which provides ``add_arguments(parser)`` and
``run(args) -> int``; this module only wires them to ``argparse``.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from typing import NoReturn

COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("tba.cli.demo", "train a small built-in GPT with and without tba and compare"),
    "bench-io": ("tba.cli.bench_io", "measure O_DIRECT write/read bandwidth of each I/O engine vs fio"),
    "doctor": ("tba.cli.doctor", "report which I/O backends this machine supports and why not"),
    "rok": ("tba.cli.rok", "step time against activation memory: keep, recompute, offload, adaptive"),
    "bench-ckpt": ("tba.cli.bench_ckpt", "training stall and write bandwidth of checkpoints: torch.save, DCP, tba lazy"),
    "run": ("tba.cli.run", "run a script or module with a caching malloc (jemalloc, tcmalloc, mimalloc) preloaded"),
}


class _Parser(argparse.ArgumentParser):
    """A parser whose usage errors are one line (``prog: error: message``) and exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="python -m tba",
        description="tba: offload PyTorch activations to NVMe files and prefetch them for backward.",
        epilog="Run 'python -m tba COMMAND --help' for a command's options.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        module = importlib.import_module(module_name)
        command = sub.add_parser(name, help=help_text, description=module.__doc__)
        module.add_arguments(command)
        command.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(message)s",
    )
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
