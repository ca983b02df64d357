"""The benchmarks' memory meters."""

from __future__ import annotations

from tba.bench import meters


def test_a_process_name_cut_inside_a_character_does_not_stop_the_meters(tmp_path, monkeypatch):
    # As in tests/runtime/test_peak.py: the kernel keeps 15 bytes of the name, here ending inside a character.
    status = tmp_path / "status"
    status.write_bytes("Name:\ta训练进程进".encode()[:15 + len("Name:\t")] + b"\nVmHWM:\t    2048 kB\n")
    monkeypatch.setattr(meters, "_STATUS", str(status))
    assert meters._status_kib("VmHWM") == 2048
