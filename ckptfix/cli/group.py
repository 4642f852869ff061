"""The ``ckptfix`` Click group: the root every command module attaches its commands to.

It sits below the command modules (they import it) and below :mod:`ckptfix.cli` (which imports
them to register the commands), so the CLI's import graph has no cycle.
"""

from __future__ import annotations

import click


class CtrlC(Exception):  # a signal, not an error: ckptfix.cli.main renders it
    """Ctrl-C inside a command, carried past Click (which would print a blank line and "Aborted.")."""


class Group(click.Group):
    """The root group: a KeyboardInterrupt in a command reaches :func:`ckptfix.cli.main` as :class:`CtrlC`."""

    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt as e:
            raise CtrlC() from e


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--debug", is_flag=True, help="Show the full traceback on errors (or set CKPTFIX_DEBUG=1).")
@click.version_option(package_name="ckptfix", prog_name="ckptfix")
def cli(debug: bool) -> None:
    """Make PyTorch checkpoints and GPUs stop getting in your way.

    \b
    Checkpoints:  inspect, scan, strip-prefix, add-prefix, align, convert, sanitize
    GPUs:         gpus, pick-gpu, doctor
    Training:     train, demo
    """
    # --debug is read by ckptfix.cli.main from the arguments (it must know before Click parses them)
