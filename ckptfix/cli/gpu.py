"""``ckptfix gpus``, ``ckptfix pick-gpu`` and ``ckptfix doctor``: thin Click shells over :mod:`ckptfix.gpu`.

Importing this module never imports torch (only ``doctor`` does, inside the command).
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from typing import Any

import click

from ckptfix.cli import cli
from ckptfix.cli._common import emit_json, info, json_option, table, warn
from ckptfix.errors import NoGpuError

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


def _short_pci(pci: str | None) -> str:
    if not pci:
        return "-"
    parts = pci.split(":")
    if len(parts) == 3:
        return f"{parts[1]}:{parts[2]}".lower()
    return pci.lower()


def _env_line(view: Any) -> str:
    cvd = view.cuda_visible_devices
    order = view.cuda_device_order
    cvd_s = "<unset>" if cvd is None else (repr(cvd) if cvd == "" or " " in cvd else cvd)
    order_s = "<unset> (CUDA uses FASTEST_FIRST)" if order is None else order
    if order is not None and order not in ("PCI_BUS_ID", "FASTEST_FIRST"):
        order_s = f"{order!r} (invalid: CUDA uses FASTEST_FIRST)"
    driver = f"  driver={view.driver_version}" if view.driver_version else ""
    return (
        f"env: CUDA_VISIBLE_DEVICES={cvd_s}  CUDA_DEVICE_ORDER={order_s}{driver}  "
        f"({len(view.devices)} of {len(view.physical)} GPUs visible to CUDA)"
    )


def render_gpus(view: Any) -> str:
    """The human table of ``ckptfix gpus`` (stdout part)."""
    mark = "" if view.order_certain else "?"
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
                _short_pci(d.pci_bus_id),
                d.name or "-",
                f"{_gib(d.memory_used_mib)}/{_gib(d.memory_total_mib)}",
                _gib(d.memory_free_mib),
                "-" if d.utilization_pct is None else f"{d.utilization_pct}%",
                procs,
            ]
        )
    header = ["cuda", "smi", "uuid", "pci", "name", "used/total GiB", "free GiB", "util", "procs"]
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
    Exit codes: 0 ok; 20 nvidia-smi missing; 21 no GPU (or CUDA_VISIBLE_DEVICES
    hides all); 25 nvidia-smi failed; 26 driver not loaded; 27 driver/library
    version mismatch.
    """
    from ckptfix.gpu import visible_gpus

    view = visible_gpus(timeout=timeout)
    if not view.devices:
        why = "; ".join(p.message for p in view.problems if p.code.startswith("cvd")) or "CUDA sees no GPU"
        raise NoGpuError(
            f"nvidia-smi sees {len(view.physical)} GPU(s) but none is visible to CUDA ({why}): "
            "unset CUDA_VISIBLE_DEVICES or fix it, or run on CPU"
        )
    if as_json:
        emit_json(view.to_dict())
        return
    click.echo(render_gpus(view))
    for w in view.warnings:
        warn(w)


