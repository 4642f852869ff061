"""The ``ckptfix`` Click group: the root every command module attaches its commands to.

It sits below the command modules (they import it) and below :mod:`ckptfix.cli` (which imports
them to register the commands), so the CLI's import graph has no cycle.
"""

from __future__ import annotations

import importlib

import click

from ckptfix._startup import imports_quietly
from ckptfix._version import __version__


class CtrlC(Exception):  # a signal, not an error: ckptfix.cli.main renders it
    """Ctrl-C inside a command, carried past Click (which would print a blank line and "Aborted.")."""


class StdoutClosed(Exception):  # not an OSError: Click turns an EPIPE OSError into a silent exit 1
    """The reader of standard output went away (``ckptfix scan X | head -1``), carried past Click to
    :func:`ckptfix.cli.main`, which ends quietly as for any closed pipe."""


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


class LazyGroup(click.Group):
    """The root group: command modules imported when a command is looked up (not at start-up); a
    KeyboardInterrupt in a command reaches :func:`ckptfix.cli.main` as :class:`CtrlC`."""

    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt as e:
            raise CtrlC() from e
        except BrokenPipeError as e:
            raise StdoutClosed() from e

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        """The command, importing the module that defines it first.

        Returns:
            The command, or None for an unknown name.
        """
        mod = COMMAND_MODULES.get(cmd_name)
        if mod is not None and cmd_name not in self.commands:
            with imports_quietly():
                importlib.import_module(mod)  # registers its commands on ``cli``
        return super().get_command(ctx, cmd_name)

    def list_commands(self, ctx: click.Context) -> list[str]:
        """Every command's name (``--help``: imports every command module)."""
        load_all()
        return super().list_commands(ctx)


def load_all() -> None:
    """Import every command module (what ``--help`` and the docs need)."""
    for mod in dict.fromkeys(COMMAND_MODULES.values()):
        importlib.import_module(mod)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--debug", is_flag=True, help="Show the full traceback on errors (or set CKPTFIX_DEBUG=1).")
@click.version_option(__version__, prog_name="ckptfix")
def cli(debug: bool) -> None:
    """Make PyTorch checkpoints and GPUs stop getting in your way.

    \b
    Checkpoints:  inspect, scan, diff, strip-prefix, add-prefix, align, convert, sanitize
    GPUs:         gpus, pick-gpu, doctor
    Training:     train, demo
    """
    # --debug is read by ckptfix.cli.main from the arguments (it must know before Click parses them)
