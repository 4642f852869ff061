"""Helpers shared by every command module: output sinks and option decorators.

The text helpers (tables, human sizes) live in :mod:`ckptfix.text`; they are re-exported here.

Nothing here imports torch.
"""

from __future__ import annotations

import os
import sys
from typing import IO, Any, Callable

import click

from ckptfix.text import human_bytes, table

__all__ = ["json_option", "emit_json", "info", "use_color", "warn", "error_line", "human_bytes", "table", "ProgressBar"]


def json_option(f: Callable[..., Any]) -> Callable[..., Any]:
    """The ``--json`` flag (parameter ``as_json``) every reporting command has."""
    return click.option("--json", "as_json", is_flag=True, help="Print a JSON document on stdout instead of text.")(f)


def emit_json(obj: Any) -> None:
    """Write one JSON document to stdout (data), nothing else."""
    import json  # only for --json: kept off start-up

    from ckptfix.display import mask_doc

    text = json.dumps(obj, default=_json_default)  # plain JSON values, then every string masked
    doc = json.loads(text)
    del text  # (a document of 30,000 rows: each copy is tens of MiB, held one at a time)
    doc = mask_doc(doc)
    text = json.dumps(doc, indent=2, sort_keys=False)
    del doc
    click.echo(text)


def _json_default(o: Any) -> Any:
    if hasattr(o, "to_dict"):
        return o.to_dict()
    if isinstance(o, (set, frozenset, tuple)):
        return list(o)
    return str(o)


def info(msg: str) -> None:
    """Diagnostics go to stderr."""
    echo(msg, err=True)


def use_color(stream: IO[str] | None = None) -> bool:
    """Whether to colour what goes to ``stream`` (default stderr).

    Colour only on a terminal, never when ``NO_COLOR`` is set to anything non-empty
    (https://no-color.org) or ``TERM=dumb``; ``FORCE_COLOR`` (non-empty) turns it on
    even when not on a terminal.

    Returns:
        True to emit ANSI colour codes.
    """
    if os.environ.get("NO_COLOR", ""):
        return False
    if os.environ.get("FORCE_COLOR", ""):
        return True
    if os.environ.get("TERM") == "dumb":
        return False
    s = sys.stderr if stream is None else stream
    isatty = getattr(s, "isatty", None)
    try:
        return bool(isatty and isatty())
    except (ValueError, OSError):  # a closed stream
        return False


def warn(msg: str) -> None:
    """A warning on stderr, ``warning:`` in yellow on a colour terminal."""
    color = use_color(sys.stderr)
    click.echo(click.style("warning:", fg="yellow", bold=True) + " " + _masked(msg), err=True, color=color)


#: control characters (C0, DEL, C1) shown escaped in diagnostics: a name from a file or a remote listing may hold a
#: terminal escape or a newline, and an error stays one line that the terminal does not interpret
_CONTROLS = {c: f"\\x{c:02x}" for c in (*range(32), *range(127, 160))}


def one_line(msg: str) -> str:
    """``msg`` with its control characters escaped (``\\x1b``, ``\\x0a``): one line, nothing a terminal runs; a
    URL's secrets (``user:password@``, a presigned URL's signature) masked (:func:`ckptfix.display.mask_secrets`)."""
    from ckptfix.display import mask_secrets

    return mask_secrets(msg.translate(_CONTROLS))


def echo(message: Any = None, **kw: Any) -> None:
    """``click.echo`` of what a command shows (stdout data, stderr notes): the secrets of URLs in it masked."""
    from ckptfix.display import mask_secrets

    click.echo(mask_secrets(message) if isinstance(message, str) else message, **kw)


def error_line(msg: str) -> None:
    """The one ``Error: ...`` line on stderr, ``Error:`` in red on a colour terminal."""
    color = use_color(sys.stderr)
    click.echo(click.style("Error:", fg="red", bold=True) + " " + one_line(msg), err=True, color=color)


#: operations on less data than this finish in about a second: no bar
BAR_MIN_BYTES = 64 << 20


class ProgressBar:
    """A click progress bar on stderr, shown only on a terminal and only for sizeable work.

    ``update(done, total)`` is a :data:`ckptfix.files.progress.Progress` callback; the bar is created
    on the first update whose ``total`` reaches :data:`BAR_MIN_BYTES`.  Use as a context manager.
    """

    def __init__(self, label: str, *, enabled: bool = True) -> None:
        self.label = label
        self.enabled = enabled and sys.stderr.isatty() and os.environ.get("TERM") != "dumb"
        self.bar: Any = None
        self.pos = 0

    def update(self, done: int, total: int) -> None:
        if not self.enabled or total < BAR_MIN_BYTES:
            return
        if self.bar is None:
            self.bar = click.progressbar(
                length=total, label=self.label, file=sys.stderr, show_eta=True, show_percent=True
            )
            self.bar.__enter__()
        self.bar.update(done - self.pos)
        self.pos = done

    def close(self) -> None:
        if self.bar is not None:
            self.bar.__exit__(None, None, None)
            self.bar = None

    def __enter__(self) -> "ProgressBar":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _masked(msg: str) -> str:
    from ckptfix.display import mask_secrets

    return mask_secrets(msg)
