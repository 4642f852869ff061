"""Review findings on the copy streams (``ckptfix.convert.write``)."""

from __future__ import annotations

import pytest

from ckptfix.convert import write


@pytest.mark.parametrize("junk", ["\u00b2", "\u0663", "1e3", "-2", "x"])
def test_a_junk_stream_count_in_the_environment_is_ignored_not_a_crash(junk, monkeypatch):
    """``"²".isdigit()`` is True but ``int("²")`` raises: the variable must be ignored like other junk."""
    monkeypatch.setenv("CKPTFIX_COPY_STREAMS", junk)
    assert write.stream_count(3, 1 << 30) == 3
    assert write.stream_count(1, 1) == 1
