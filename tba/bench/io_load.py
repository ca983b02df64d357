"""Disk traffic from another process, for the ``keep_io`` baseline: keep-all beside tba's bytes.

Note: [What the traffic alone costs]
On a virtual machine the host carries out the guest's disk I/O, and the guest's compute can pay
for it beyond the CPU time the guest spends issuing it. On this 2-core VM keep-all's steps on the
``small`` preset went from 0.48-0.54 s to 0.53-0.67 s (about 14% longer) while another process
wrote and read 1000 MiB/s each way in 4 MiB ``O_DIRECT`` blocks, and that process itself used 9%
of one core. tba's offload-all on the same model costs 7-13% of step time, so most of it may be
the traffic and not tba's code. The ``keep_io`` mode measures that: keep-all while a process
started here moves the bytes tba moved, at tba's rate (bytes per step over its step time), to
the same directory (resolved as tba resolves it: ``$TBA_DIR``, else the temp directory), ``O_DIRECT``
where tba's spill file would use it. Its steps against keep-all's are what the disk traffic costs on this machine;
tba's against ``keep_io``'s are what tba adds on top. The load is even, where tba's is bursty
(writes during forward, reads during backward): a first-order baseline, not a replay.

The load process writes into a nameless file (:func:`tba.io.open_scratch`), so nothing is left
behind whatever ends it, and it stops when its standard input closes: when :class:`BackgroundIO`
exits, or when this process dies. A load that fails, or moves far fewer bytes than asked, raises
when the block exits: a silent failure would turn ``keep_io`` into plain keep-all.
"""

from __future__ import annotations

import json
import mmap
import os
import select
import subprocess
import sys
import time
from typing import Any

from tba.defaults import BLOCK_SIZE_BYTES, MIB
from tba.io import open_scratch, probe_direct_io, resolve_directory

BLOCK_BYTES = BLOCK_SIZE_BYTES
"""One request of the load: tba's largest request."""

FILE_BYTES = 256 * MIB
"""Size of the load's file: written once before the load starts when it reads (so that reads find
data on the disk, not unwritten extents), then reused in a ring."""

SHORTFALL_FRACTION = 0.5
"""A load that moved less than this fraction of what its rates ask for raises at exit."""

STOP_TIMEOUT_S = 30.0
"""Seconds the load may take to stop once told to (one request in flight)."""


