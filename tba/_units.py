"""Byte sizes written by people: one parser for every command-line option and config string, and
:func:`readable_size`, which writes a size for people to read in a message.

A bare suffix and the ``iB`` suffixes are binary, ``B`` suffixes are decimal (SI), as in fio and
``numfmt``: ``512K`` = ``512KiB`` = 512 * 2**10, ``2G`` = ``2GiB`` = 2 * 2**30, but ``2GB`` =
2 * 10**9. A plain number is whole bytes; fractions need a unit (``1.5G``).
"""

from __future__ import annotations

import argparse
import re

from tba.errors import TbaConfigError

_POWERS = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*(?:([KMGT])(i?B)?|B)?\s*", flags=re.IGNORECASE)


class SizeError(TbaConfigError, argparse.ArgumentTypeError):
    """A string that is not a byte size; argparse shows its message as the option's error. A
    :class:`~tba.errors.TbaConfigError` (so a ``ValueError``): :func:`tba.parse_size` is public."""


def parse_size(text: str) -> int:
    """Bytes in ``text`` such as ``4096``, ``512K``, ``1.5G``, ``2GiB`` or ``2GB``.

    Raises:
        SizeError: ``text`` is not a size; the message gives examples.
    """
    match = _SIZE.fullmatch(str(text))
    if not match and _SIZE.fullmatch(str(text).strip().removeprefix("-")):
        raise SizeError(f"{text!r} is negative; pass a positive size, for example 512M or 2GiB")
    if not match:
        raise SizeError(f"not a size: {text!r} (write bytes, or a number with K, M, G, T, KiB .. TiB, KB .. TB; "
                        "for example 512M or 2GiB)")
    number, prefix, suffix = match.group(1), (match.group(2) or "").upper(), (match.group(3) or "")
    if not prefix and "." in number:
        raise SizeError(f"not a whole number of bytes: {text!r} (a fraction needs a unit, for example 1.5G)")
    base = 1000 if suffix.upper() == "B" else 1024
    if "." not in number:  # exact: float() would round sizes above 2**53
        return int(number) * base ** _POWERS[prefix]
    return int(float(number) * base ** _POWERS[prefix])


_READABLE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB", "ZiB", "YiB")


def readable_size(nbytes: int) -> str:
    """``nbytes`` in the largest binary unit it reaches, to one decimal (``74.7 GiB``; ``512 B`` below a KiB): a size
    in GiB alone was a 17-digit number for ``--size 99999999999999T``."""
    power = 0
    while power + 1 < len(_READABLE_UNITS) and nbytes >= 1024 ** (power + 1):
        power += 1
    if power == 0:
        return f"{nbytes} B"
    return f"{nbytes / 1024 ** power:.1f} {_READABLE_UNITS[power]}"
