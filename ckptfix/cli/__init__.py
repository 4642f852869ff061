"""The ``ckptfix`` command line: a thin Click shell over the library.

Each command parses options, calls one library function, renders the result
and lets :func:`main` map :class:`ckptfix.errors.CkptfixError` to
``Error: ...`` on stderr plus the error's exit code.  Importing this package
must never import torch (``--help``, ``gpus`` and ``pick-gpu`` stay fast); the
command modules import the library lazily inside each command.
"""

from __future__ import annotations

import errno
import os
import sys

from ckptfix._startup import imports_quietly

with imports_quietly():  # click and the CLI: see ckptfix._startup
    import click

    from ckptfix._torch import is_torch_missing, missing_error
    from ckptfix.cli._common import error_line
    from ckptfix.cli.group import COMMAND_MODULES, CtrlC, StdoutClosed, cli
    from ckptfix.errors import CkptfixError, InterruptedByUserError, OutputError


def debug_wanted(args: list[str]) -> bool:
    """Whether this run shows tracebacks: ``--debug`` before any ``--``, or ``CKPTFIX_DEBUG`` set (not 0).

    A function of this run's arguments and environment, not a module global: several ``main()`` calls in one
    process (tests, embedding) never inherit an earlier call's ``--debug``.
    """
    opts = args[: args.index("--")] if "--" in args else args
    return "--debug" in opts or os.environ.get("CKPTFIX_DEBUG", "") not in ("", "0")


def main(argv: list[str] | None = None) -> int:
    """Entry point: run the CLI, turn errors into one line and an exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    debug = debug_wanted(args)
    try:
        rv = cli.main(args=args, prog_name="ckptfix", standalone_mode=False)
        return int(rv) if isinstance(rv, int) else 0
    except CkptfixError as e:
        if debug:
            _print_traceback()
        error_line(str(e))
        return e.exit_code
    except ModuleNotFoundError as e:  # a command that needs torch, run without it
        if not is_torch_missing(e):
            return _internal_error(e, debug)
        if debug:
            _print_traceback()
        err = missing_error(_feature(args))
        error_line(str(err))
        return err.exit_code
    except (CtrlC, click.exceptions.Abort, KeyboardInterrupt):
        if debug:
            _print_traceback()
        if sys.stderr.isatty():  # end the terminal's "^C" line
            click.echo(err=True)
        stop = interrupted_error()
        error_line(str(stop))
        return stop.exit_code
    except click.exceptions.Exit as e:
        return e.exit_code
    except click.ClickException as e:
        e.show()
        return e.exit_code
    except (BrokenPipeError, StdoutClosed):
        _drop_stdout()
        return 0
    except OSError as e:
        if not _stdout_failed(e):
            return _internal_error(e, debug)
        if debug:
            _print_traceback()
        _drop_stdout()
        refused = stdout_error(e)
        error_line(str(refused))
        return refused.exit_code
    except Exception as e:  # noqa: BLE001 - an internal bug: still one line unless --debug
        return _internal_error(e, debug)


def _stdout_failed(e: OSError) -> bool:
    """Whether ``e`` is standard output refusing what the command printed (a full disk or quota behind a
    redirect, an I/O error): raised by ``click.echo`` (every line the CLI prints goes through it) writing to
    stdout, with no file name."""
    if e.filename is not None or e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO):
        return False
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and tb.tb_frame.f_locals.get("file") is sys.stdout


def _drop_stdout() -> None:
    """Standard output refused what the command printed: drop what is still buffered for it, here.

    A failed flush keeps the bytes in ``sys.stdout``'s buffer; the interpreter's exit would flush them again
    and fail again (``Exception ignored in: <stdout> ... OSError``, exit 120, not the command's code), unless
    ``PYTHONUNBUFFERED`` happened to be set.  So the stream's descriptor is pointed at ``/dev/null`` (the
    bytes could not be written where it was redirected anyway) and flushed there: the stream stays usable
    (a program that called :func:`main` itself can still print) and every later flush succeeds.  Where that
    cannot be done (no descriptor, no ``/dev/null``) the stream is closed instead: the interpreter does not
    flush a closed stream.
    """
    stream = sys.stdout
    if stream is None:
        return
    try:
        fd = stream.fileno()
        null = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(null, fd)
        finally:
            os.close(null)
        stream.flush()
        return
    except (OSError, ValueError, AttributeError):
        pass  # io.UnsupportedOperation is an OSError and a ValueError
    try:
        stream.close()
    except (OSError, ValueError):
        pass  # closed even so: a failed flush inside close() still closes the descriptor


def stdout_error(e: OSError) -> OutputError:
    """The error of a standard output that refuses the command's output (exit 9, as any output)."""
    return OutputError(
        f"cannot write the output to standard output: {e.strerror or e}; free space where it is redirected, "
        "or redirect it elsewhere"
    )


def interrupted_error() -> InterruptedByUserError:
    """The error of a Ctrl-C: what this process had finished writing (kept), or that nothing was written.

    Returns:
        The error, its message naming the kept outputs (relative to the current directory when under it).
    """
    from ckptfix.display import shown_path
    from ckptfix.files.atomic import FINISHED

    # still there: a command may remove what it finished when the step around it fails (the trainer's epoch)
    kept = [p for p in dict.fromkeys(FINISHED) if os.path.lexists(p)]
    if not kept:
        return InterruptedByUserError("interrupted; nothing was written")
    names = ", ".join(shown_path(p) for p in kept[:5]) + (f" and {len(kept) - 5} more" if len(kept) > 5 else "")
    return InterruptedByUserError(
        f"interrupted; kept {len(kept)} output(s) finished before it: {names}; the one in progress was not written"
    )


def _print_traceback() -> None:
    import traceback  # only with --debug: kept off every command's start-up

    from ckptfix.display import mask_secrets

    sys.stderr.write(mask_secrets(traceback.format_exc()))  # a URL's password in a frame's message: masked too


def _internal_error(e: BaseException, debug: bool) -> int:
    if debug:
        _print_traceback()
    error_line(f"internal error: {type(e).__name__}: {e} (re-run with --debug and report it)")
    return 1


def _feature(args: list[str]) -> str:
    """'ckptfix <command>' for the command in ``args`` (what a torch-missing error names)."""
    cmd = next((a for a in args if not a.startswith("-")), None)
    return f"ckptfix {cmd}" if cmd in COMMAND_MODULES else "this command"


def run() -> None:
    """The console script's entry point before ``ckptfix.__main__:run`` (scripts installed earlier call it)."""
    from ckptfix._startup import command_process

    command_process()
    sys.exit(main())