class BackgroundIO:
    """While entered, another process writes ``write_bytes_per_s`` and reads ``read_bytes_per_s`` in ``directory``.

    Entering waits until the load's file is written and its paced traffic has begun; after exit,
    :attr:`summary` holds what it moved (``written_bytes``, ``read_bytes``, ``seconds``, ``direct``).
    """

    def __init__(self, directory: str | os.PathLike | None, write_bytes_per_s: float, read_bytes_per_s: float, *,
                 file_bytes: int = FILE_BYTES) -> None:
        if write_bytes_per_s < 0 or read_bytes_per_s < 0:
            raise ValueError(f"rates must not be negative, got {write_bytes_per_s} and {read_bytes_per_s} bytes/s")
        if file_bytes < BLOCK_BYTES:
            raise ValueError(f"file_bytes must be at least one block ({BLOCK_BYTES}), got {file_bytes}")
        self.directory = resolve_directory(directory)
        self.write_bytes_per_s = write_bytes_per_s
        self.read_bytes_per_s = read_bytes_per_s
        self.file_bytes = file_bytes
        self.summary: dict[str, Any] | None = None
        self._proc: subprocess.Popen[str] | None = None

    def __repr__(self) -> str:
        return (f"BackgroundIO({self.directory!r}, write {self.write_bytes_per_s / MIB:.0f} MiB/s, "
                f"read {self.read_bytes_per_s / MIB:.0f} MiB/s)")

    def __enter__(self) -> BackgroundIO:
        os.makedirs(self.directory, exist_ok=True)
        request = json.dumps({"directory": self.directory, "write_bytes_per_s": self.write_bytes_per_s,
                              "read_bytes_per_s": self.read_bytes_per_s, "file_bytes": self.file_bytes})
        self._proc = proc = subprocess.Popen([sys.executable, "-m", "tba.bench.io_load", request], text=True,
                                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        if proc.stdout.readline().strip() != "ready":
            self._proc = None
            _, stderr = _stop(proc)
            raise RuntimeError(f"the I/O load in {self.directory} did not start:\n{stderr[-2000:]}")
        return self

    def __exit__(self, *exc: object) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        returncode, stderr = _stop(proc)
        if exc[0] is not None:
            return
        lines = stderr.strip().splitlines()
        if returncode != 0 or not lines:
            raise RuntimeError(f"the I/O load in {self.directory} failed (exit status {returncode}):\n{stderr[-2000:]}")
        self.summary = summary = json.loads(lines[-1])
        for moved, rate in (("written_bytes", self.write_bytes_per_s), ("read_bytes", self.read_bytes_per_s)):
            asked = rate * summary["seconds"]
            if asked > 2 * BLOCK_BYTES and summary[moved] < SHORTFALL_FRACTION * asked:
                raise RuntimeError(f"the I/O load in {self.directory} moved {summary[moved] / MIB:.0f} MiB "
                                   f"({moved}) of the {asked / MIB:.0f} MiB its rate asked for: the disk could "
                                   "not keep up, so keep_io would not show tba's traffic")


def _stop(proc: subprocess.Popen[str]) -> tuple[int, str]:
    """Close the load's input (its signal to stop) and collect its exit status and standard error."""
    try:
        _, stderr = proc.communicate(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, stderr = proc.communicate()
    return proc.returncode, stderr


def serve(directory: str, write_bytes_per_s: float, read_bytes_per_s: float, *, file_bytes: int = FILE_BYTES,
          stop_fd: int = 0) -> dict[str, Any]:
    """The load itself: paced writes and reads in a ring over one file until ``stop_fd`` reads end-of-file;
    returns the bytes moved, the seconds it ran and whether the file was ``O_DIRECT``."""
    direct = probe_direct_io(directory) is None
    fd = open_scratch(directory, file_bytes, direct=direct)
    buffer = mmap.mmap(-1, BLOCK_BYTES)
    buffer.write(os.urandom(4096) * (BLOCK_BYTES // 4096))
    blocks = file_bytes // BLOCK_BYTES
    try:
        if read_bytes_per_s > 0:
            for index in range(blocks):
                os.pwritev(fd, [buffer], index * BLOCK_BYTES)
        print("ready", flush=True)
        rates = [(rate, kind) for rate, kind in ((write_bytes_per_s, "written"), (read_bytes_per_s, "read")) if rate > 0]
        moved = {"written": 0, "read": 0}
        start = time.perf_counter()
        while True:
            elapsed = time.perf_counter() - start
            busy = False
            for rate, kind in rates:
                if moved[kind] < rate * elapsed:  # this direction is behind its rate: one more block
                    offset = (moved[kind] // BLOCK_BYTES * (1 if kind == "written" else 7) % blocks) * BLOCK_BYTES
                    (os.pwritev if kind == "written" else os.preadv)(fd, [buffer], offset)
                    moved[kind] += BLOCK_BYTES
                    busy = True
            # the next block of a direction is due once its rate has covered the bytes moved so far
            next_due = min((moved[kind] / rate for rate, kind in rates), default=elapsed + 1.0)
            wait = 0.0 if busy else max(0.0, next_due - (time.perf_counter() - start))
            if select.select([stop_fd], [], [], wait)[0]:
                break
        return {"written_bytes": moved["written"], "read_bytes": moved["read"],
                "seconds": time.perf_counter() - start, "direct": direct}
    finally:
        os.close(fd)


if __name__ == "__main__":
    request = json.loads(sys.argv[1])
    done = serve(request["directory"], request["write_bytes_per_s"], request["read_bytes_per_s"],
                 file_bytes=request["file_bytes"])
    print(json.dumps(done), file=sys.stderr)
