"""``ckptfix gpus``, ``ckptfix pick-gpu`` and ``ckptfix doctor``: thin Click shells over :mod:`ckptfix.gpu`.

Importing this module never imports torch (only ``doctor`` does, inside the command).
"""

from __future__ import annotations

import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import click

from ckptfix.cli import cli
from ckptfix.cli._common import emit_json, info, json_option, table, warn
from ckptfix.errors import CkptfixError, NoGpuError

_TIMEOUT_HELP = "Seconds to wait for each nvidia-smi call."


def _gib(mib: int | None) -> str:
    return "-" if mib is None else f"{mib / 1024:.1f}"


def _short_uuid(uuid: str | None) -> str:
    """``GPU-a44622e3-...`` -> ``GPU-a44622e3`` (CUDA accepts any unambiguous prefix)."""
    if not uuid:
        return "-"
    if uuid.startswith("MIG-GPU-"):
        return uuid  # legacy MIG ids need the /gi/ci tail
    head, _, rest = uuid.partition("-")
    return f"{head}-{rest[:8]}" if rest else uuid


def _pci_domain(pci: str | None) -> int | None:
    parts = (pci or "").split(":")
    try:
        return int(parts[0], 16) if len(parts) == 3 else None
    except ValueError:
        return None


def _short_pci(pci: str | None, with_domain: bool = False) -> str:
    """``00000000:3A:00.0`` -> ``3a:00.0``; with ``with_domain`` (a multi-domain box) -> ``0000:3a:00.0``."""
    if not pci:
        return "-"
    parts = pci.split(":")
    if len(parts) == 3:
        short = f"{parts[1]}:{parts[2]}".lower()
        dom = _pci_domain(pci)
        return f"{dom:04x}:{short}" if with_domain and dom is not None else short
    return pci.lower()


def _needs_domain(view: Any) -> bool:
    return len({_pci_domain(g.pci_bus_id) for g in view.physical}) > 1 or any(
        _pci_domain(g.pci_bus_id) for g in view.physical
    )


def _env_line(view: Any) -> str:
    cvd = view.cuda_visible_devices
    order = view.cuda_device_order
    cvd_s = "<unset>" if cvd is None else (repr(cvd) if cvd == "" or " " in cvd else cvd)
    order_s = "<unset> (CUDA uses FASTEST_FIRST)" if order is None else order
    if order is not None and order not in ("PCI_BUS_ID", "FASTEST_FIRST"):
        order_s = f"{order!r} (invalid: CUDA uses FASTEST_FIRST)"
    driver = f"  driver={view.driver_version}" if view.driver_version else ""
    migs = sum(1 for d in view.devices if d.mig_device is not None)
    whole = len(view.devices) - migs
    seen = f"{whole} of {len(view.physical)} GPUs" + (f" + {migs} MIG device(s)" if migs else "")
    return f"env: CUDA_VISIBLE_DEVICES={cvd_s}  CUDA_DEVICE_ORDER={order_s}{driver}  ({seen} visible to CUDA)"


def render_gpus(view: Any) -> str:
    """The human table of ``ckptfix gpus`` (stdout part)."""
    mark = "" if view.order_certain else "?"
    dom = _needs_domain(view)
    header = ["cuda", "smi", "uuid", "pci", "name", "used/total GiB", "free GiB", "util", "procs"]
    if not view.devices:  # CUDA sees nothing: show what is there, none of it as cuda:N
        phys = [
            [
                "-",
                str(g.index),
                _short_uuid(g.uuid),
                _short_pci(g.pci_bus_id, dom),
                g.name or "-",
                f"{_gib(g.memory_used_mib)}/{_gib(g.memory_total_mib)}",
                _gib(g.memory_free_mib),
                "-" if g.utilization_pct is None else f"{g.utilization_pct}%",
                "?" if g.process_count is None else str(g.process_count),
            ]
            for g in view.physical
        ]
        return "\n".join([table(phys, header), _env_line(view), "-: not visible to CUDA in this environment"])
    rows = []
    for d in view.devices:
        if d.process_count is not None:
            procs = str(d.process_count)
        else:  # a MIG device: not reported per instance; else the process list failed
            procs = "-" if d.mig_device is not None else "?"
        if d.process_count == 0 and (d.hidden_used_mib or 0) > 0:
            procs = "0*"
        rows.append(
            [
                f"cuda:{d.cuda_index}{mark}",
                str(d.smi_index),
                _short_uuid(d.mig_device.uuid if d.mig_device else d.uuid),
                _short_pci(d.pci_bus_id, dom),
                d.name or "-",
                f"{_gib(d.memory_used_mib)}/{_gib(d.memory_total_mib)}",
                _gib(d.memory_free_mib),
                "-" if d.utilization_pct is None else f"{d.utilization_pct}%",
                procs,
            ]
        )
    out = [table(rows, header), _env_line(view)]
    if any(d.process_count == 0 and (d.hidden_used_mib or 0) > 0 for d in view.devices):
        out.append("0*: memory in use but no process visible here (a process in another container): treated as busy")
    return "\n".join(out)


