"""Disk traffic from another process, for the ``keep_io`` baseline: keep-all beside tba's bytes.

Note: [What the traffic alone costs]
On a virtual machine the host carries out the guest's disk I/O, and the guest's compute can pay
for it beyond the CPU time the guest spends issuing it. On this 2-core VM keep-all's steps on the
``small`` preset went from 0.48-0.54 s to 0.53-0.67 s (about 14% longer) while another process
wrote and read 1000 MiB/s each way in 4 MiB ``O_DIRECT`` blocks, and that process itself used 9%
of one core. tba's offload-all on the same model costs 7-13% of step time, so most of it may be
the traffic and not tba's code. The ``keep_io`` mode measures that: keep-all while a process
started here moves the bytes tba moved, at tba's rate (bytes per step over its step time), to
the same directory. Its steps against keep-all's are what the disk traffic costs on this machine;
tba's against ``keep_io``'s are what tba adds on top. The load is even, where tba's is bursty
(writes during forward, reads during backward): a first-order baseline, not a replay.

The load process writes into a nameless file (``O_TMPFILE``, or a name removed at once where the
file system has no ``O_TMPFILE``), so nothing is left behind whatever ends it, and it stops when
its standard input closes: when :class:`BackgroundIO` exits, or when this process dies.
"""

from __future__ import annotations

import json
import mmap
import os
import select
import subprocess
import sys
import tempfile
import time
from typing import Any

from tba.defaults import MIB

BLOCK_BYTES = 4 * MIB
"""One request of the load (tba's ``BLOCK_SIZE_BYTES``)."""

FILE_BYTES = 256 * MIB
"""Size of the load's file: written once before the load starts, so that reads find data, then reused in a ring."""


class BackgroundIO:
    """While entered, another process writes ``write_bytes_per_s`` and reads ``read_bytes_per_s`` in ``directory``.

    Entering waits until the load's file is written and its paced traffic has begun.
    """

    def __init__(self, directory: str | None, write_bytes_per_s: float, read_bytes_per_s: float) -> None:
        if write_bytes_per_s < 0 or read_bytes_per_s < 0:
            raise ValueError(f"rates must not be negative, got {write_bytes_per_s} and {read_bytes_per_s} bytes/s")
        self.directory = directory or tempfile.gettempdir()
        self.write_bytes_per_s = write_bytes_per_s
        self.read_bytes_per_s = read_bytes_per_s
        self._proc: subprocess.Popen[str] | None = None

    def __repr__(self) -> str:
        return (f"BackgroundIO({self.directory!r}, write {self.write_bytes_per_s / MIB:.0f} MiB/s, "
                f"read {self.read_bytes_per_s / MIB:.0f} MiB/s)")

    def __enter__(self) -> BackgroundIO:
        request = json.dumps({"directory": self.directory, "write_bytes_per_s": self.write_bytes_per_s,
                              "read_bytes_per_s": self.read_bytes_per_s})
        self._proc = proc = subprocess.Popen([sys.executable, "-m", "tba.bench.io_load", request], text=True,
                                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        line = proc.stdout.readline() if proc.stdout is not None else ""
        if line.strip() != "ready":
            self.__exit__(None, None, None)
            raise RuntimeError(f"the I/O load in {self.directory} did not start: {line}{proc.stderr.read()[-2000:]}")
        return self

    def __exit__(self, *exc: object) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        proc.stdin.close()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        for stream in (proc.stdout, proc.stderr):
            stream.close()


def _open_nameless(directory: str) -> int:
    """A file in ``directory`` that no name points to, ``O_DIRECT`` where the file system takes it (as tba's)."""
    for flags in (os.O_RDWR | os.O_CLOEXEC | os.O_DIRECT, os.O_RDWR | os.O_CLOEXEC):
        try:
            return os.open(directory, flags | os.O_TMPFILE, 0o600)
        except OSError:
            path = os.path.join(directory, f".tba-io-load-{os.getpid()}")
            try:
                fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o600)
            except OSError:
                continue
            os.unlink(path)
            return fd
    raise OSError(f"cannot create a file in {directory}")


def serve(directory: str, write_bytes_per_s: float, read_bytes_per_s: float, *, stop_fd: int = 0) -> dict[str, Any]:
    """The load itself: paced ``O_DIRECT`` writes and reads in a ring over one file until ``stop_fd``
    reads end-of-file; returns the bytes moved and the seconds it ran."""
    fd = _open_nameless(directory)
    buffer = mmap.mmap(-1, BLOCK_BYTES)
    buffer.write(os.urandom(4096) * (BLOCK_BYTES // 4096))
    blocks = FILE_BYTES // BLOCK_BYTES
    try:
        for index in range(blocks):
            os.pwritev(fd, [buffer], index * BLOCK_BYTES)
        print("ready", flush=True)
        start = time.perf_counter()
        written = read = 0
        while True:
            elapsed = time.perf_counter() - start
            write_due = written < write_bytes_per_s * elapsed
            read_due = read < read_bytes_per_s * elapsed
            if write_due:
                os.pwritev(fd, [buffer], (written // BLOCK_BYTES % blocks) * BLOCK_BYTES)
                written += BLOCK_BYTES
            if read_due:
                os.preadv(fd, [buffer], (read // BLOCK_BYTES * 7 % blocks) * BLOCK_BYTES)
                read += BLOCK_BYTES
            if write_due or read_due:
                if select.select([stop_fd], [], [], 0)[0]:
                    break
                continue
            next_due = min((n + BLOCK_BYTES) / rate for n, rate in ((written, write_bytes_per_s), (read, read_bytes_per_s))
                           if rate > 0) if write_bytes_per_s > 0 or read_bytes_per_s > 0 else elapsed + 1.0
            if select.select([stop_fd], [], [], max(0.0, next_due - elapsed))[0]:
                break
        return {"written_bytes": written, "read_bytes": read, "seconds": time.perf_counter() - start}
    finally:
        os.close(fd)


if __name__ == "__main__":
    request = json.loads(sys.argv[1])
    done = serve(request["directory"], request["write_bytes_per_s"], request["read_bytes_per_s"])
    print(json.dumps(done), file=sys.stderr)
