"""Whether the process's ``malloc`` is its executable's import: /proc/self/maps and the ELF dynamic symbols.

Note: [A non-PIE executable's malloc is a PLT entry]
:func:`tba.allocator.detect` asks the dynamic linker where ``malloc`` is and which object holds that
address. An executable built without position independence (Debian's ``/usr/bin/python3``, the Python
on the H200 image) that calls ``malloc`` gets a *canonical* address for it: its own PLT entry, so that
a function pointer compares equal everywhere. The process's ``malloc`` then seems to live in the
executable whichever library serves it, and detection named the executable ("malloc: python3") instead
of glibc, so tba did not hand freed pages back under glibc there. An undefined ``malloc`` in the
executable's ``.dynsym`` (section index 0) tells that case from an executable that defines its own.
"""

from __future__ import annotations

import os
import struct
import sys

ELF_MAGIC = b"\x7fELF"
SHT_DYNSYM = 11
"""The section type of the dynamic symbol table."""
SHN_UNDEF = 0
"""A symbol's section index when the object imports it."""
SECTION_HEADER_BYTES = 64
SYMBOL_BYTES = 24
MAX_TABLE_BYTES = 64 << 20
"""Tables larger than this (bytes) are not read: no executable's dynamic symbols come near it."""


def imports_symbol(path: str, name: str) -> bool | None:
    """True when the 64-bit little-endian ELF at ``path`` imports ``name`` (an undefined dynamic
    symbol), False when it defines it or has no such symbol, None when it cannot be read as one."""
    try:
        with open(path, "rb") as file:
            header = file.read(64)
            if len(header) < 64 or header[:4] != ELF_MAGIC or header[4] != 2 or header[5] != 1:
                return None
            (section_offset,) = struct.unpack_from("<Q", header, 0x28)
            entry_bytes, count = struct.unpack_from("<HH", header, 0x3A)
            if entry_bytes != SECTION_HEADER_BYTES or count == 0:
                return None
            file.seek(section_offset)
            table = file.read(entry_bytes * count)
            sections = [struct.unpack_from("<IIQQQQIIQQ", table, i * entry_bytes) for i in range(count)]
            wanted = name.encode()
            for _, kind, _, _, offset, size, link, _, _, _ in sections:
                if kind != SHT_DYNSYM or link >= count or size > MAX_TABLE_BYTES:
                    continue
                strings_offset, strings_size = sections[link][4], sections[link][5]
                if strings_size > MAX_TABLE_BYTES:
                    return None
                file.seek(strings_offset)
                strings = file.read(strings_size)
                file.seek(offset)
                symbols = file.read(size)
                for start in range(0, len(symbols) - SYMBOL_BYTES + 1, SYMBOL_BYTES):
                    name_offset, _, _, section = struct.unpack_from("<IBBH", symbols, start)
                    end = strings.find(b"\0", name_offset)
                    if strings[name_offset:end] == wanted:
                        return section == SHN_UNDEF
            return False
    except (OSError, struct.error):
        return None


def mapped_file(address: int) -> str | None:
    """The path of the file mapped at ``address`` in this process (``/proc/self/maps``), else None."""
    try:
        # Paths are file names, decoded as Python decodes them: a line naming a file that is not UTF-8
        # raised UnicodeDecodeError (a ValueError), and the search gave up before the address's own line.
        with open("/proc/self/maps", encoding=sys.getfilesystemencoding(), errors="surrogateescape") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                start, end = (int(bound, 16) for bound in fields[0].split("-"))
                if start <= address < end:
                    return fields[5].strip() if len(fields) == 6 else None
    except (OSError, ValueError):
        return None
    return None


def is_executables_import(address: int, name: str) -> bool:
    """Whether ``address`` lies in this process's executable, which imports ``name``: the canonical
    address of a function a non-PIE executable calls (Note [A non-PIE executable's malloc is a PLT entry])."""
    path = mapped_file(address)
    executable = "/proc/self/exe"
    return (path is not None and os.path.realpath(path) == os.path.realpath(executable)
            and imports_symbol(executable, name) is True)