@cli.command("gpus")
@json_option
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=10.0, show_default=True, metavar="SECONDS", help=_TIMEOUT_HELP)
def gpus_cmd(as_json: bool, timeout: float) -> None:
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
    Exit codes: 0 ok; 20 nvidia-smi missing; 21 no GPU, or CUDA_VISIBLE_DEVICES
    hides all (the table / --json document is still printed: every physical GPU
    with cuda_index null, and the problem cvd_empty with its fix); 25 nvidia-smi
    failed; 26 driver not loaded; 27 driver/library version mismatch.
    """
    from ckptfix.gpu import visible_gpus

    view = visible_gpus(timeout=timeout)
    if as_json:
        emit_json(view.to_dict())
    else:
        click.echo(render_gpus(view))
        for w in view.warnings:
            warn(w)
    if not view.devices:
        p = next((p for p in view.problems if p.code == "cvd_empty"), None)
        fix = p.fix if p else "unset CUDA_VISIBLE_DEVICES or fix it, or run on CPU"
        raise NoGpuError(
            f"nvidia-smi sees {len(view.physical)} GPU(s) but none is visible to CUDA "
            f"(CUDA_VISIBLE_DEVICES={view.cuda_visible_devices!r}): {fix}"
        )
    return None


@cli.command(
    "pick-gpu",
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
)
@click.option("-n", "n", type=click.IntRange(min=1), default=1, show_default=True, help="How many GPUs to pick.")
@click.option("--min-free", metavar="SIZE", help="Minimum free memory, e.g. 10GiB, 512MiB (bare number: GiB).")
@click.option("--max-util", type=click.IntRange(0, 100), metavar="PCT", help="Maximum GPU utilization in percent.")
@click.option("--max-procs", type=click.IntRange(min=0), metavar="N", help="Maximum compute processes on the GPU.")
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
@click.option("--wait", type=click.FloatRange(min=0), default=0.0, metavar="SECONDS", help="Wait up to this long for GPUs to qualify.")
@click.option("--interval", type=click.FloatRange(min=0.01), default=10.0, show_default=True, metavar="SECONDS", help="Seconds between checks while waiting.")
@click.option(
    "--lease",
    type=click.FloatRange(min=0),
    default=None,
    metavar="SECONDS",
    help="Reserve the picked GPUs against other pickers for this long (default 120; 0: only look). "
    "With `-- COMMAND` the lease lasts as long as the command.",
)
@click.option(
    "--release",
    is_flag=True,
    help="Give back timed leases instead of picking: those of this shell's `eval $(pick-gpu --export)` "
    "(CKPTFIX_LEASE_TOKEN), else all of yours.",
)
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=10.0, show_default=True, metavar="SECONDS", help=_TIMEOUT_HELP)
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def pick_gpu_cmd(
    n: int,
    min_free: str | None,
    max_util: int | None,
    max_procs: int | None,
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
    is respected).  GPUs with MIG enabled, with unavailable memory, leased by
    another pick-gpu, or failing the filters are skipped; the rest are ranked by
    free memory (to the GiB), then utilization, then process count.  Memory in use
    with no visible process (another container) counts as a process.

    \b
      ckptfix pick-gpu --lease 0                # only look: prints e.g. GPU-4e9e74b7-...
      eval "$(ckptfix pick-gpu --export)"       # sets CUDA_VISIBLE_DEVICES + order (lease 120 s)
      ckptfix pick-gpu --release                # give that lease back
      ckptfix pick-gpu -n 2 --min-free 40GiB -- torchrun --nproc-per-node 2 train.py
      ckptfix pick-gpu --wait 600 --interval 10 -- python train.py

    \b
    With `-- COMMAND`, pick-gpu becomes COMMAND (exec): same PID, signals and
    exit status are the command's own; the lease is a lock on a descriptor the
    command inherits, so it ends when the command (and any child that kept
    the descriptor) ends.

    \b
    Exit codes: 0 ok (with COMMAND: the command's exit code); 20 nvidia-smi
    missing; 21 no GPU; 22 no GPU fits; 23 --wait timed out; 25 nvidia-smi
    failed; 26 driver not loaded; 27 driver/library mismatch; 9 lease directory
    unusable or unsafe (set CKPTFIX_LEASE_DIR); 126/127 COMMAND cannot be run.
    20, 21, 26 and 27 mean "no usable NVIDIA GPU": fall back to CPU.
    """
    from ckptfix.gpu.pick import LEASE_TOKEN_ENV, lease_dir

    if release:
        if command or export or n != 1 or lease is not None or min_free or max_util is not None or max_procs is not None:
            raise click.UsageError("--release takes no COMMAND and no pick options (only --json)")
        return _release(lease_dir(), os.environ.get(LEASE_TOKEN_ENV) or None, as_json)
    if command and (export or as_json):
        raise click.UsageError("--export/--json print the choice; they cannot be combined with a COMMAND")
    if export and as_json:
        raise click.UsageError("choose one of --export and --json")
    if not export:
        return _pick(n, min_free, max_util, max_procs, False, as_json, ids, wait, interval, lease, timeout, command)
    try:
        return _pick(n, min_free, max_util, max_procs, True, False, ids, wait, interval, lease, timeout, command)
    except (CkptfixError, click.ClickException) as e:
        # `eval "$(ckptfix pick-gpu --export)"` must not quietly set nothing: the eval'd code fails too
        code = e.exit_code if isinstance(e, CkptfixError) else 2
        msg = shlex.quote(f"ckptfix pick-gpu: nothing picked, CUDA_VISIBLE_DEVICES unchanged (exit {code})")
        click.echo(f"echo {msg} >&2; (exit {code})")
        raise


