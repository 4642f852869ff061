"""The ``ckptfix`` Click group: the root every command module attaches its commands to.

It sits below the command modules (they import it) and below :mod:`ckptfix.cli` (which imports
them to register the commands), so the CLI's import graph has no cycle.
"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING, Any

import click

from ckptfix._startup import imports_quietly

if TYPE_CHECKING:
    from click.parser import _OptionParser


class CtrlC(Exception):  # a signal, not an error: ckptfix.cli.main renders it
    """Ctrl-C inside a command, carried past Click (which would print a blank line and "Aborted.")."""


#: which module defines each command: only the one run is imported (start-up of ``gpus``, ``inspect``...)
COMMAND_MODULES = {
    "inspect": "ckptfix.cli.ckpt",
    "scan": "ckptfix.cli.ckpt",
    "strip-prefix": "ckptfix.cli.ckpt",
    "add-prefix": "ckptfix.cli.ckpt",
    "align": "ckptfix.cli.ckpt",
    "sanitize": "ckptfix.cli.ckpt",
    "convert": "ckptfix.cli.convert",
    "diff": "ckptfix.cli.diff",
    "gpus": "ckptfix.cli.gpu",
    "pick-gpu": "ckptfix.cli.gpu",
    "doctor": "ckptfix.cli.gpu",
    "train": "ckptfix.cli.train",
    "demo": "ckptfix.cli.demo",
}


def _show_help(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    """``-h`` / ``--help``: the help page on stdout (what click's own help option does)."""
    if value and not ctx.resilient_parsing:
        click.echo(ctx.get_help(), color=ctx.color)
        ctx.exit()


class HelpOption:
    """The help option made without gettext.

    Click makes it with ``help_option(help=_("Show this message and exit."))``, and it asks gettext for the
    default text even when one is given: the first gettext call imports :mod:`locale` and every call looks for
    catalogs (~1 ms of every command's start-up, three calls).  The same option, the same text, made here;
    click's own rules decide whether there is one (``add_help_option``, names a parameter already uses).
    """

    add_help_option: bool

    def get_help_option(self, ctx: click.Context) -> click.Option | None:
        """The help option (None where the command has none).

        Args:
            ctx: the Click context.

        Returns:
            The option, made once per command.
        """
        names = self.get_help_option_names(ctx)  # type: ignore[attr-defined]
        if not names or not self.add_help_option:
            return None
        opt: click.Option | None = self.__dict__.get("_ckptfix_help_option")
        if opt is None:
            opt = click.Option(
                ["_ckptfix_help", *names],  # stored under its own name: a parameter called "help" keeps its value
                is_flag=True,
                expose_value=False,
                is_eager=True,
                callback=_show_help,
                help="Show this message and exit.",
            )
            self.__dict__["_ckptfix_help_option"] = opt
        return opt


class Command(HelpOption, click.Command):
    """A ckptfix command (its help option made without gettext: :class:`HelpOption`; its short options
    matched directly: :meth:`make_parser`)."""

    def make_parser(self, ctx: click.Context) -> _OptionParser:
        """Click's parser, taking an argument that is exactly one of the command's short options (``-o``)
        straight to it.

        Click tries every option as a long one first; for ``-o`` that fails, and making the failure imports
        :mod:`difflib` (close matches) and calls gettext (which imports :mod:`locale`): about 1 ms of the
        start-up of ``convert x.pt -o y``, for the outcome click reaches next anyway (a short option that
        click's own rules would not try as a long one: no option of the command is spelled that way).
        Where click's parser lacks the parts this relies on, it is returned as it is.

        Args:
            ctx: the Click context.

        Returns:
            The parser.
        """
        parser = super().make_parser(ctx)
        process = getattr(parser, "_process_opts", None)
        short, long_ = getattr(parser, "_short_opt", None), getattr(parser, "_long_opt", None)
        match_short = getattr(parser, "_match_short_opt", None)
        if process is None or match_short is None or not isinstance(short, dict) or not isinstance(long_, dict):
            return parser

        def process_opts(arg: str, state: Any) -> None:
            if arg in short and arg not in long_:
                match_short(arg, state)
            else:
                process(arg, state)

        parser._process_opts = process_opts  # type: ignore[method-assign]
        return parser


class LazyGroup(HelpOption, click.Group):
    """The root group: command modules imported when a command is looked up (not at start-up); a
    KeyboardInterrupt in a command reaches :func:`ckptfix.cli.main` as :class:`CtrlC`."""

    command_class = Command

    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt as e:
            raise CtrlC() from e

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        """The command, importing the module that defines it first.

        Args:
            ctx: the Click context.
            cmd_name: the command's name.

        Returns:
            The command, or None for an unknown name.
        """
        mod = COMMAND_MODULES.get(cmd_name)
        if mod is not None and cmd_name not in self.commands:
            with imports_quietly():
                importlib.import_module(mod)  # registers its commands on ``cli``
        return super().get_command(ctx, cmd_name)

    def list_commands(self, ctx: click.Context) -> list[str]:
        """Every command's name (``--help``: imports every command module).

        Args:
            ctx: the Click context.

        Returns:
            The names, sorted.
        """
        load_all()
        return super().list_commands(ctx)


def _show_version(ctx: click.Context, value: bool) -> None:
    """``--version``: ``ckptfix, version X`` as ``click.version_option`` prints it (made without gettext, as
    :class:`HelpOption`); the installed distribution's version, else the package's own."""
    if not value or ctx.resilient_parsing:
        return
    from importlib.metadata import PackageNotFoundError, version

    try:
        v = version("ckptfix")
    except PackageNotFoundError:  # run from a checkout: the package's own (imported before this module)
        v = sys.modules["ckptfix"].__version__
    click.echo(f"ckptfix, version {v}", color=ctx.color)
    ctx.exit()


def load_all() -> None:
    """Import every command module (what ``--help`` and the docs need)."""
    for mod in dict.fromkeys(COMMAND_MODULES.values()):
        importlib.import_module(mod)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--debug", is_flag=True, help="Show the full traceback on errors (or set CKPTFIX_DEBUG=1).")
@click.option(
    "--version",
    is_flag=True,
    expose_value=False,
    is_eager=True,
    callback=lambda ctx, param, value: _show_version(ctx, value),
    help="Show the version and exit.",
)
def cli(debug: bool) -> None:
    """Make PyTorch checkpoints and GPUs stop getting in your way.

    \b
    Checkpoints:  inspect, scan, strip-prefix, add-prefix, align, convert, sanitize
    GPUs:         gpus, pick-gpu, doctor
    Training:     train, demo
    """
    # --debug is read by ckptfix.cli.main from the arguments (it must know before Click parses them)
