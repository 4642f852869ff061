"""``ckptfix gpus``, ``ckptfix pick-gpu`` and ``ckptfix doctor``: thin Click shells over :mod:`ckptfix.gpu`.

Each command parses its options, makes one library call and renders the answer
(:mod:`ckptfix.gpu.render`).  Importing this module never imports torch (only ``doctor`` does, inside the
library call).
"""

from __future__ import annotations

import os
import sys
import time
from typing import TYPE_CHECKING

import click

from ckptfix._startup import imports_quietly
from ckptfix.cli._common import emit_json, info, json_option, warn
from ckptfix.cli.group import cli
from ckptfix.errors import CkptfixError

if TYPE_CHECKING:
    from ckptfix.gpu.pick import PickResult, ReleaseResult

#: ``--timeout SECONDS``: how long each nvidia-smi call may take (gpus, pick-gpu, doctor)
timeout_option = click.option(
    "--timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=10.0,
    show_default=True,
    metavar="SECONDS",
    help="Seconds to wait for each nvidia-smi call.",
)


@cli.command("gpus")
@json_option
@timeout_option
@click.option(
    "--watch",
    type=click.FloatRange(min=0.1),
    default=None,
    metavar="SECONDS",
    help="Refresh the table every SECONDS until Ctrl-C (which leaves cleanly, exit 0).",
)
def gpus_cmd(as_json: bool, timeout: float, watch: float | None) -> None:
    """Show which physical GPU each cuda:N is, and why.

    \b
    Lists the GPUs CUDA will see in this environment, in CUDA's order:
    cuda index -> nvidia-smi index, UUID, PCI bus id, name, memory, utilization,
    process count; plus CUDA_VISIBLE_DEVICES / CUDA_DEVICE_ORDER and warnings
    (order uncertain on mixed models, entries the driver drops, MIG, ...).
    Never imports torch.  This command is a fresh process, so CUDA is never
    initialised here: call ckptfix.gpu.visible_gpus() inside your program to
    also learn whether CUDA is already initialised there.

    \b
    Without nvidia-smi (a login node) it still says what CUDA_VISIBLE_DEVICES
    asks for (stdout), then exits 20.  With --json every run prints one
    document, failures included: then with "error" (exit_code, message).

    \b
    Exit codes: 0 ok; 20 nvidia-smi missing; 21 no GPU, or CUDA_VISIBLE_DEVICES
    hides all (the table / --json document is still printed: every physical GPU
    with cuda_index null, and the problem cvd_empty with its fix); 25 nvidia-smi
    failed; 28 nvidia-smi printed a row that does not parse; 26 driver not
    loaded; 27 driver/library version mismatch.
    """
    with imports_quietly():  # the library's GPU modules: no collection while they load (ckptfix._startup)
        from ckptfix.errors import GpuToolingError
        from ckptfix.gpu import visible_gpus
        from ckptfix.gpu.render import render_gpus
        from ckptfix.gpu.visible import driverless_view

    if watch is not None:
        if as_json:
            raise click.UsageError("--watch refreshes a table; it cannot be combined with --json")
        _watch_gpus(watch, timeout)
        return

    try:
        view = visible_gpus(timeout=timeout)
    except CkptfixError as e:  # no nvidia-smi (a login node), no driver, a failing nvidia-smi
        # the CUDA_VISIBLE_DEVICES rules need no driver; --json prints its one document on every failure
        view = driverless_view(os.environ, e)
        if as_json:
            emit_json(view.to_dict())
        elif isinstance(e, GpuToolingError):
            click.echo(view.cvd_summary)
            for w in view.warnings:
                warn(w)
        raise
    try:
        view.raise_if_none_visible()
    except CkptfixError as e:  # nvidia-smi lists GPUs, CUDA_VISIBLE_DEVICES hides them: the table, then exit 21
        none_visible: CkptfixError | None = e
    else:
        none_visible = None
    if as_json:
        doc = view.to_dict()
        if none_visible is not None:
            doc["error"] = {"exit_code": none_visible.exit_code, "message": str(none_visible)}
        emit_json(doc)
    else:
        click.echo(render_gpus(view))
        for w in view.warnings:
            warn(w)
    if none_visible is not None:
        raise none_visible


