"""Parsing of user-given sizes and shapes."""

from __future__ import annotations

import pytest

from nowdl.errors import NowdlError
from nowdl.units import parse_bytes, parse_shape


def test_parse_bytes() -> None:
    assert parse_bytes("80GiB") == 80 * 2**30
    assert parse_bytes("40GB") == 40 * 10**9
    assert parse_bytes("1.5 MiB") == int(1.5 * 2**20)
    assert parse_bytes(1024) == 1024
    for bad in ("eighty", "10 parsecs", "-1GiB", 0, "0GiB"):
        with pytest.raises(NowdlError):
            parse_bytes(bad)


def test_parse_shape() -> None:
    assert parse_shape("1x3x2048x2048") == [1, 3, 2048, 2048]
    assert parse_shape("1,1,64,64,64") == [1, 1, 64, 64, 64]
    for bad in ("", "1x3xbig", "1x0x4", "1xx3", "2048²"):
        with pytest.raises(NowdlError, match="shape"):
            parse_shape(bad)