@cli.command(
    "pick-gpu",
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
)
@click.option("-n", "n", type=click.IntRange(min=1), default=1, show_default=True, help="How many GPUs to pick.")
@click.option("--min-free", metavar="SIZE", help="Minimum free memory, e.g. 10GiB, 512MiB (bare number: GiB).")
@click.option("--max-util", type=click.IntRange(0, 100), metavar="PCT", help="Maximum GPU utilization in percent.")
@click.option("--max-procs", type=click.IntRange(min=0), metavar="N", help="Maximum compute processes on the GPU.")
@click.option("--export", "export", is_flag=True, help="Print `export CUDA_VISIBLE_DEVICES=...; export CUDA_DEVICE_ORDER=PCI_BUS_ID`.")
@json_option
@click.option(
    "--ids",
    type=click.Choice(["uuid", "index"]),
    default="uuid",
    show_default=True,
    help="Identify GPUs by UUID or by nvidia-smi index (always with CUDA_DEVICE_ORDER=PCI_BUS_ID).",
)
@click.option("--wait", type=click.FloatRange(min=0), default=0.0, metavar="SECONDS", help="Wait up to this long for GPUs to qualify.")
@click.option("--interval", type=click.FloatRange(min=0.01), default=10.0, show_default=True, metavar="SECONDS", help="Seconds between checks while waiting.")
@click.option(
    "--lease",
    type=click.FloatRange(min=0),
    default=None,
    metavar="SECONDS",
    help="Reserve the picked GPUs against other pickers for this long (default 120; 0: none). "
    "With `-- COMMAND` the lease lasts as long as the command.",
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
      ckptfix pick-gpu                          # prints e.g. GPU-4e9e74b7-...
      eval "$(ckptfix pick-gpu --export)"       # sets CUDA_VISIBLE_DEVICES + order
      ckptfix pick-gpu -n 2 --min-free 40GiB -- torchrun --nproc-per-node 2 train.py
      ckptfix pick-gpu --wait 600 --interval 10 -- python train.py

    \b
    Exit codes: 0 ok (with COMMAND: the command's exit code); 20 nvidia-smi
    missing; 21 no GPU; 22 no GPU fits; 23 --wait timed out; 25 nvidia-smi
    failed; 26 driver not loaded; 27 driver/library mismatch; 9 lease directory
    unusable (set CKPTFIX_LEASE_DIR).  20, 21, 26 and 27 mean "no usable NVIDIA
    GPU": fall back to CPU.
    """
    from ckptfix.gpu import visible_gpus
    from ckptfix.gpu.pick import DEFAULT_LEASE_SECONDS, Criteria, lease_dir, parse_size_mib, pick

    if command and (export or as_json):
        raise click.UsageError("--export/--json print the choice; they cannot be combined with a COMMAND")
    if export and as_json:
        raise click.UsageError("choose one of --export and --json")
    try:
        min_free_mib = None if min_free is None else parse_size_mib(min_free)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--min-free") from None
    criteria = Criteria(n=n, min_free_mib=min_free_mib, max_util=max_util, max_procs=max_procs)
    if command:
        lease_seconds: float | None = None  # held by this process and the child for the child's life
    else:
        lease_seconds = DEFAULT_LEASE_SECONDS if lease is None else lease
    result = pick(
        lambda: visible_gpus(timeout=timeout),
        criteria,
        lease_seconds=lease_seconds,
        directory=lease_dir(),
        wait=wait,
        interval=interval,
        by=ids,
        on_wait=info,
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
        return _run_with(command, env, [le.fd for le in result.leases if le.fd is not None])
    if result.leases and lease_seconds:
        until = time.strftime("%H:%M:%S", time.localtime(result.leases[0].expires or time.time()))
        info(f"leased until {until} (--lease {lease_seconds:g}); other pick-gpu runs skip these GPUs until then")
    if as_json:
        emit_json(result.to_dict())
    elif export:
        click.echo(
            f"export CUDA_VISIBLE_DEVICES={shlex.quote(env['CUDA_VISIBLE_DEVICES'])}; "
            f"export CUDA_DEVICE_ORDER={env['CUDA_DEVICE_ORDER']}"
        )
    else:
        click.echo(env["CUDA_VISIBLE_DEVICES"])
        info(
            f"use: CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']} CUDA_DEVICE_ORDER={env['CUDA_DEVICE_ORDER']}"
        )
    return 0


def _in_terminal_foreground() -> bool:
    """True when this process's group is its terminal's foreground group (so a Ctrl-C reached the child too)."""
    for fd in (0, 1, 2):
        try:
            return os.tcgetpgrp(fd) == os.getpgrp()
        except OSError:
            continue
    return False


def _run_with(command: tuple[str, ...], env_update: dict[str, str], fds: list[int]) -> int:
    """Run COMMAND with the chosen GPUs; the lease fds go to the child so the lease lives as long as it does."""
    env = dict(os.environ)
    env.update(env_update)
    info(f"running: {shlex.join(command)}  (CUDA_VISIBLE_DEVICES={env_update['CUDA_VISIBLE_DEVICES']})")
    try:
        proc = subprocess.Popen(list(command), env=env, pass_fds=fds)
    except FileNotFoundError:
        click.echo(f"Error: command not found: {command[0]}", err=True)
        return 127
    except PermissionError:
        click.echo(f"Error: command cannot be executed: {command[0]}", err=True)
        return 126

    def forward(signum: int, _frame: Any) -> None:
        # Ctrl-C goes to the terminal's whole foreground process group, the child included: passing it on
        # would deliver a second SIGINT, which can abort the child's own interrupt handling (a final save)
        if signum == signal.SIGINT and _in_terminal_foreground():
            return
        if proc.poll() is None:
            proc.send_signal(signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)}
    try:
        while True:
            try:
                rc = proc.wait()
                break
            except KeyboardInterrupt:  # pragma: no cover - SIGINT is forwarded above
                continue
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    sys.stdout.flush()
    return rc if rc >= 0 else 128 - rc


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
