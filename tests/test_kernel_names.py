"""Names the kernel hands back as bytes (file paths, thread names) need not be UTF-8: reading them never fails."""

from __future__ import annotations

import ctypes
import mmap
import os
import threading

from tba import _elf
from tba.bench import thread_cpu
from tba.runtime import _preempted

PR_SET_NAME = 15


def test_a_mapped_file_whose_name_is_not_utf8_is_found(tmp_path):
    path = os.path.join(os.fsencode(tmp_path), b"mapped-\xff")
    with open(path, "wb") as f:
        f.write(b"\0" * mmap.PAGESIZE)
    with open(path, "rb") as f:
        mapping = mmap.mmap(f.fileno(), mmap.PAGESIZE, access=mmap.ACCESS_COPY)
    try:
        first = ctypes.c_char.from_buffer(mapping)
        address = ctypes.addressof(first)
        del first  # the mapping cannot close while a ctypes object holds its buffer
        assert _elf.mapped_file(address) == os.fsdecode(path)
    finally:
        mapping.close()


def _in_a_thread_named(name: bytes, body):
    """Run ``body(tid)`` while a thread whose kernel name (``comm``) is ``name`` is alive, ``tid`` its id; returns its result."""
    named, done = threading.Event(), threading.Event()

    def run() -> None:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_NAME, ctypes.c_char_p(name), 0, 0, 0)
        named.set()
        done.wait(10)

    thread = threading.Thread(target=run)
    thread.start()
    try:
        named.wait(10)
        return body(thread.native_id)
    finally:
        done.set()
        thread.join()


# The kernel keeps 15 bytes of a thread's name: a UTF-8 name cut inside a character (prctl, setproctitle).
CUT_NAME = "a训练进程进".encode()[:15]


def test_a_thread_whose_name_is_not_utf8_is_named_by_the_cpu_meter():
    name = _in_a_thread_named(CUT_NAME, lambda tid: thread_cpu._comm(str(tid)))
    assert name.startswith("a训练进程")


def test_a_thread_whose_name_is_not_utf8_is_watched_for_preemption():
    assert _in_a_thread_named(CUT_NAME, lambda tid: tid in _preempted.snapshot())


def test_a_library_path_that_is_not_utf8_in_the_linker_cache_is_read(tmp_path, monkeypatch):
    from tba import _allocator_search

    fake = tmp_path / "ldconfig"
    fake.write_bytes(b"#!/bin/sh\nprintf '2 libs found in cache\\n\\tlibx.so.1 (libc6,x86-64) => /opt/\\377/libx.so.1\\n"
                     b"\\tliby.so.2 (libc6,x86-64) => /usr/lib/liby.so.2\\n'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '')}")
    found = _allocator_search._ldconfig_paths()
    if os.uname().machine == "x86_64":
        assert found["liby.so.2"] == "/usr/lib/liby.so.2"
        assert os.fsencode(found["libx.so.1"]) == b"/opt/\xff/libx.so.1"
