"""pytest plugin: a test that runs past pytest-timeout's limit in a pytest-xdist worker prints every thread's stack.

Note: [A test past its timeout in a worker says so]
``pyproject.toml`` sets pytest-timeout's ``timeout = 300`` with the ``thread`` method: a timer thread
that, once the test has run that long, writes the test's captured output and every thread's stack to
pytest's terminal, then ends the process with ``os._exit(1)``. In a pytest-xdist worker that terminal
is the worker's stdout, which execnet pointed at ``/dev/null`` when it took the real one for its
channel (``init_popen_io``): the report is lost, and all the run prints is ``[gw1] node down: Not
properly terminated`` and ``worker 'gw1' crashed while running ...`` (a CI run, in
``tests/device/test_sim_faults.py``; a test that sleeps past a one-second timeout gives exactly those
lines). So in a worker the timer is faulthandler's watchdog instead: after the same timeout it writes
``Timeout (h:mm:ss)!`` and every thread's stack (the hung test's frames among them) to the stderr
pytest found, which the worker shares with the run's own stderr, and exits with status 1 as
pytest-timeout does. It is a C thread, so it also fires while a hung call holds the GIL, where
pytest-timeout's Python thread never runs. The test's captured output is not printed.
faulthandler has one watchdog per process: a test that arms its own (``dump_traceback_later``), or
pytest's ``faulthandler_timeout``, would replace this one. A run without workers keeps
pytest-timeout's own report, which reaches the terminal there.
"""

from __future__ import annotations

import faulthandler
import os
import sys
from typing import IO, Any

import pytest

_stderr: list[IO[str]] = []
"""The process's stderr as pytest found it, before capturing (where the stacks go)."""


def pytest_configure(config: pytest.Config) -> None:
    _stderr.append(open(os.dup(sys.stderr.fileno()), "w", closefd=True))


def stderr_as_found() -> IO[str]:
    """The process's stderr as pytest found it (a test's own stderr is a capture file, lost with the process)."""
    return _stderr[0]


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_set_timer(item: pytest.Item, settings: Any) -> bool | None:
    """Note [A test past its timeout in a worker says so]; None leaves the timer to pytest-timeout."""
    if not hasattr(item.config, "workerinput") or settings.method != "thread":
        return None
    faulthandler.dump_traceback_later(settings.timeout, exit=True, file=_stderr[0])
    item.cancel_timeout = faulthandler.cancel_dump_traceback_later  # what pytest-timeout's cancel hook calls
    return True
