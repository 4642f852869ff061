"""Helpers shared by every command module: output sinks and option decorators.

Nothing here imports torch.
"""

from __future__ import annotations

import json
import sys
from typing import Any, Callable

import click


def json_option(f: Callable) -> Callable:
    return click.option("--json", "as_json", is_flag=True, help="Print a JSON document on stdout instead of text.")(f)


def emit_json(obj: Any) -> None:
    """Write one JSON document to stdout (data), nothing else."""
    click.echo(json.dumps(obj, indent=2, sort_keys=False, default=_json_default))


def _json_default(o: Any) -> Any:
    if hasattr(o, "to_dict"):
        return o.to_dict()
    if isinstance(o, (set, frozenset, tuple)):
        return list(o)
    return str(o)


def info(msg: str) -> None:
    """Diagnostics go to stderr."""
    click.echo(msg, err=True)


def warn(msg: str) -> None:
    click.echo(click.style("warning: ", fg="yellow") + msg, err=True, color=sys.stderr.isatty())


def human_bytes(n: int | float | None) -> str:
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def table(rows: list[list[str]], header: list[str]) -> str:
    """A plain left-aligned text table."""
    cols = [header] + rows
    widths = [max(len(str(r[i])) for r in cols) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(header, widths)).rstrip()]
    for r in rows:
        lines.append("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip())
    return "\n".join(lines)
