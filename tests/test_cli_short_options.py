"""A command's exact short options go straight to click's short-option code (``ckptfix.cli.group.Command``).

Click tries every ``-x`` as a long option first, and the miss imports ``difflib`` and calls gettext; the
parser of a ckptfix command skips that step for an argument that is exactly one of its short options.  The
outcome must be what click's own parser gives, for every argument list: the same values, the same errors.
"""

from __future__ import annotations

import click
import pytest

from ckptfix.cli.group import Command


def _params() -> list[click.Parameter]:
    return [
        click.Argument(["src"], required=False),
        click.Option(["-o", "--output", "output"]),
        click.Option(["-j", "--jobs"], type=int, default=1),
        click.Option(["-q", "--quiet"], is_flag=True),
        click.Option(["-v", "--verbose"], count=True),
        click.Option(["--force"], is_flag=True),
        click.Option(["-k"], multiple=True),
        click.Option(["-pair"], nargs=2),  # one dash, long: click matches it as a long option
    ]


def _outcome(cls: type[click.Command], args: list[str]) -> tuple[str, object]:
    cmd = cls("c", params=_params(), callback=lambda **kw: None)
    try:
        with cmd.make_context("c", list(args)) as ctx:
            return "ok", ctx.params
    except click.UsageError as e:
        return type(e).__name__, e.format_message()


ARGS = [
    [],
    ["a.pt", "-o", "b"],
    ["-o", "b", "a.pt"],
    ["-ob", "a.pt"],
    ["-o=b", "a.pt"],
    ["-o"],
    ["a.pt", "-o", "-q"],
    ["-q", "-j", "3", "x"],
    ["-qj", "4"],
    ["-vvv", "-v", "x"],
    ["-k", "1", "-k", "2"],
    ["-x"],
    ["-qx"],
    ["--outpt", "b"],
    ["--output=b"],
    ["-j", "many"],
    ["--", "-o"],
    ["-pair", "1", "2"],
    ["-p"],
    ["-"],
]


@pytest.mark.parametrize("args", ARGS, ids=lambda a: " ".join(a) or "none")
def test_parsing_gives_what_clicks_parser_gives(args):
    assert _outcome(Command, args) == _outcome(click.Command, args)


def test_an_exact_short_option_is_not_tried_as_a_long_one(monkeypatch):
    cmd = Command("c", params=_params(), callback=lambda **kw: None)
    ctx = click.Context(cmd)
    parser = cmd.make_parser(ctx)
    tried: list[str] = []
    real = parser._match_long_opt
    monkeypatch.setattr(parser, "_match_long_opt", lambda opt, *a: (tried.append(opt), real(opt, *a)))
    parser.parse_args(["a.pt", "-o", "b", "-q", "--force"])
    assert tried == ["--force"]
