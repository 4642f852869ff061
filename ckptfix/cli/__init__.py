"""The ``ckptfix`` command line: a thin Click shell over the library.

Each command parses options, calls one library function, renders the result
and lets :func:`main` map :class:`ckptfix.errors.CkptfixError` to
``Error: ...`` on stderr plus the error's exit code.  Importing this package
must never import torch (``--help``, ``gpus`` and ``pick-gpu`` stay fast); the
command modules import the library lazily inside each command.
"""

from __future__ import annotations

import os
import sys

import click

from ckptfix._torch import is_torch_missing, missing_error
from ckptfix.cli._common import error_line
from ckptfix.cli.group import _DEBUG, COMMAND_MODULES, cli
from ckptfix.errors import CkptfixError


def _debug_wanted() -> bool:
    return _DEBUG["on"] or os.environ.get("CKPTFIX_DEBUG", "") not in ("", "0")


def main(argv: list[str] | None = None) -> int:
    """Entry point: run the CLI, turn errors into one line and an exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if "--debug" in args[: args.index("--") if "--" in args else len(args)]:
        _DEBUG["on"] = True
    try:
        rv = cli.main(args=args, prog_name="ckptfix", standalone_mode=False)
        return int(rv) if isinstance(rv, int) else 0
    except CkptfixError as e:
        if _debug_wanted():
            _print_traceback()
        error_line(str(e))
        return e.exit_code
    except ModuleNotFoundError as e:  # a command that needs torch, run without it
        if not is_torch_missing(e):
            return _internal_error(e)
        if _debug_wanted():
            _print_traceback()
        err = missing_error(_feature(args))
        error_line(str(err))
        return err.exit_code
    except click.exceptions.Abort:
        click.echo("Aborted.", err=True)
        return 130
    except click.exceptions.Exit as e:
        return e.exit_code
    except click.ClickException as e:
        e.show()
        return e.exit_code
    except KeyboardInterrupt:
        click.echo("Interrupted.", err=True)
        return 130
    except BrokenPipeError:
        return 0
    except Exception as e:  # an internal bug: still one line unless --debug
        return _internal_error(e)


def _print_traceback() -> None:
    import traceback  # only with --debug: kept off every command's start-up

    traceback.print_exc()


def _internal_error(e: BaseException) -> int:
    if _debug_wanted():
        _print_traceback()
    error_line(f"internal error: {type(e).__name__}: {e} (re-run with --debug and report it)")
    return 1


def _feature(args: list[str]) -> str:
    """'ckptfix <command>' for the command in ``args`` (what a torch-missing error names)."""
    cmd = next((a for a in args if not a.startswith("-")), None)
    return f"ckptfix {cmd}" if cmd in COMMAND_MODULES else "this command"


def run() -> None:
    sys.exit(main())
