"""ckptfix.text: the tables and sizes every report prints."""

from __future__ import annotations

import doctest

import pytest

from ckptfix import text
from ckptfix.text import gib, human_bytes, table


def test_doctests():
    res = doctest.testmod(text)
    assert res.failed == 0 and res.attempted > 0


@pytest.mark.parametrize(
    "n, shown",
    [
        (None, "-"),
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (5 * 1024**3, "5.0 GiB"),
        (3 * 1024**5, "3072.0 TiB"),
    ],
)
def test_human_bytes(n, shown):
    assert human_bytes(n) == shown


def test_gib():
    assert gib(None) == "-" and gib(1536) == "1.5"


def test_table_pads_columns_and_strips_trailing_blanks():
    assert table([["a", "1"], ["bbb", ""]], ["x", "y"]).splitlines() == ["x    y", "a    1", "bbb"]
