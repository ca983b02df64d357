"""Byte sizes written by people (tba/_units.py)."""

from __future__ import annotations

from tba import parse_size


def test_whole_sizes_are_exact_above_two_to_the_53():
    assert parse_size("9007199254740993") == 2**53 + 1
    assert parse_size("8388609T") == 8388609 * 2**40
    assert parse_size("1.5G") == 3 * 2**29 and parse_size(" 2GB ") == 2 * 10**9