def _pick(
    n: int,
    min_free: str | None,
    max_util: int | None,
    max_procs: int | None,
    export: bool,
    as_json: bool,
    ids: str,
    wait: float,
    interval: float,
    lease: float | None,
    timeout: float,
    command: tuple[str, ...],
) -> int:
    from ckptfix.gpu import visible_gpus
    from ckptfix.gpu.pick import DEFAULT_LEASE_SECONDS, LEASE_TOKEN_ENV, Criteria, lease_dir, parse_size_mib, pick

    try:
        min_free_mib = None if min_free is None else parse_size_mib(min_free)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--min-free") from None
    criteria = Criteria(n=n, min_free_mib=min_free_mib, max_util=max_util, max_procs=max_procs)
    if command:
        lease_seconds: float | None = None  # held by the command for its life (the lock fd survives exec)
    else:
        lease_seconds = DEFAULT_LEASE_SECONDS if lease is None else lease
    token = os.environ.get(LEASE_TOKEN_ENV) or None
    if export and token is None and lease_seconds:
        token = os.urandom(8).hex()  # marks this shell's leases as its own (take-over, --release)
    result = pick(
        lambda: visible_gpus(timeout=timeout),
        criteria,
        lease_seconds=lease_seconds,
        directory=lease_dir(),
        wait=wait,
        interval=interval,
        by=ids,
        on_wait=info,
        token=token,
    )
    env = result.env
    for r in result.chosen:
        g = r.gpu
        info(f"picked GPU {g.smi_index} ({_short_uuid(g.uuid)}, {g.name or '?'}): {r.reason}")
    if result.view is not None:
        # pick-gpu's ids are order-proof, so the mixed-models warning is moot -- unless an index-based
        # CUDA_VISIBLE_DEVICES chose the candidates: then which GPUs those are is itself a guess
        by_index = result.view.spec is not None and result.view.spec.kind == "index"
        for w in result.view.warnings:
            if by_index or not w.startswith("GPUs are different models"):
                warn(w)
    if command:
        from ckptfix.gpu.pick import LEASES_HELD_ENV

        env = dict(env, **{LEASES_HELD_ENV: ",".join(le.key for le in result.leases)})
        return _exec_with(command, env, [le.fd for le in result.leases if le.fd is not None])
    if result.leases and lease_seconds:
        until = time.strftime("%H:%M:%S", time.localtime(result.leases[0].expires or time.time()))
        info(
            f"leased until {until} (--lease {lease_seconds:g}); other pick-gpu runs skip these GPUs until then "
            "(give them back with `ckptfix pick-gpu --release`)"
        )
    if as_json:
        emit_json(result.to_dict())
    elif export:
        line = (
            f"export CUDA_VISIBLE_DEVICES={shlex.quote(env['CUDA_VISIBLE_DEVICES'])}; "
            f"export CUDA_DEVICE_ORDER={env['CUDA_DEVICE_ORDER']}"
        )
        if token and result.leases:
            line += f"; export {LEASE_TOKEN_ENV}={shlex.quote(token)}"
        click.echo(line)
    else:
        click.echo(env["CUDA_VISIBLE_DEVICES"])
        info(
            f"use: CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']} CUDA_DEVICE_ORDER={env['CUDA_DEVICE_ORDER']}"
        )
    return 0