@cli.command(
    "pick-gpu",
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
)
@click.option("-n", "n", type=click.IntRange(min=1), default=1, show_default=True, help="How many GPUs to pick.")
@click.option(
    "--min-free",
    metavar="SIZE",
    help="Minimum free memory, e.g. 40GiB or 512MiB (binary); 40GB = 40*10^9 bytes (decimal); a bare number is GiB.",
)
@click.option("--max-util", type=click.IntRange(0, 100), metavar="PCT", help="Maximum GPU utilization in percent.")
@click.option("--max-procs", type=click.IntRange(min=0), metavar="N", help="Maximum compute processes on the GPU.")
@click.option(
    "--exclude",
    metavar="IDS",
    help="Never pick these GPUs: comma-separated nvidia-smi indices, GPU/MIG UUIDs (or unique prefixes), PCI bus ids.",
)
@click.option("--max-temp", type=click.FloatRange(min=0), metavar="C", help="Maximum GPU temperature in degrees C.")
@click.option("--max-power", type=click.FloatRange(min=0), metavar="W", help="Maximum power draw in watts.")
@click.option(
    "--export",
    "export",
    is_flag=True,
    help="Print shell code for eval: exports CUDA_VISIBLE_DEVICES, CUDA_DEVICE_ORDER=PCI_BUS_ID and "
    "CKPTFIX_LEASE_TOKEN; when nothing is picked it prints a failing command instead.",
)
@json_option
@click.option(
    "--ids",
    type=click.Choice(["uuid", "index"]),
    default="uuid",
    show_default=True,
    help="Identify GPUs by UUID or by PCI-order index (always with CUDA_DEVICE_ORDER=PCI_BUS_ID).",
)
@click.option(
    "--wait",
    type=click.FloatRange(min=0),
    default=0.0,
    metavar="SECONDS",
    help="Wait up to this long for GPUs to qualify.",
)
@click.option(
    "--interval",
    type=click.FloatRange(min=0.01),
    default=10.0,
    show_default=True,
    metavar="SECONDS",
    help="Seconds between checks while waiting.",
)
@click.option(
    "--lease",
    type=click.FloatRange(min=0),
    default=None,
    metavar="SECONDS",
    help="Reserve the picked GPUs against other pickers for this long (default 120; 0: only look). "
    "With `-- COMMAND` the lease lasts as long as the command (--lease 0: none).",
)
@click.option(
    "--release",
    is_flag=True,
    help="Give back timed leases instead of picking: those of this shell's `eval $(pick-gpu --export)` "
    "(CKPTFIX_LEASE_TOKEN), else all of yours.",
)
@timeout_option
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def pick_gpu_cmd(
    n: int,
    min_free: str | None,
    max_util: int | None,
    max_procs: int | None,
    exclude: str | None,
    max_temp: float | None,
    max_power: float | None,
    export: bool,
    as_json: bool,
    ids: str,
    wait: float,
    interval: float,
    lease: float | None,
    release: bool,
    timeout: float,
    command: tuple[str, ...],
) -> int:
    """Pick the N freest GPUs; print their ids, or run COMMAND on them.

    \b
    Candidates are the GPUs visible to the caller (an existing CUDA_VISIBLE_DEVICES
    is respected; several MIG devices in it are each a candidate, one per process).
    GPUs with MIG enabled, with unavailable memory, leased by another pick-gpu,
    excluded, or failing the filters are skipped (an unreported temperature or
    power fails --max-temp / --max-power); the rest are ranked by
    free memory (exact MiB; within 512 MiB counts as equal), then utilization,
    then process count.  Memory in use
    with no visible process (another container) counts as a process.

    \b
      ckptfix pick-gpu --lease 0                # only look: prints e.g. GPU-4e9e74b7-...
      eval "$(ckptfix pick-gpu --export)"       # sets CUDA_VISIBLE_DEVICES + order (lease 120 s)
      ckptfix pick-gpu --release                # give that lease back
      ckptfix pick-gpu -n 2 --min-free 40GiB -- torchrun --nproc-per-node 2 train.py
      ckptfix pick-gpu --wait 600 --interval 10 -- python train.py
      ckptfix pick-gpu --exclude 0,GPU-28780eb0 --max-temp 80 --max-power 300

    \b
    With `-- COMMAND`, pick-gpu becomes COMMAND (exec): same PID, signals and
    exit status are the command's own; the lease is a lock on a descriptor the
    command inherits, so it ends when the command (and any child that kept
    the descriptor) ends.

    \b
    Exit codes: 0 ok (with COMMAND: the command's exit code); 20 nvidia-smi
    missing; 21 no GPU; 22 no GPU fits; 23 --wait timed out; 25 nvidia-smi
    failed; 28 nvidia-smi printed a row that does not parse (named in the
    error; nothing is picked); 26 driver not loaded; 27 driver/library mismatch; 9 lease directory
    unusable or unsafe (set CKPTFIX_LEASE_DIR); 126/127 COMMAND cannot be run.
    20, 21, 26 and 27 mean "no usable NVIDIA GPU": fall back to CPU.
    With --json a failure prints the document too: nothing chosen, "error"
    (exit_code, message), and why each GPU was rejected.

    \b
    A unified-memory GPU (DGX Spark GB10, Jetson), whose memory nvidia-smi
    reports as [N/A], is picked with memory unknown; --min-free refuses it.
    """
    with imports_quietly():  # as in gpus
        from ckptfix.gpu.pick import ExcludeError, choose_gpus, failure_dict, release_my_leases

    if release:
        if (
            command
            or export
            or n != 1
            or lease is not None
            or min_free
            or max_util is not None
            or max_procs is not None
            or exclude
            or max_temp is not None
            or max_power is not None
        ):
            raise click.UsageError("--release takes no COMMAND and no pick options (only --json)")
        try:
            done = release_my_leases()
        except CkptfixError as e:
            if as_json:
                emit_json(
                    {
                        "schema": "ckptfix.pick-gpu-release/1",
                        "token": bool(os.environ.get("CKPTFIX_LEASE_TOKEN")),
                        "leases": [],
                        "error": {"exit_code": e.exit_code, "message": str(e)},
                    }
                )
            raise
        _render_release(done, as_json)
        return 0
    if command and (export or as_json):
        raise click.UsageError("--export/--json print the choice; they cannot be combined with a COMMAND")
    if export and as_json:
        raise click.UsageError("choose one of --export and --json")
    if command and lease is not None and lease > 0:
        raise click.UsageError(
            f"--lease {lease:g} does not apply with -- COMMAND: the lease lasts as long as the command; "
            "drop --lease (or give --lease 0 to take none)"
        )
    rounds: list[PickResult] = []  # the last one says why a failed pick failed (--json)

    def failed(code: int, message: str) -> None:
        _export_failure(export, code)
        if as_json:
            emit_json(failure_dict(code, message, rounds[-1] if rounds else None))

    try:
        result = choose_gpus(
            n,
            min_free=min_free,
            max_util=max_util,
            max_procs=max_procs,
            exclude=tuple(e for e in (exclude or "").split(",") if e.strip()),
            max_temp=max_temp,
            max_power=max_power,
            wait=wait,
            interval=interval,
            # `-- COMMAND` holds the lease for the command's life; --lease 0 takes none
            lease=(lease != 0) if command and lease is not None else (True if command else lease),
            by=ids,
            new_token=export,
            timeout=timeout,
            on_wait=info,
            on_result=rounds.append,
        )
    except ExcludeError as e:
        failed(2, str(e))
        raise click.BadParameter(str(e).removeprefix("--exclude "), param_hint="--exclude") from None
    except ValueError as e:  # --min-free is not a size
        failed(2, str(e))
        raise click.BadParameter(str(e), param_hint="--min-free") from None
    except CkptfixError as e:
        failed(e.exit_code, str(e))
        raise
    _render_pick(result, export=export, as_json=as_json, command=bool(command))
    if command:
        from ckptfix.gpu.leases import LEASES_HELD_ENV

        if lease == 0:
            info("no lease taken (--lease 0): another pick-gpu may choose the same GPU(s) while the command runs")
        held = [le for le in result.leases if le.fd is not None]
        env = dict(result.env, **{LEASES_HELD_ENV: ",".join(le.key for le in held)})
        return _exec_with(command, env, [le.fd for le in held if le.fd is not None])
    return 0


