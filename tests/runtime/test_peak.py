"""The host peak counters read from /proc/self/status."""

from __future__ import annotations

from tba.runtime import _peak


def test_a_process_name_cut_inside_a_character_does_not_stop_the_reading(tmp_path, monkeypatch):
    # The kernel keeps 15 bytes of a process's name (prctl PR_SET_NAME, setproctitle): "a训练进程进" ends inside a
    # character, and /proc/self/status read as UTF-8 raised UnicodeDecodeError in the adaptive context's profiled steps.
    status = tmp_path / "status"
    status.write_bytes("Name:\ta训练进程进".encode()[:15 + len("Name:\t")] + b"\nVmHWM:\t    2048 kB\nVmRSS:\t    1024 kB\n")
    monkeypatch.setattr(_peak, "_STATUS", str(status))
    assert _peak._status_bytes("VmHWM") == 2048 * 1024
    assert _peak._status_bytes("VmRSS") == 1024 * 1024