def _release(directory: Path, token: str | None, as_json: bool) -> int:
    from ckptfix.gpu.pick import release_leases

    done = release_leases(directory, token=token)
    if as_json:
        emit_json({"schema": "ckptfix.pick-gpu-release/1", "token": token is not None, "leases": [r.to_dict() for r in done]})
        return 0
    for r in done:
        if r.released:
            click.echo(r.key)
            info(f"released {r.key} ({r.why})")
        else:
            warn(f"{r.key} not released: {r.why}")
    if not done:
        scope = "taken by this shell (CKPTFIX_LEASE_TOKEN)" if token else "of yours"
        info(f"no live timed lease {scope} in {directory}: nothing to release")
    return 0


def _exec_with(command: tuple[str, ...], env_update: dict[str, str], fds: list[int]) -> int:
    """Become COMMAND (``execvp``) with the chosen GPUs; the flock'ed lease fds are inherited across exec.

    One process: signals reach the command exactly as they would without pick-gpu, its exit status is
    the exit status, and the lease ends when the last holder of the descriptor (the command) exits.
    Returns only when the exec failed (127 not found, 126 not executable).
    """
    info(f"running: {shlex.join(command)}  (CUDA_VISIBLE_DEVICES={env_update['CUDA_VISIBLE_DEVICES']})")
    os.environ.update(env_update)
    for fd in fds:
        os.set_inheritable(fd, True)
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
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=10.0, show_default=True, metavar="SECONDS", help=_TIMEOUT_HELP)
def doctor_cmd(as_json: bool, timeout: float) -> None:
    """One report for bug threads: Python, torch build, driver, GPUs, CUDA env, distributed env, problems.

    \b
    Imports torch (to read torch.version.cuda) but never initialises CUDA.
    Always exits 0 when it could write the report; GPU failures (no driver, no
    nvidia-smi) are listed as problems with fixes.
    """
    from ckptfix.gpu.doctor import doctor_report

    report = doctor_report(timeout=timeout)
    if as_json:
        emit_json(report.to_dict())
    else:
        click.echo(render_doctor(report))


def render_doctor(r: Any) -> str:
    """The text form of the report."""
    t = r.torch
    lines = [
        f"python:  {r.python['version']} ({r.python['executable']}) on {r.python['platform']}",
        f"ckptfix: {r.python.get('ckptfix', '?')}",
    ]
    if t.get("installed"):
        build = f"CUDA {t['cuda']} build" if t.get("cuda") else f"{t.get('build', 'cpu').upper()}-only build"
        lines.append(f"torch:   {t['version']} ({build})")
    else:
        err = t.get("error")
        lines.append("torch:   not installed" if err == "not installed" else f"torch:   not importable ({err})")
    lines.append(f"driver:  {r.driver_version or '-'}")
    if r.gpus is not None and r.gpus.devices:
        lines.append("gpus:")
        lines.extend("  " + ln for ln in render_gpus(r.gpus).splitlines())
    elif r.gpus is not None:
        lines.append(f"gpus:    none visible to CUDA ({len(r.gpus.physical)} physical)")
    else:
        lines.append(f"gpus:    unavailable: {r.gpu_error}")
    for k, v in r.environment.items():
        lines.append(f"{k}={'<unset>' if v is None else v}")
    if r.distributed:
        lines.append("distributed: " + " ".join(f"{k}={v}" for k, v in r.distributed.items()))
    else:
        lines.append("distributed: (none of RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, NCCL_* set)")
    if r.problems:
        lines.append(f"problems ({len(r.problems)}):")
        for p in r.problems:
            lines.append(f"  - [{p.code}] {p.message}")
            if p.fix:
                lines.append(f"    fix: {p.fix}")
    else:
        lines.append("problems: none found")
    return "\n".join(lines)
