"""How a command run as ``python -m tba`` ends on a signal: SIGTERM unwinds every ``with`` as an exception,
a signal a finalizer swallowed is sent again, a signal a library wrapped is found and raised in its place, and
Ctrl-C ends in one line instead of a traceback.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from tba.errors import linked_errors


def stop_inside(err: BaseException) -> SystemExit | KeyboardInterrupt | None:
    """Note: [A signal wrapped by a library still ends the command]
    A SIGTERM (``SystemExit(143)``, Note [A terminated command cleans up]) or a Ctrl-C that lands inside
    ``dcp.save`` is caught there and raised again inside DCP's ``CheckpointException`` (its ``failures``
    per rank), so ``bench-ckpt`` ended with status 1 and a long traceback instead of 143 (helper-101).
    A ``SystemExit`` or ``KeyboardInterrupt`` found in an error's causes, its context or such failures
    is raised in its place, as if nothing had wrapped it.
    """
    return next((linked for linked in linked_errors(err) if isinstance(linked, (SystemExit, KeyboardInterrupt))), None)


def end_on_signals(command: str) -> None:
    """Note: [A terminated command cleans up]
    Python's default for SIGTERM ends the process at once: a benchmark killed by ``timeout`` or a job
    scheduler left its scratch directories behind (``bench-hooks`` under /dev/shm and /var/tmp, seen in a
    review). As ``python -m tba``, SIGTERM raises ``SystemExit(143)`` instead, so every ``with`` unwinds;
    a program that calls :func:`main` keeps its own handler.
    """
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _terminated)
    sys.unraisablehook = _send_again_after(sys.unraisablehook)
    sys.excepthook = _interrupted_in_one_line(sys.excepthook, command)


def _interrupted_in_one_line(previous: Callable[..., object], command: str) -> Callable[..., None]:
    """Note: [Ctrl-C ends the command in one line]
    A Ctrl-C ended a command with Python's KeyboardInterrupt traceback, tens of lines from wherever the
    main thread was (a review's leftover): the interrupt is the user's own act, not a failure to report.
    As ``python -m tba``, an uncaught KeyboardInterrupt prints one line naming the command; Python still
    ends the process afterwards as it does for any uncaught KeyboardInterrupt (``atexit`` runs, then the
    process kills itself with SIGINT, so a shell's loop sees the interrupt and stops). Any other exception
    goes to the hook there was before.
    """

    def hook(kind: type[BaseException], value: BaseException, traceback: Any) -> None:
        if issubclass(kind, KeyboardInterrupt):
            sys.stderr.write(f"python -m tba {command}: interrupted\n")
            return
        previous(kind, value, traceback)

    return hook


def _terminated(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _send_again_after(previous: Callable[[Any], object]) -> Callable[[Any], None]:
    """Note: [A signal a finalizer swallowed is sent again]
    Python runs a signal's handler between any two bytecodes, a finalizer's (``__del__``, a weakref
    callback) among them, and an exception raised there is printed ("Exception ignored in ...") and
    dropped: ``bench-ckpt`` ran to its end after a SIGTERM that landed in a weakref callback, and
    Ctrl-C's KeyboardInterrupt is lost the same way. This hook, for a ``SystemExit`` from
    :func:`_terminated` or a ``KeyboardInterrupt``, says nothing and sends the signal again from a
    thread a moment later, when the main thread has left the finalizer (were it in another one, this
    hook sends it once more). Any other exception goes to the hook there was before. The thread waits
    for the hook to end before its moment starts: sent while the hook still waited for the thread to
    start (a loaded machine), the signal's exception was raised in the hook itself, where it is dropped
    too ("Exception ignored in sys.unraisablehook", and the command ran on: a CI run).
    """

    def hook(unraisable: Any) -> None:
        value = unraisable.exc_value
        if isinstance(value, KeyboardInterrupt):
            signum = signal.SIGINT
        elif isinstance(value, SystemExit) and _raised_by(unraisable.exc_traceback, _terminated):
            signum = signal.SIGTERM
        else:
            previous(unraisable)
            return
        hook_over = threading.Event()
        try:
            threading.Thread(target=_kill_soon, args=(signum, hook_over), name="tba-signal-again", daemon=True).start()
        finally:
            hook_over.set()

    return hook


def _raised_by(traceback: Any, function: Callable[..., object]) -> bool:
    while traceback is not None and traceback.tb_next is not None:
        traceback = traceback.tb_next
    return traceback is not None and traceback.tb_frame.f_code is function.__code__


def _kill_soon(signum: int, hook_over: threading.Event) -> None:
    hook_over.wait()
    time.sleep(SIGNAL_AGAIN_AFTER_S)
    os.kill(os.getpid(), signum)


SIGNAL_AGAIN_AFTER_S = 0.01
"""How long after the hook that heard a swallowed signal ends the signal is sent again (the finalizer has returned by then)."""
