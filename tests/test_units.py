"""Byte sizes written by people (tba/_units.py)."""

from __future__ import annotations

import pytest

import tba
from tba import parse_size
from tba._units import readable_size


def test_whole_sizes_are_exact_above_two_to_the_53():
    assert parse_size("9007199254740993") == 2**53 + 1
    assert parse_size("8388609T") == 8388609 * 2**40
    assert parse_size("1.5G") == 3 * 2**29 and parse_size(" 2GB ") == 2 * 10**9


def test_a_readable_size_is_in_the_largest_unit_it_reaches():
    assert [readable_size(n) for n in (0, 1023, 1024, 1536 * 2**20, 2**62, 99999999999999 * 2**40)] == [
        "0 B", "1023 B", "1.0 KiB", "1.5 GiB", "4.0 EiB", "90.9 YiB"]


@pytest.mark.parametrize("text", ["1e3", "-1", "0.5", "lots"])
def test_a_bad_size_given_to_the_public_parser_is_a_tba_config_error(text):
    """``tba.parse_size`` is public, and a user's bad size raised a bare ValueError subclass that ``except
    tba.TbaError`` did not catch, unlike the same size given as an option (helper-168)."""
    with pytest.raises(tba.TbaConfigError, match="for example"):
        parse_size(text)
