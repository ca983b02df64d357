"""Command line: ``python -m tba <command>``.

Each command lives in its own module, which provides ``add_arguments(parser)`` and
``run(args) -> int``; this module only wires them to ``argparse``. :func:`main` imports the
module of the command it runs and no other (the others' one-line help comes from
:data:`COMMANDS`), so ``python -m tba --help`` and ``python -m tba run`` do not pay for every
command's imports (0.6 s of a 2.2 s start measured here), nor, with ``import tba`` importing torch only
on first use (Note [import tba imports torch on first use] in ``tba/__init__.py``), for torch: 0.1 s in all.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import re
import select
import signal
import sys
from collections.abc import Iterable
from typing import NoReturn

from tba.cli._signals import end_on_signals, stop_inside
from tba.errors import did_you_mean

COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("tba.cli.demo", "train a small built-in GPT with and without tba and compare"),
    "bench-io": ("tba.cli.bench_io", "measure O_DIRECT write/read bandwidth of each I/O engine vs fio"),
    "doctor": ("tba.cli.doctor", "report which I/O backends this machine supports and why not"),
    "rok": ("tba.cli.rok", "step time against activation memory: keep, recompute, offload, adaptive"),
    "bench-ckpt": ("tba.cli.bench_ckpt", "training stall and write bandwidth of checkpoints: torch.save, DCP, tba lazy"),
    "run": ("tba.cli.run", "run a script or module with a caching malloc (jemalloc, tcmalloc, mimalloc) preloaded"),
    "gpu-report": ("tba.cli.gpu_report", "one Markdown + JSON report of tba's CUDA path (--simulate: on a simulated device)"),
    "bench-hooks": ("tba.cli.bench_hooks", "host microseconds tba adds per saved storage, forward and backward"),
    "capacity": ("tba.cli.capacity", "largest micro-batch within a memory budget: keep, recompute, offload, adaptive"),
}

OFFLOADING = ("demo", "rok", "capacity", "gpu-report", "bench-hooks")
"""The commands whose runs build tba offloaders, which read the ``TBA_*`` variables."""


class _Parser(argparse.ArgumentParser):
    """A parser whose usage errors are one line (``prog: error: message``) and exit status 2.

    A word such as ``-1M`` or ``-2G`` is taken as an option's value, as argparse takes ``-1``, so that
    ``--size -1M`` gets the option's own error ("must be positive") instead of "expected one argument".
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = _NEGATIVE

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


_NEGATIVE = re.compile(r"^-(\d+\.?\d*|\.\d+)([KMGT]i?B?|B)?$", re.IGNORECASE)
_ROLE = re.compile(r":[a-z]+:`~?([^`]+)`")
_LITERAL = re.compile(r"``([^`]+)``")


def plain_text(text: str | None) -> str | None:
    """A docstring as plain text for ``--help``: Sphinx roles and double backquotes removed.

    ``:func:`tba.bench.isolated.run_isolated``` becomes ``tba.bench.isolated.run_isolated`` and
    double-backquoted literals lose their quotes.
    """
    if text is None:
        return None
    return _LITERAL.sub(r"\1", _ROLE.sub(r"\1", text))


def _add_verbose(parser: argparse.ArgumentParser, default: object) -> None:
    parser.add_argument("-v", "--verbose", action="store_true", default=default, help="log at DEBUG level")