def _watch_gpus(every: float, timeout: float) -> None:
    """``gpus --watch``: the table, redrawn every ``every`` seconds (on a terminal the screen is cleared first;
    otherwise frames follow each other, separated by a blank line), until Ctrl-C, which ends it with exit 0.
    A failing nvidia-smi shows its error in the frame and the watch goes on."""
    from ckptfix.gpu import visible_gpus
    from ckptfix.gpu.render import render_gpus

    tty = sys.stdout.isatty()
    frame = 0
    try:
        while True:
            try:
                view = visible_gpus(timeout=timeout)
                body = render_gpus(view) + "".join(f"\nwarning: {w}" for w in view.warnings)
            except CkptfixError as e:
                body = f"Error: {e}"
            stamp = time.strftime("%H:%M:%S")
            head = f"every {every:g}s, {stamp} (Ctrl-C to leave)"
            if tty:
                click.echo("\033[H\033[2J", nl=False)
            elif frame:
                click.echo("")
            click.echo(f"{head}\n{body}")
            sys.stdout.flush()
            frame += 1
            time.sleep(every)
    except KeyboardInterrupt:
        if tty:
            click.echo("")
        return


def _export_failure(export: bool, code: int) -> None:
    """``eval "$(ckptfix pick-gpu --export)"`` must not quietly set nothing: the eval'd code fails too."""
    if export:
        import shlex  # here, not at the top: start-up of gpus / pick-gpu

        msg = shlex.quote(f"ckptfix pick-gpu: nothing picked, CUDA_VISIBLE_DEVICES unchanged (exit {code})")
        click.echo(f"echo {msg} >&2; (exit {code})")


