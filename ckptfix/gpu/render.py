"""The human text of ``ckptfix gpus`` and ``ckptfix doctor`` (pure: a view or report in, text out)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckptfix.gpu.records import short_uuid
from ckptfix.gpu.visible import GpuView
from ckptfix.text import gib, table

if TYPE_CHECKING:
    from ckptfix.gpu.doctor import DoctorReport

__all__ = ["render_gpus", "render_doctor", "short_uuid"]


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


def _needs_domain(view: GpuView) -> bool:
    return len({_pci_domain(g.pci_bus_id) for g in view.physical}) > 1 or any(
        _pci_domain(g.pci_bus_id) for g in view.physical
    )


def _env_line(view: GpuView) -> str:
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


def render_gpus(view: GpuView) -> str:
    """The human table of ``ckptfix gpus`` (its stdout; the warnings go to stderr).

    Returns:
        The table (``cuda:N`` rows, ``?`` marking a guessed order) and the environment line.
    """
    mark = "" if view.order_certain else "?"
    dom = _needs_domain(view)
    header = ["cuda", "smi", "uuid", "pci", "name", "used/total GiB", "free GiB", "util", "procs"]
    if not view.devices:  # CUDA sees nothing: show what is there, none of it as cuda:N
        phys = [
            [
                "-",
                str(g.index),
                short_uuid(g.uuid),
                _short_pci(g.pci_bus_id, dom),
                g.name or "-",
                f"{gib(g.memory_used_mib)}/{gib(g.memory_total_mib)}",
                gib(g.memory_free_mib),
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
                short_uuid(d.mig_device.uuid if d.mig_device else d.uuid),
                _short_pci(d.pci_bus_id, dom),
                d.name or "-",
                f"{gib(d.memory_used_mib)}/{gib(d.memory_total_mib)}",
                gib(d.memory_free_mib),
                "-" if d.utilization_pct is None else f"{d.utilization_pct}%",
                procs,
            ]
        )
    out = [table(rows, header), _env_line(view)]
    if any(d.process_count == 0 and (d.hidden_used_mib or 0) > 0 for d in view.devices):
        out.append("0*: memory in use but no process visible here (a process in another container): treated as busy")
    return "\n".join(out)


def render_doctor(r: DoctorReport) -> str:
    """The text form of ``ckptfix doctor``."""
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
