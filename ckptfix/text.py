"""Plain-text helpers shared by the library's reports and the CLI: tables and human sizes.  Pure, no click.

>>> print(table([["cuda:0", "H200"]], ["cuda", "name"]))
cuda    name
cuda:0  H200
>>> human_bytes(1536), gib(2048)
('1.5 KiB', '2.0')
"""

from __future__ import annotations

import re
from typing import Sequence

__all__ = ["table", "human_bytes", "gib", "parse_size"]


def human_bytes(n: int | float | None) -> str:
    """A byte count in binary units (``1536 -> "1.5 KiB"``, ``None -> "-"``).

    Args:
        n: bytes, or ``None`` for unknown.

    Returns:
        Whole bytes below 1 KiB, else one decimal in KiB, MiB, GiB or TiB.
    """
    if n is None:
        return "-"
    x = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(x) < 1024:
            return f"{x:.0f} {unit}" if unit == "B" else f"{x:.1f} {unit}"
        x /= 1024
    return f"{x:.1f} TiB"


def gib(mib: int | None) -> str:
    """MiB as GiB with one decimal, without unit (``2048 -> "2.0"``); ``None -> "-"``.

    Args:
        mib: a size in MiB, or ``None`` for unknown.

    Returns:
        The number of GiB, or ``"-"``.
    """
    return "-" if mib is None else f"{mib / 1024:.1f}"


def table(rows: Sequence[Sequence[object]], header: Sequence[str]) -> str:
    """A plain left-aligned text table, columns two spaces apart, no trailing blanks.

    Args:
        rows: the cells (printed with ``str``), one sequence per row, as many as ``header``.
        header: the column titles.

    Returns:
        The table, lines joined by newlines (no final newline).
    """
    cols: list[Sequence[object]] = [header, *rows]
    widths = [max(len(str(r[i])) for r in cols) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(header, widths, strict=False)).rstrip()]
    for r in rows:
        lines.append("  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=False)).rstrip())
    return "\n".join(lines)


_UNITS = {
    "": 1,
    "B": 1,
    "K": 10**3,
    "KB": 10**3,
    "M": 10**6,
    "MB": 10**6,
    "G": 10**9,
    "GB": 10**9,
    "T": 10**12,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(text: str | int) -> int:
    """A size in bytes: ``"5GB"`` -> 5_000_000_000 (decimal, the Hugging Face convention); KiB/MiB/GiB are binary.

    Args:
        text: a number of bytes, or a number with a unit (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB; case-insensitive).

    Returns:
        The size in bytes.

    Raises:
        ValueError: not a size, or not positive.

    >>> parse_size("5GB"), parse_size("2MiB"), parse_size(512)
    (5000000000, 2097152, 512)
    """
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"cannot read size {text!r}; write it like 5GB, 500MB, 2GiB or a number of bytes")
    n = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if n <= 0:
        raise ValueError(f"size {text!r} must be positive")
    return n