def _render_pick(result: PickResult, *, export: bool, as_json: bool, command: bool) -> None:
    from ckptfix.gpu.leases import LEASE_TOKEN_ENV
    from ckptfix.gpu.records import short_uuid  # not ckptfix.gpu.render: pick-gpu renders no table

    env = result.env
    for r in result.chosen:
        g = r.gpu
        info(f"picked GPU {g.smi_index} ({short_uuid(g.uuid)}, {g.name or '?'}): {r.reason}")
    for w in result.notices:
        warn(w)
    if command:
        return
    if result.leases and result.lease_seconds:
        until = time.strftime("%H:%M:%S", time.localtime(result.leases[0].expires or time.time()))
        info(
            f"leased until {until} (--lease {result.lease_seconds:g}); other pick-gpu runs skip these GPUs until "
            "then (give them back with `ckptfix pick-gpu --release`)"
        )
    if as_json:
        emit_json(result.to_dict())
    elif export:
        import shlex

        line = (
            f"export CUDA_VISIBLE_DEVICES={shlex.quote(env['CUDA_VISIBLE_DEVICES'])}; "
            f"export CUDA_DEVICE_ORDER={env['CUDA_DEVICE_ORDER']}"
        )
        if result.token and result.leases:
            line += f"; export {LEASE_TOKEN_ENV}={shlex.quote(result.token)}"
        click.echo(line)
    else:
        click.echo(env["CUDA_VISIBLE_DEVICES"])
        info(f"use: CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']} CUDA_DEVICE_ORDER={env['CUDA_DEVICE_ORDER']}")


def _render_release(done: ReleaseResult, as_json: bool) -> None:
    if as_json:
        emit_json(done.to_dict())
        return
    for r in done.leases:
        if r.released:
            click.echo(r.key)
            info(f"released {r.key} ({r.why})")
        else:
            warn(f"{r.key} not released: {r.why}")
    if not done.leases:
        scope = "taken by this shell (CKPTFIX_LEASE_TOKEN)" if done.token else "of yours"
        info(f"no live timed lease {scope} in {done.directory}: nothing to release")


def _restore_signal_dispositions() -> None:
    """Give COMMAND the signal dispositions a shell would: Python ignores SIGPIPE and SIGXFSZ (and exec keeps
    an ignored signal ignored), so without this `pick-gpu -- sh -c 'yes | head -1'` makes ``yes`` print
    "Broken pipe" instead of dying quietly.  Handlers Python installed (SIGINT) revert to the default at exec
    by themselves; a signal ignored by whoever started ckptfix (``nohup``, a background job) stays ignored,
    as it would under a shell; and no signal stays blocked.
    """
    import signal

    for name in ("SIGPIPE", "SIGXFSZ"):
        sig = getattr(signal, name, None)
        if sig is not None:
            signal.signal(sig, signal.SIG_DFL)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_SETMASK, set())


def _exec_with(command: tuple[str, ...], env_update: dict[str, str], fds: list[int]) -> int:
    """Become COMMAND (``execvp``) with the chosen GPUs; the flock'ed lease fds are inherited across exec.

    One process: signals reach the command exactly as they would without pick-gpu, its exit status is
    the exit status, and the lease ends when the last holder of the descriptor (the command) exits.
    Returns only when the exec failed (127 not found, 126 not executable).
    """
    import shlex

    info(f"running: {shlex.join(command)}  (CUDA_VISIBLE_DEVICES={env_update['CUDA_VISIBLE_DEVICES']})")
    os.environ.update(env_update)
    for fd in fds:
        os.set_inheritable(fd, True)
    _restore_signal_dispositions()
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvp(command[0], list(command))
    except (FileNotFoundError, ValueError):  # ValueError: an empty name (`-- ""`, an unset variable)
        click.echo(f"Error: command not found: {shlex.quote(command[0])} (check the name and PATH)", err=True)
        return 127
    except OSError as e:
        click.echo(f"Error: command cannot be executed: {command[0]} ({e.strerror or e})", err=True)
        return 126
    return 126  # pragma: no cover - execvp does not return


@cli.command("doctor")
@json_option
@timeout_option
def doctor_cmd(as_json: bool, timeout: float) -> None:
    """One report for bug threads: Python, torch build, driver, GPUs, CUDA env, distributed env, problems.

    \b
    Imports torch (to read torch.version.cuda) but never initialises CUDA.
    Always exits 0 when it could write the report; GPU failures (no driver, no
    nvidia-smi) are listed as problems with fixes.
    """
    from ckptfix.gpu.doctor import doctor_report
    from ckptfix.gpu.render import render_doctor

    report = doctor_report(timeout=timeout)
    if as_json:
        emit_json(report.to_dict())
    else:
        click.echo(render_doctor(report))