def build_parser(full: Iterable[str] | None = None) -> argparse.ArgumentParser:
    """The ``python -m tba`` parser; the commands in ``full`` (default: all) get their options, the
    others only their name and one-line help (their modules are not imported)."""
    from tba import __version__

    full = set(COMMANDS) if full is None else set(full)
    parser = _Parser(
        prog="python -m tba",
        description="tba: offload PyTorch activations to NVMe files and prefetch them for backward.",
        epilog="Run 'python -m tba COMMAND --help' for a command's options.",
    )
    version = f"tba {__version__}"
    parser.add_argument("--version", action="version", version=version)
    _add_verbose(parser, False)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        if name not in full:
            sub.add_parser(name, help=help_text)
            continue
        module = importlib.import_module(module_name)
        command = sub.add_parser(name, help=help_text, description=plain_text(module.__doc__),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
        # -v and --version after the command as well; SUPPRESS keeps a -v given before it.
        _add_verbose(command, argparse.SUPPRESS)
        command.add_argument("--version", action="version", version=version)
        module.add_arguments(command)
        for action in command._actions:
            action.help = plain_text(action.help)
        command.set_defaults(_run=module.run)
    return parser


def command_in(argv: list[str]) -> str | None:
    """The command ``argv`` names: its first word that is not an option (the top-level options take no value)."""
    first = next((word for word in argv if not word.startswith("-")), None)
    return first if first in COMMANDS else None


def main(argv: list[str] | None = None, *, command_line: bool = False) -> int:
    """Run the command ``argv`` names (default: this process's arguments); its exit status.

    ``command_line``: this process is ``python -m tba`` itself (``tba/__main__.py``), so a command may
    run it again under another malloc (``bench-hooks --allocator``); a call from a program or a test
    never replaces the calling process.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    command = command_in(argv)
    parser = build_parser(full=[command] if command else [])
    args = _parse(parser, argv)
    if args.command is None:
        # Bare `python -m tba`: the help a user is looking for, and the usage-error status.
        parser.print_help()
        return 2
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(message)s",
    )
    if args.command in OFFLOADING:
        _check_environment(parser, args.command)
    args.command_line, args.argv = command_line, argv  # argv: what gpu-report's report says ran it
    if command_line:
        end_on_signals(args.command)
    try:
        status = int(args._run(args) or 0)
        if command_line:
            sys.stdout.flush()  # a reader gone shows here (below), not in the interpreter's own flush (status 120)
        return status
    except BrokenPipeError:
        if not command_line or not _output_closed():
            raise
        _silence_output()
        return 128 + signal.SIGPIPE
    except BaseException as err:  # DCP's CheckpointException is a BaseException
        stop = stop_inside(err)
        if stop is None or stop is err:
            raise
        raise stop from None


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Note: [A mistyped word gets a suggestion]
    argparse hands the words a command's parser does not know back to the top-level parser, which said
    "python -m tba: error: unrecognized arguments: --countz 4", naming no command, suggesting nothing (Python
    3.11's argparse has no ``suggest_on_error``). Such words are refused here by the command's own parser,
    with the closest of its options (:func:`tba.errors.did_you_mean`) and where to read them; a mistyped
    command gets the closest command the same way, in argparse's own refusal of it: ``--version`` or ``--help``
    before the mistyped word are answered first, as argparse answers them.
    """
    word = next((word for word in argv if not word.startswith("-")), None)
    if word is not None and word not in COMMANDS:
        refuse = parser.error
        unknown = f"unknown command {word!r}; {did_you_mean(word, COMMANDS)}choose one of {', '.join(COMMANDS)}"
        parser.error = lambda message: refuse(unknown if "invalid choice" in message else message)  # type: ignore[method-assign]
    args, extras = parser.parse_known_args(argv)
    if extras:
        command = parser._subparsers._group_actions[0].choices[args.command] if args.command else parser
        options = [option for action in command._actions for option in action.option_strings]
        unknown = next((extra.partition("=")[0] for extra in extras if extra.startswith("-")), "")
        command.error(f"unrecognized arguments: {' '.join(extras)}; {did_you_mean(unknown, options)}"
                      f"run '{command.prog} --help' for its options")
    return args


def _check_environment(parser: argparse.ArgumentParser, command: str) -> None:
    """Refuse a ``TBA_*`` variable tba cannot read before any work: it reached only the commands' measured
    processes, so ``TBA_QUEUE_DEPTH=abc python -m tba demo`` ended in a traceback of the first tba run and
    ``capacity`` reported every tba strategy unavailable, status 1."""
    from tba.config import OffloadConfig
    from tba.errors import TbaConfigError

    try:
        OffloadConfig.from_env()
    except TbaConfigError as err:
        parser.exit(2, f"python -m tba {command}: error: {err}; fix the variable or unset it\n")


def _output_closed() -> bool:
    """Note: [A reader gone ends the command quietly]
    Python ignores SIGPIPE, so ``python -m tba doctor | head -1`` (or any command whose stdout or stderr
    is a pipe its reader closed) raised BrokenPipeError at its next print or progress line and ended with
    status 1 and a traceback it could not print, or with "Exception ignored ... BrokenPipeError" and
    status 120 from the interpreter's last flush. Where stdout or stderr is such a pipe (``poll``: POLLERR,
    or POLLHUP for a socket), :func:`main` ends the command as SIGPIPE's default would have: status 141,
    both streams sent to /dev/null so that nothing more is written to them or fails. A BrokenPipeError
    from a pipe of the command's own (a child gone) is raised as any error.
    """
    poller = select.poll()
    for fd in (1, 2):
        poller.register(fd, select.POLLOUT)
    return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))


def _silence_output() -> None:
    devnull = os.open(os.devnull, os.O_WRONLY)
    for fd in (1, 2):
        os.dup2(devnull, fd)
    os.close(devnull)


if __name__ == "__main__":
    sys.exit(main(command_line=True))
