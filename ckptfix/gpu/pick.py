"""Choose the freest GPU(s), lease them so concurrent jobs do not collide, wait for GPUs.

Nothing here imports torch.

Ranking (pure, :func:`rank_gpus`): among the devices visible to the caller, drop
MIG parents, GPUs whose memory is unavailable (a unified-memory GPU, GB10 or Jetson, stays a candidate with
memory unknown unless ``min_free_mib`` is asked), GPUs leased by another job and
those failing ``min_free_mib`` / ``max_util`` / ``max_procs``; sort the rest by
free memory in exact MiB, where GPUs within :data:`FREE_TOLERANCE_MIB` (512 MiB) of the freest of their
group count as equal (so 0 MiB and 292 MiB of residue tie), then utilization,
then process count, then nothing on it (300+ MiB used with no visible process is another container's idle
CUDA context), then nvidia-smi index.  Used memory with no visible process
(a process in another container) counts as one process.

Choosing (:func:`choose_gpus`): rank, lease (:mod:`ckptfix.gpu.leases`), wait and retry; it changes no
environment.  :func:`ckptfix.gpu.pick_gpu` calls it and then applies the choice to ``os.environ``.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from ckptfix.errors import CudaAlreadyInitializedError, GpuWaitTimeoutError, NoGpuError, NoGpuFitsError
from ckptfix.gpu.cudainit import cuda_init_route
from ckptfix.gpu.leases import (
    DEFAULT_LEASE_SECONDS,
    LEASE_TOKEN_ENV,
    LEASES_HELD_ENV,
    Lease,
    Released,
    held_lease,
    is_held,
    lease_dir,
    lease_file,
    release_leases,
    try_lease,
    undo,
)
from ckptfix.gpu.order import is_unified_memory
from ckptfix.gpu.records import VisibleGpu
from ckptfix.gpu.runner import Runner
from ckptfix.gpu.visible import GpuView, visible_gpus
from ckptfix.text import parse_size

__all__ = [
    "Criteria",
    "ExcludeError",
    "check_exclude",
    "Ranked",
    "Rejected",
    "PickResult",
    "ReleaseResult",
    "parse_size_mib",
    "rank_gpus",
    "selection_env",
    "choose_and_lease",
    "explain_shortfall",
    "failure_dict",
    "pick",
    "choose_gpus",
    "release_my_leases",
    "check_cuda_not_initialized",
    "DEFAULT_LEASE_SECONDS",
]


# ----------------------------------------------------------------------------- criteria and ranking


def parse_size_mib(text: str | int | float) -> int:
    """A memory size in MiB, rounded down, in the one size grammar (:func:`ckptfix.text.parse_size`): ``"10GiB"``
    -> 10240, ``"10GB"`` -> 9536; a bare number is GiB (``"24"`` -> 24576), as ``--min-free`` always read it.

    Raises:
        ValueError: not a size.
    """
    return parse_size(text, bare=2**30, minimum=0) >> 20


@dataclass(frozen=True)
class Criteria:
    """What ``pick-gpu`` asks of a GPU (the command's options)."""

    n: int = 1
    min_free_mib: int | None = None
    max_util: int | None = None
    max_procs: int | None = None
    exclude: tuple[str, ...] = ()  # nvidia-smi indices, GPU/MIG UUIDs (or prefixes) or PCI bus ids
    max_temp: float | None = None  # degrees C
    max_power: float | None = None  # watts


class ExcludeError(ValueError):
    """An ``--exclude`` entry that names no GPU here (a typo must not silently exclude nothing)."""


def _excluded_by(g: VisibleGpu, ids: Sequence[str]) -> str | None:
    """The ``--exclude`` entry that names ``g``, or ``None``."""
    for raw in ids:
        e = raw.strip()
        low = e.lower()
        if e.isdigit() and g.mig_device is None and int(e) == g.smi_index:
            return e
        if low.startswith(("gpu-", "mig-")):
            if g.uuid and g.uuid.lower().startswith(low):  # a whole GPU, or every MIG device of it
                return e
            if g.mig_device is not None and g.mig_device.uuid.lower().startswith(low):
                return e
        elif ":" in e and g.pci_bus_id and _pci(g.pci_bus_id) == _pci(e):
            return e
    return None


def _pci(bus_id: str) -> str:
    """``00000000:3A:00.0`` and ``3a:00.0`` compare equal."""
    parts = bus_id.strip().lower().split(":")
    return ":".join(parts[-2:]) if len(parts) >= 2 else bus_id.lower()


def check_exclude(ids: Sequence[str], view: GpuView) -> None:
    """Refuse ``--exclude`` entries that name no GPU (or MIG device) of ``view``.

    Raises:
        ExcludeError: an entry names nothing here (a usage error, exit 2 in the CLI).
    """
    everything = list(view.candidates) + [VisibleGpu(-1, g) for g in view.physical]
    for e in ids:
        if not any(_excluded_by(g, [e]) for g in everything):
            raise ExcludeError(
                f"--exclude {e!r} names no GPU here: give nvidia-smi indices, GPU or MIG UUIDs (or unique prefixes) "
                "or PCI bus ids, as `ckptfix gpus` lists them"
            )


@dataclass(frozen=True)
class Ranked:
    """A GPU that passed the criteria, with its rank and why."""

    gpu: VisibleGpu
    rank: int  # 1 = best
    effective_procs: int
    reason: str

    def to_dict(self) -> dict[str, Any]:
        """One ``chosen`` entry of ``pick-gpu --json``.

        Returns:
            The GPU's ids, memory, utilization and process count, with the rank and the reason.
        """
        g = self.gpu
        return {
            "rank": self.rank,
            "id": g.id,
            "uuid": g.uuid,
            "smi_index": g.smi_index,
            "cuda_index": g.cuda_index,
            "pci_bus_id": g.pci_bus_id,
            "name": g.name,
            "memory_free_mib": g.memory_free_mib,
            "memory_total_mib": g.memory_total_mib,
            # False on a unified-memory GPU (GB10, Jetson): nvidia-smi reports no memory, it was picked anyway
            "memory_known": g.memory_free_mib is not None or g.mig_device is not None,
            "utilization_pct": g.utilization_pct,
            "process_count": g.process_count,
            "reason": self.reason,
        }


@dataclass(frozen=True)
class Rejected:
    """A GPU that failed the criteria, and why."""

    gpu: VisibleGpu
    reason: str
    # nothing on the machine can change it while pick-gpu waits (excluded, MIG, memory this GPU never reports)
    permanent: bool = False

    def to_dict(self) -> dict[str, Any]:
        """One ``rejected`` entry of ``pick-gpu --json``."""
        return {"uuid": self.gpu.uuid, "smi_index": self.gpu.smi_index, "name": self.gpu.name, "reason": self.reason}

    def __str__(self) -> str:
        return f"GPU {self.gpu.smi_index} ({self.gpu.name or '?'}): {self.reason}"


def _unified_unknown(g: VisibleGpu) -> str | None:
    """nvidia-smi's placeholder (``N/A``) when ``g`` is a unified-memory GPU (GB10, Jetson: no framebuffer of its
    own, memory shared with the CPU) whose memory it does not report, else ``None``."""
    if g.mig_device is not None or (g.memory_free_mib is not None and g.memory_total_mib is not None):
        return None
    why = dict(g.unavailable).get("memory.free") or dict(g.unavailable).get("memory.total") or ""
    if why.upper() in ("N/A", "NOT SUPPORTED") and is_unified_memory(g.name):
        return why
    return None


def _gib(mib: int | None) -> str:
    return "?" if mib is None else f"{mib / 1024:.1f} GiB"


def _effective_procs(g: VisibleGpu) -> int:
    procs = g.process_count or 0
    if procs == 0 and (g.hidden_used_mib or 0) > 0:
        return 1  # memory in use by a process we cannot see (another container / PID namespace)
    return procs


#: free memory within this many MiB counts as equal when ranking (driver residue of a freed GPU is 0-300 MiB)
FREE_TOLERANCE_MIB = 512


#: used memory with no visible process from this much on is something on the GPU: another container's idle CUDA
#: context holds 300-500 MiB, the driver's residue of a freed GPU is 0-300 MiB (nvidia-smi of a released H200)
IDLE_CONTEXT_MIB = 300


def _something_on_it(g: VisibleGpu) -> bool:
    return (g.process_count or 0) == 0 and (g.memory_used_mib or 0) >= IDLE_CONTEXT_MIB


def _tie_key(g: VisibleGpu) -> tuple[int, int, int, int]:
    util = g.utilization_pct if g.utilization_pct is not None else 101
    # then the GPU with nothing on it: an idle CUDA context of another container (below HIDDEN_BUSY_MIB, so not
    # counted as a process) ties on free memory with an empty GPU, and a job there would share the GPU
    return (util, _effective_procs(g), int(_something_on_it(g)), g.smi_index)


def _order(devices: Sequence[VisibleGpu]) -> list[list[VisibleGpu]]:
    """Most free memory first, compared in exact MiB; GPUs within :data:`FREE_TOLERANCE_MIB` of the freest of
    their group count as equal and are ordered by utilization, then processes, then nothing on it (no idle
    context of another container: :data:`IDLE_CONTEXT_MIB`), then nvidia-smi index."""
    by_free = sorted(devices, key=lambda g: (-(g.memory_free_mib or 0), g.smi_index))
    out: list[list[VisibleGpu]] = []
    i = 0
    while i < len(by_free):
        top = by_free[i].memory_free_mib or 0
        j = i
        while j < len(by_free) and top - (by_free[j].memory_free_mib or 0) <= FREE_TOLERANCE_MIB:
            j += 1
        out.append(sorted(by_free[i:j], key=_tie_key))
        i = j
    return out


def _mib(mib: int | None) -> str:
    return "?" if mib is None else f"{mib:,} MiB"


def _why_before(a: VisibleGpu, b: VisibleGpu | None, same_group: bool) -> str:
    if b is None:
        return "the only candidate left"
    fa, fb = a.memory_free_mib or 0, b.memory_free_mib or 0
    if a.memory_free_mib is not None and _unified_unknown(b) is not None:
        return f"its free memory is known; the next candidate GPU {b.smi_index}'s is not (unified memory)"
    if not same_group:
        return (
            f"more free memory than the next candidate GPU {b.smi_index} "
            f"({_mib(fa)} vs {_mib(fb)}, {fa - fb:,} MiB more: beyond the {FREE_TOLERANCE_MIB} MiB tolerance)"
        )
    ka, kb = _tie_key(a), _tie_key(b)
    near = (
        f"free memory within {FREE_TOLERANCE_MIB} MiB of GPU {b.smi_index} ({_mib(fa)} vs {_mib(fb)}: counted as equal)"
    )
    if ka[0] != kb[0]:
        ua = "?" if a.utilization_pct is None else f"{a.utilization_pct}%"
        ub = "?" if b.utilization_pct is None else f"{b.utilization_pct}%"
        return f"{near}, lower utilization ({ua} vs {ub})"
    if ka[1] != kb[1]:
        return f"{near}, same utilization, fewer processes ({ka[1]} vs {kb[1]})"
    if ka[2] != kb[2]:
        return (
            f"{near}, same utilization and processes, nothing on it (GPU {b.smi_index} has {_mib(b.memory_used_mib)} "
            "used with no visible process: another container's idle CUDA context)"
        )
    return f"{near}, same utilization and processes; lower nvidia-smi index"


def _rejection(g: VisibleGpu, criteria: Criteria, leased: Mapping[str, str]) -> tuple[str | None, bool]:
    """Why ``g`` fails ``criteria`` (``None``: it qualifies) and whether that is permanent (waiting cannot help).

    A MIG device that qualifies is leased-checked later (:func:`rank_gpus` ranks MIG devices apart)."""
    procs = _effective_procs(g)
    excluded = _excluded_by(g, criteria.exclude)
    sensor = _sensor_rejection(g, criteria)
    unified = _unified_unknown(g)
    if excluded is not None:
        return f"excluded (--exclude {excluded})", True
    if sensor is not None:
        return sensor, False
    if g.mig_device is not None:
        return _mig_rejection(g, criteria), True
    if g.mig_enabled:
        return "MIG is enabled: CUDA cannot use the whole GPU (pick one of its MIG devices)", True
    if unified is not None and criteria.min_free_mib is not None:
        return (
            f"memory is unknown on this GPU (unified memory shared with the CPU: nvidia-smi reports [{unified}]), "
            "so --min-free cannot be checked: drop --min-free to pick it",
            True,
        )
    if unified is None and (g.memory_free_mib is None or g.memory_total_mib is None):
        why = dict(g.unavailable).get("memory.free") or dict(g.unavailable).get("memory.total") or "missing"
        return f"memory is unavailable ([{why}])", False
    if g.id in leased:
        return f"leased by another job ({leased[g.id]})", False
    if (
        criteria.min_free_mib is not None
        and g.memory_free_mib is not None
        and g.memory_free_mib < criteria.min_free_mib
    ):
        have, need = _gib(g.memory_free_mib), _gib(criteria.min_free_mib)
        if have == need:  # 81,919 MiB is not "80.0 GiB < 80.0 GiB"
            have, need = _mib(g.memory_free_mib), _mib(criteria.min_free_mib)
        return f"{have} free < --min-free {need}", False
    if criteria.max_util is not None and g.utilization_pct is None:
        return "utilization unavailable and --max-util was given", False
    if criteria.max_util is not None and g.utilization_pct is not None and g.utilization_pct > criteria.max_util:
        return f"{g.utilization_pct}% utilization > --max-util {criteria.max_util}", False
    if criteria.max_procs is not None and g.process_count is None:
        return "process count unavailable (--query-compute-apps failed or timed out) and --max-procs was given", False
    if criteria.max_procs is not None and procs > criteria.max_procs:
        hidden = (
            f" ({_gib(g.hidden_used_mib)} used with no visible process: a process in another container)"
            if (g.process_count or 0) == 0
            else ""
        )
        return f"{procs} process(es) > --max-procs {criteria.max_procs}{hidden}", False
    return None, False


def rank_gpus(
    devices: Sequence[VisibleGpu], criteria: Criteria, *, leased: Mapping[str, str] | None = None
) -> tuple[list[Ranked], list[Rejected]]:
    """Filter and order candidates (pure).  ``leased`` maps a GPU id to who holds it.

    Returns:
        ``(ranked, rejected)``: the qualifying GPUs best first, each with the reason, and the others with why.
    """
    leased = leased or {}
    ok: list[VisibleGpu] = []
    migs: list[VisibleGpu] = []
    rejected: list[Rejected] = []
    for g in devices:
        why, permanent = _rejection(g, criteria, leased)
        if why is None:
            (migs if g.mig_device is not None else ok).append(g)
        else:
            rejected.append(Rejected(g, why, permanent=permanent))
    ordered = _order(ok)
    groups = {id(g): k for k, grp in enumerate(ordered) for g in grp}
    ok = [g for grp in ordered for g in grp]
    ranked = []
    for i, g in enumerate(ok):
        nxt = ok[i + 1] if i + 1 < len(ok) else None
        util = "?" if g.utilization_pct is None else f"{g.utilization_pct}%"
        hidden = (
            f", {_gib(g.hidden_used_mib)} used by processes not visible here"
            if (g.process_count or 0) == 0 and (g.hidden_used_mib or 0) > 0
            else ""
        )
        nprocs = "?" if g.process_count is None else str(g.process_count)
        unified = _unified_unknown(g)
        memory = (
            f"memory unknown (unified memory shared with the CPU: nvidia-smi reports [{unified}]; nothing checked "
            "how much is free)"
            if unified is not None
            else f"{_gib(g.memory_free_mib)} free"
        )
        desc = f"{memory}, {util} util, {nprocs} process(es){hidden}"
        same = nxt is not None and groups[id(g)] == groups[id(nxt)]
        ranked.append(Ranked(g, i + 1, _effective_procs(g), f"{desc}; {_why_before(g, nxt, same)}"))
    # MIG devices after whole GPUs: the biggest slice first (their use is not reported; leases tell them apart)
    migs.sort(key=lambda g: (-(g.memory_total_mib or 0), g.smi_index, g.mig_device.device_index if g.mig_device else 0))
    for g in migs:
        if g.id in leased:
            rejected.append(Rejected(g, f"leased by another job ({leased[g.id]})"))
            continue
        m = g.mig_device
        ranked.append(
            Ranked(
                g,
                len(ranked) + 1,
                0,
                f"MIG {m.profile if m else '?'} slice of GPU {g.smi_index} ({_gib(g.memory_total_mib)}); memory use "
                "and utilization are not reported per MIG device, so slices are told apart by leases, biggest first",
            )
        )
    return ranked, rejected


def _sensor_rejection(g: VisibleGpu, criteria: Criteria) -> str | None:
    """``--max-temp`` / ``--max-power`` (a MIG device reads its GPU's sensors); unknown values fail the filter."""
    if criteria.max_temp is not None:
        if g.temperature_c is None:
            return "temperature unavailable and --max-temp was given"
        if g.temperature_c > criteria.max_temp:
            return f"{g.temperature_c:g} C > --max-temp {criteria.max_temp:g}"
    if criteria.max_power is not None:
        if g.power_w is None:
            return "power draw unavailable and --max-power was given"
        if g.power_w > criteria.max_power:
            return f"{g.power_w:g} W > --max-power {criteria.max_power:g}"
    return None


def _mig_rejection(g: VisibleGpu, criteria: Criteria) -> str | None:
    """Why a MIG device cannot be picked for ``criteria``, or ``None``."""
    if criteria.n > 1:
        return f"a MIG device, and a CUDA process sees a single MIG instance: -n {criteria.n} cannot use MIG devices"
    if criteria.max_util is not None:
        return "a MIG device: utilization is not reported per MIG device and --max-util was given"
    if criteria.max_procs is not None:
        return "a MIG device: processes are not reported per MIG device and --max-procs was given"
    size = g.memory_total_mib
    if criteria.min_free_mib is not None and (size is None or size < criteria.min_free_mib):
        return f"a MIG slice of {_gib(size)} < --min-free {_gib(criteria.min_free_mib)}"
    return None


# ----------------------------------------------------------------------------- choosing


@dataclass
class PickResult:
    """What :func:`choose_gpus` / :func:`ckptfix.gpu.pick_gpu` chose.

    ``env`` is the environment that makes CUDA see the choice (empty when too few qualified); ``leases``
    the leases taken (held ones have an open ``fd``); ``lease_seconds`` the length of timed leases
    (``None``: held); ``token`` the lease token the timed leases carry.
    """

    chosen: list[Ranked]
    rejected: list[Rejected]
    env: dict[str, str]
    leases: list[Lease] = field(default_factory=list)
    view: GpuView | None = None
    waited_s: float = 0.0
    lease_seconds: float | None = None
    token: str | None = None

    @property
    def ids(self) -> list[str]:
        """The chosen GPUs' ids, in order."""
        return [r.gpu.id for r in self.chosen]

    @property
    def notices(self) -> list[str]:
        """The view's warnings that matter to this choice.

        The chosen ids are UUIDs or PCI-order indices, so "cuda:N may not be nvidia-smi GPU N" on mixed models
        does not matter -- unless an index-based ``CUDA_VISIBLE_DEVICES`` chose the candidates: then which
        GPUs those are is itself a guess.
        """
        mine = [le.warning for le in self.leases if le.warning]
        if self.view is None:
            return mine
        if self.view.spec is not None and self.view.spec.kind == "index":
            return list(self.view.warnings) + mine
        moot = {str(p) for p in self.view.problems if p.code == "order_uncertain"}
        return [w for w in self.view.warnings if w not in moot] + mine

    def to_dict(self) -> dict[str, Any]:
        """The ``ckptfix pick-gpu --json`` document."""
        return {
            "schema": "ckptfix.pick-gpu/1",
            "CUDA_VISIBLE_DEVICES": self.env.get("CUDA_VISIBLE_DEVICES"),
            "CUDA_DEVICE_ORDER": self.env.get("CUDA_DEVICE_ORDER"),
            "chosen": [r.to_dict() for r in self.chosen],
            "rejected": [r.to_dict() for r in self.rejected],
            "leases": [lease.to_dict() for lease in self.leases],
            "waited_s": round(self.waited_s, 3),
            "warnings": (list(self.view.warnings) if self.view else [])
            + [le.warning for le in self.leases if le.warning],
        }


def failure_dict(exit_code: int, message: str, result: PickResult | None = None) -> dict[str, Any]:
    """The ``ckptfix pick-gpu --json`` document of a pick that failed: nothing chosen, ``error`` with the exit
    code and message, and (when ranking got that far) why each GPU was rejected and which ones did qualify.

    Args:
        exit_code: the command's exit code.
        message: the error message (as printed after ``Error:``).
        result: the last round's :class:`PickResult` (``None``: it failed before ranking, e.g. no driver).
    """
    view = result.view if result is not None else None
    return {
        "schema": "ckptfix.pick-gpu/1",
        "CUDA_VISIBLE_DEVICES": None,
        "CUDA_DEVICE_ORDER": None,
        "chosen": [],
        "qualified": [r.to_dict() for r in result.chosen] if result is not None else [],
        "rejected": [r.to_dict() for r in result.rejected] if result is not None else [],
        "leases": [],
        "waited_s": round(result.waited_s, 3) if result is not None else 0.0,
        "warnings": list(view.warnings) if view is not None else [],
        "error": {"exit_code": exit_code, "message": message},
    }


def selection_env(chosen: Sequence[VisibleGpu], *, by: str = "uuid") -> dict[str, str]:
    """The environment that makes CUDA see exactly ``chosen``, in that order.

    ``by="uuid"``: UUIDs (immune to CUDA's ordering); ``by="index"``: PCI-order indices (the
    numbering of ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, always set), which differ from nvidia-smi's
    index where nvidia-smi lists GPUs in another order.
    """
    if by == "index" or any(not g.uuid for g in chosen):
        ids = [
            g.mig_device.uuid if g.mig_device else str(g.smi_index if g.pci_index is None else g.pci_index)
            for g in chosen
        ]
    else:
        ids = [g.id for g in chosen]
    return {"CUDA_VISIBLE_DEVICES": ",".join(ids), "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


def choose_and_lease(
    view: GpuView,
    criteria: Criteria,
    *,
    lease_seconds: float | None,
    directory: str | os.PathLike[str] | None,
    by: str = "uuid",
    token: str | None = None,
) -> PickResult:
    """Rank, then lease the best ``criteria.n`` GPUs not leased by others.

    If fewer than ``n`` qualify, nothing stays leased and the result has fewer
    than ``n`` chosen (``rejected`` says why the others failed).  ``directory=None``
    disables leases; ``token`` makes timed leases carrying it the caller's own (see :func:`try_lease`).

    Args:
        view: the devices the caller's CUDA sees.
        criteria: how many and the filters.
        lease_seconds: ``None`` holds the lock, ``0`` only looks, else a timed lease (see
            :func:`ckptfix.gpu.leases.try_lease`).
        directory: the lease directory, ``None`` for no leases.
        by: ``"uuid"`` or ``"index"`` ids in the environment.
        token: the caller's lease token.

    Returns:
        The :class:`PickResult`; ``env`` is empty when fewer than ``n`` qualified.

    Raises:
        OutputError: the lease directory or a lease file is unusable or unsafe (exit code 9).
    """
    ranked, rejected = rank_gpus(view.candidates, criteria)
    got: list[tuple[Ranked, Lease | None]] = []
    for r in ranked:
        if len(got) == criteria.n:
            break
        if directory is None:
            got.append((r, None))
            continue
        mine = held_lease(lease_file(directory, r.gpu.id))
        if mine is not None:  # an earlier pick_gpu() in this process holds it: ours to use again
            got.append((r, mine))
            continue
        lease, holder = try_lease(directory, r.gpu.id, lease_seconds, token=token)
        held_by_command = r.gpu.id in os.environ.get(LEASES_HELD_ENV, "").split(",")
        if lease is None and holder.endswith("(running)") and held_by_command:
            got.append((r, None))  # pick-gpu -- COMMAND leased it for this very command
            continue
        if lease is None:
            if holder.startswith("this process, "):  # e.g. a Lease the caller took with try_lease()
                rejected.append(Rejected(r.gpu, f"already leased by this process ({holder[14:]})"))
            else:
                rejected.append(Rejected(r.gpu, f"leased by another job ({holder})"))
            continue
        got.append((r, lease))
    if len(got) < criteria.n:
        for _, lease in got:
            if lease is not None and not is_held(lease):  # not one an earlier pick holds
                undo(lease)
        chosen = [r for r, _ in got]
        return PickResult(chosen, rejected, {}, [], view)
    chosen = [Ranked(r.gpu, i + 1, r.effective_procs, r.reason) for i, (r, _) in enumerate(got)]
    leases = [lease for _, lease in got if lease is not None]
    return PickResult(chosen, rejected, selection_env([r.gpu for r in chosen], by=by), leases, view)


def explain_shortfall(result: PickResult, criteria: Criteria) -> str:
    """One line: how many qualify and why each other GPU does not."""
    n_ok = len(result.chosen)
    head = f"need {criteria.n} GPU(s), {n_ok} qualif{'ies' if n_ok == 1 else 'y'}"
    lines = [str(r) for r in result.rejected]
    return head + (": " + "; ".join(lines) if lines else "")


def pick(
    get_view: Callable[[], GpuView],
    criteria: Criteria,
    *,
    lease_seconds: float | None,
    directory: str | os.PathLike[str] | None,
    wait: float = 0.0,
    interval: float = 10.0,
    by: str = "uuid",
    on_wait: Callable[[str], None] | None = None,
    token: str | None = None,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
    on_result: Callable[[PickResult], None] | None = None,
) -> PickResult:
    """Query, choose, and (with ``wait``) retry every ``interval`` seconds until enough GPUs qualify.

    Raises:
        NoGpuError: CUDA would see no GPU at all (e.g. ``CUDA_VISIBLE_DEVICES=""``).
        NoGpuFitsError: not enough GPUs qualify and ``wait`` is 0.
        GpuWaitTimeoutError: still not enough after ``wait`` seconds.

    Args:
        get_view: makes a fresh :class:`GpuView` (runs nvidia-smi).
        criteria: how many and the filters.
        lease_seconds: see :func:`choose_and_lease`.
        directory: the lease directory, ``None`` for no leases.
        wait: seconds to keep retrying (0: fail at once).
        interval: seconds between retries.
        by: ``"uuid"`` or ``"index"`` ids.
        on_wait: called with a progress line before each wait.
        token: the caller's lease token.
        sleep: the sleep function (tests).
        clock: the monotonic clock (tests).
        on_result: called with each round's :class:`PickResult` (``waited_s`` set), the failing one included,
            before the error is raised (``pick-gpu --json`` reports the rejections of a failed pick).
    """
    if criteria.n < 1:
        raise ValueError("n must be at least 1")
    start = clock()
    while True:
        view = get_view()
        check_exclude(criteria.exclude, view)
        if not view.candidates:
            cvd = view.cuda_visible_devices
            detail = (
                f"nvidia-smi sees {len(view.physical)} GPU(s) but CUDA_VISIBLE_DEVICES={cvd!r} hides all of them"
                if view.physical
                else "nvidia-smi lists no GPU"
            )
            fix = next((p.fix for p in view.problems if p.code == "cvd_empty"), None) if view.physical else None
            raise NoGpuError(
                f"{detail}: {fix} (see `ckptfix gpus`), or run on CPU"
                if fix
                else f"{detail}: unset or fix CUDA_VISIBLE_DEVICES (see `ckptfix gpus`), or run on CPU"
            )
        if len(view.candidates) < criteria.n:
            if on_result is not None:
                on_result(PickResult([], [], {}, [], view, waited_s=clock() - start))
            raise NoGpuFitsError(
                f"asked for {criteria.n} GPU(s) but only {len(view.candidates)} are visible to this process: "
                "ask for fewer, or widen CUDA_VISIBLE_DEVICES"
            )
        result = choose_and_lease(view, criteria, lease_seconds=lease_seconds, directory=directory, by=by, token=token)
        result.waited_s = clock() - start
        if on_result is not None:
            on_result(result)
        if len(result.chosen) >= criteria.n:
            return result
        why = explain_shortfall(result, criteria)
        elapsed = clock() - start
        if result.rejected and all(r.permanent for r in result.rejected):  # nothing a wait could change
            raise NoGpuFitsError(f"no GPU fits the request ({why}); waiting cannot help: relax the filters")
        if wait <= 0:
            raise NoGpuFitsError(f"no GPU fits the request ({why}); relax the filters or use --wait SECONDS")
        if elapsed >= wait:
            raise GpuWaitTimeoutError(
                f"waited {elapsed:.0f}s and GPUs still do not qualify ({why}); raise --wait or relax the filters"
            )
        if on_wait is not None:
            short = why.split(":", 1)[0]  # the per-GPU reasons come with the final error
            on_wait(f"waiting for GPUs ({short}, {elapsed:.0f}s of {wait:g}s); next check in {interval:g}s")
        sleep(max(0.0, min(interval, wait - elapsed)))


def check_cuda_not_initialized() -> None:
    """Raise if CUDA is already initialised here (then ``CUDA_VISIBLE_DEVICES`` can no longer take effect).

    Raises:
        CudaAlreadyInitializedError: with the route that initialised it and the fix (exit code 24).
    """
    route = cuda_init_route()
    if route is not None:
        raise CudaAlreadyInitializedError(
            f"CUDA is already initialised in this process ({route}), so setting CUDA_VISIBLE_DEVICES now has no "
            "effect: call pick_gpu() before any torch.cuda call (torch.cuda.is_available() included), or run "
            "`ckptfix pick-gpu -- python ...` instead"
        )


def _lease_seconds(lease: float | bool | None) -> float | None:
    """``True``: held (``None``); ``None``: the default timed lease; ``False``: none (0); a number: seconds."""
    if lease is True:
        return None
    if lease is None:
        return DEFAULT_LEASE_SECONDS
    return 0.0 if lease is False else float(lease)


def choose_gpus(
    n: int = 1,
    *,
    min_free: str | int | float | None = None,
    max_util: int | None = None,
    max_procs: int | None = None,
    exclude: Sequence[str] = (),
    max_temp: float | None = None,
    max_power: float | None = None,
    wait: float = 0.0,
    interval: float = 10.0,
    lease: float | bool | None = None,
    by: str = "uuid",
    token: str | None = None,
    new_token: bool = False,
    env: Mapping[str, str] | None = None,
    runner: Runner | None = None,
    timeout: float = 10.0,
    on_wait: Callable[[str], None] | None = None,
    on_result: Callable[[PickResult], None] | None = None,
) -> PickResult:
    """Choose (and lease) the ``n`` freest GPUs visible under ``env``; change no environment.

    The policy of ``ckptfix pick-gpu`` and :func:`ckptfix.gpu.pick_gpu`: candidates are the devices CUDA sees
    under ``env`` (:func:`ckptfix.gpu.visible.visible_gpus`), filtered and ranked by :func:`rank_gpus`, leased
    in the lease directory of ``env`` (:func:`ckptfix.gpu.leases.lease_dir`), retried every ``interval``
    seconds for up to ``wait`` seconds.

    Args:
        n: how many GPUs.
        min_free: minimum free memory, e.g. ``"10GiB"`` (:func:`~ckptfix.text.parse_size`; a bare number is GiB).
        max_util: maximum utilization in percent.
        max_procs: maximum number of compute processes.
        exclude: GPUs never to pick: nvidia-smi indices, GPU/MIG UUIDs (or unique prefixes), PCI bus ids.
        max_temp: maximum temperature in degrees C (an unreported temperature fails it).
        max_power: maximum power draw in watts (an unreported one fails it).
        wait: seconds to keep retrying until enough GPUs qualify (0: fail at once).
        interval: seconds between retries.
        lease: ``True`` holds the lease lock (for the life of this process, or of a command it execs with the
            returned lease descriptors); ``None`` a timed lease of :data:`DEFAULT_LEASE_SECONDS`; a number a timed
            lease of that many seconds; ``False`` or ``0`` takes none (only looks).
        by: ``"uuid"`` or ``"index"`` (PCI-order) ids in the returned ``CUDA_VISIBLE_DEVICES``.
        token: the lease token; ``None`` reads ``$CKPTFIX_LEASE_TOKEN`` from ``env`` (a shell's own timed leases
            are then taken over, not refused); ``""`` means none.
        new_token: with a timed lease and no token, make a new one (``pick-gpu --export`` hands it to the shell).
        env: the environment to read (default ``os.environ``); never written.
        runner: runs one nvidia-smi command (tests).
        timeout: seconds to wait for each nvidia-smi call.
        on_wait: called with a progress line before each wait.
        on_result: called with each round's :class:`PickResult`, a failing one included (see :func:`pick`).

    Returns:
        :class:`PickResult`: ``chosen`` (ranked, each with the reason), ``env`` to apply, ``leases``,
        ``lease_seconds`` and ``token``.

    Raises:
        ValueError: ``min_free`` is not a size, or ``n`` < 1; :class:`ExcludeError` an ``exclude`` entry
            names no GPU here.
        NoGpuError / GpuToolingError: no GPU or no driver (20, 21, 26, 27).
        NoGpuFitsError: too few GPUs qualify (22).  GpuWaitTimeoutError: ``wait`` ran out (23).
        OutputError: the lease directory is unusable or unsafe (9).
    """
    environ: Mapping[str, str] = os.environ if env is None else env
    criteria = Criteria(
        n=n,
        min_free_mib=None if min_free is None else parse_size_mib(min_free),
        max_util=max_util,
        max_procs=max_procs,
        exclude=tuple(exclude),
        max_temp=max_temp,
        max_power=max_power,
    )
    seconds = _lease_seconds(lease)
    tok = environ.get(LEASE_TOKEN_ENV) if token is None else token
    tok = tok or None
    if new_token and tok is None and seconds:
        tok = os.urandom(8).hex()  # marks this shell's leases as its own (take-over, --release)
    result = pick(
        lambda: visible_gpus(env=environ, runner=runner, timeout=timeout),
        criteria,
        lease_seconds=seconds,
        directory=lease_dir(environ),
        wait=wait,
        interval=interval,
        by=by,
        on_wait=on_wait,
        token=tok,
        on_result=on_result,
    )
    result.lease_seconds = seconds
    result.token = tok
    return result


@dataclass(frozen=True)
class ReleaseResult:
    """What :func:`release_my_leases` gave back."""

    directory: str
    token: str | None
    leases: list[Released]

    def to_dict(self) -> dict[str, Any]:
        """The ``ckptfix pick-gpu --release --json`` document."""
        return {
            "schema": "ckptfix.pick-gpu-release/1",
            "token": self.token is not None,
            "leases": [r.to_dict() for r in self.leases],
        }


def release_my_leases(env: Mapping[str, str] | None = None) -> ReleaseResult:
    """Give back the caller's timed leases: those of ``$CKPTFIX_LEASE_TOKEN`` when set, else all of the user's.

    Args:
        env: the environment (lease directory and token; default ``os.environ``).

    Returns:
        :class:`ReleaseResult` listing each live lease found, released or not (and why).

    Raises:
        OutputError: the lease directory is unsafe or unusable (exit code 9).
    """
    environ: Mapping[str, str] = os.environ if env is None else env
    directory = lease_dir(environ)
    token = environ.get(LEASE_TOKEN_ENV) or None
    return ReleaseResult(directory, token, release_leases(directory, token=token))
