"""One field of this process's ``/proc/self/status``, read as bytes.

Note: [The status file is read as bytes]
Its first line is the process's name, which the kernel cuts to 15 bytes, inside a character of a name in UTF-8
(``prctl(PR_SET_NAME)``, setproctitle): read as UTF-8 text it raised UnicodeDecodeError, in the adaptive context's
profiled steps (the host peak, ``tba/runtime/_peak.py``) and in the benchmarks' memory meters
(``tba/bench/meters.py``), which both read their fields here.
"""

from __future__ import annotations

STATUS = "/proc/self/status"


def status_kib(field: str, path: str = STATUS) -> int | None:
    """``field`` of ``path`` (``"VmRSS"``, ``"VmHWM"``: kB in the kernel's words), or None where no line has it.

    Raises:
        OSError: where the file cannot be read (no ``/proc``).
    """
    wanted = field.encode()
    with open(path, "rb") as status:
        for line in status:
            if line.startswith(wanted):
                return int(line.split()[1])
    return None
