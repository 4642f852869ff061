"""``CUDA_VISIBLE_DEVICES`` / ``CUDA_DEVICE_ORDER`` -> the physical GPUs CUDA will use, in order.

:func:`build_view` is pure: it parses the environment (:mod:`ckptfix.gpu.cvd`), numbers the GPUs like
CUDA (:mod:`ckptfix.gpu.order`), selects the devices CUDA will see (the ``_select_*`` functions below)
and lists what is wrong (:mod:`ckptfix.gpu.diagnosis`).  :func:`visible_gpus` runs nvidia-smi
(:mod:`ckptfix.gpu.smi`) and builds the view of this process.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from ckptfix.errors import CkptfixError, NoGpuError
from ckptfix.gpu import diagnosis
from ckptfix.gpu.cudainit import cuda_init_route, cuda_initialized
from ckptfix.gpu.cvd import VisibleSpec, describe_spec, parse_visible_devices, strtoul_prefix
from ckptfix.gpu.order import enumeration_order, is_unified_memory, model_info, pci_order, pci_sort_key, speed_key
from ckptfix.gpu.records import MigDevice, Problem, SmiGpu, SmiSnapshot, VisibleGpu, mig_size_mib
from ckptfix.gpu.runner import Runner
from ckptfix.gpu.smi import query

__all__ = [
    "GpuView",
    "build_view",
    "driverless_view",
    "visible_gpus",
    "HIDDEN_BUSY_MIB",
    # the records and pure helpers a view is made of, importable from here too
    "VisibleSpec",
    "Problem",
    "VisibleGpu",
    "parse_visible_devices",
    "strtoul_prefix",
    "cuda_initialized",
    "cuda_init_route",
    "enumeration_order",
    "pci_sort_key",
    "pci_order",
    "speed_key",
    "model_info",
    "mig_size_mib",
    "is_unified_memory",
]

HIDDEN_BUSY_MIB = 1024


@dataclass(frozen=True)
class GpuView:
    """The machine as a CUDA process with this environment sees it (what ``ckptfix gpus`` prints)."""

    devices: tuple[VisibleGpu, ...]
    physical: tuple[SmiGpu, ...]
    cuda_visible_devices: str | None
    cuda_device_order: str | None
    order_certain: bool
    driver_version: str | None
    cuda_initialized: bool
    warnings: tuple[str, ...] = ()
    problems: tuple[Problem, ...] = field(default=())
    spec: VisibleSpec | None = None
    # every MIG device CUDA_VISIBLE_DEVICES names, when it names several (CUDA enumerates only the first): the
    # devices a job given these slices may choose from, one per process (pick-gpu leases one by its UUID)
    mig_named: tuple[VisibleGpu, ...] = ()
    # set by :func:`driverless_view`: why nvidia-smi could not be asked, and what CUDA_VISIBLE_DEVICES asks for
    error: CkptfixError | None = None
    cvd_summary: str | None = None

    @property
    def candidates(self) -> tuple[VisibleGpu, ...]:
        """What pick-gpu chooses from: the devices CUDA sees, or every MIG device ``CUDA_VISIBLE_DEVICES`` names."""
        return self.mig_named or self.devices

    def cuda_index_of(self, g: SmiGpu) -> int | None:
        """``cuda:N`` of the whole physical GPU ``g`` in this environment, ``None`` if CUDA does not see it.

        Returns:
            Its CUDA index, or ``None``.
        """
        for d in self.devices:
            if d.mig_device is None and d.smi_index == g.index and d.uuid == g.uuid:
                return d.cuda_index
        return None

    def _physical_dict(self, g: SmiGpu) -> dict[str, Any]:
        d = g.to_dict()
        d.pop("processes", None)
        pci = pci_order(self.physical)
        return {
            "cuda_index": self.cuda_index_of(g),
            "smi_index": g.index,
            "pci_index": next((i for i, x in enumerate(pci) if x is g), None),
            **{k: v for k, v in d.items() if k != "index"},
            "process_count": g.process_count,
        }

    def raise_if_none_visible(self) -> None:
        """Fail when CUDA would see no GPU here although nvidia-smi lists some (``ckptfix gpus`` exits 21).

        Raises:
            NoGpuError: no device is visible, with the fix of the ``cvd_empty`` problem (exit code 21).
        """
        if self.devices:
            return
        p = next((p for p in self.problems if p.code == "cvd_empty"), None)
        fix = p.fix if p else "unset CUDA_VISIBLE_DEVICES or fix it, or run on CPU"
        raise NoGpuError(
            f"nvidia-smi sees {len(self.physical)} GPU(s) but none is visible to CUDA "
            f"(CUDA_VISIBLE_DEVICES={self.cuda_visible_devices!r}): {fix}"
        )

    @property
    def effective_order(self) -> str:
        """The order CUDA uses: ``PCI_BUS_ID`` only when set exactly so, else ``FASTEST_FIRST``."""
        return "PCI_BUS_ID" if self.cuda_device_order == "PCI_BUS_ID" else "FASTEST_FIRST"

    def to_dict(self) -> dict[str, Any]:
        """The ``ckptfix gpus --json`` document."""
        return {
            "schema": "ckptfix.gpus/1",
            "driver_version": self.driver_version,
            "environment": {
                "CUDA_VISIBLE_DEVICES": self.cuda_visible_devices,
                "CUDA_DEVICE_ORDER": self.cuda_device_order,
                "effective_order": self.effective_order,
            },
            "order_certain": self.order_certain,
            "cuda_initialized": self.cuda_initialized,
            "physical_gpu_count": len(self.physical),
            "devices": [d.to_dict() for d in self.devices],
            "physical": [self._physical_dict(g) for g in self.physical],
            "warnings": list(self.warnings),
            "problems": [p.to_dict() for p in self.problems],
            **(
                {}
                if self.error is None
                else {
                    "error": {"exit_code": self.error.exit_code, "message": str(self.error)},
                    "cvd_summary": self.cvd_summary,
                }
            ),
        }


# ----------------------------------------------------------------------------- selectors

Chosen = list[tuple[SmiGpu, "MigDevice | None"]]


def _select_all(ordered: Sequence[SmiGpu]) -> tuple[Chosen, list[tuple[SmiGpu, MigDevice]]]:
    """``CUDA_VISIBLE_DEVICES`` unset: every GPU in CUDA's order; a MIG-enabled one as its MIG devices."""
    chosen: Chosen = []
    mig_rows: list[tuple[SmiGpu, MigDevice]] = []
    for g in ordered:
        if g.mig_enabled and g.mig_devices:  # CUDA enumerates its MIG devices, never the parent
            mig_rows.extend((g, m) for m in g.mig_devices)
            chosen.extend((g, m) for m in g.mig_devices)
        else:
            chosen.append((g, None))
    return chosen, mig_rows


def _select_index(spec: VisibleSpec, ordered: Sequence[SmiGpu]) -> tuple[Chosen, list[Problem]]:
    """Indices into CUDA's order; one past the last GPU truncates the list there."""
    chosen: Chosen = []
    for i in spec.entries:
        if i >= len(ordered):
            return chosen, [
                Problem(
                    "cvd_truncated",
                    f"CUDA_VISIBLE_DEVICES={spec.raw!r}: index {i} is out of range (this machine has {len(ordered)} "
                    f"GPU(s)), so CUDA ignores it and every entry after it",
                    f"use indices 0..{len(ordered) - 1}, or UUIDs from `ckptfix gpus`",
                )
            ]
        chosen.append((ordered[i], None))
    return chosen, []


def _uuid_match(candidate: str, uuids: Sequence[str | None], *, exact_case: bool = False) -> tuple[int, str]:
    """Index of the unique uuid starting with candidate (ignoring case unless ``exact_case``), or (-1, why)."""
    if exact_case:  # torch.cuda._transform_uuid_to_ordinals: uuid.startswith(candidate)
        hits = [i for i, u in enumerate(uuids) if u and u.startswith(candidate)]
    else:
        hits = [i for i, u in enumerate(uuids) if u and u.lower().startswith(candidate.lower())]
    if len(hits) == 1:
        return hits[0], ""
    return -1, ("matches no GPU" if not hits else f"is ambiguous ({len(hits)} GPUs start with it)")


def _select_uuid(
    spec: VisibleSpec, gpus: Sequence[SmiGpu], *, exact_case: bool = False
) -> tuple[Chosen, list[Problem]]:
    """GPU UUIDs (unambiguous prefixes allowed); an unknown one truncates, a repeated one hides every GPU.
    ``exact_case``: compare as torch's emulation does (case-sensitively), else ignoring case."""
    chosen: Chosen = []
    uuids = [g.uuid for g in gpus]
    for cand in spec.entries:
        hit, why = _uuid_match(cand, uuids, exact_case=exact_case)
        if hit < 0:
            return chosen, [
                Problem(
                    "cvd_truncated",
                    f"CUDA_VISIBLE_DEVICES entry {cand!r} {why}, so CUDA ignores it and every entry after it",
                    "use full UUIDs from `ckptfix gpus` (or `nvidia-smi -L`)",
                )
            ]
        if any(g is gpus[hit] for g, _ in chosen):
            return [], [
                Problem(
                    "cvd_empty",
                    f"CUDA_VISIBLE_DEVICES={spec.raw!r} names GPU {gpus[hit].index} twice: CUDA then hides every GPU",
                    "list each GPU once",
                )
            ]
        chosen.append((gpus[hit], None))
    return chosen, []


def _select_mig(spec: VisibleSpec, gpus: Sequence[SmiGpu]) -> tuple[Chosen, list[Problem]]:
    """MIG UUIDs as ``nvidia-smi -L`` lists them; an unknown one truncates, a repeated one hides every GPU."""
    cvd = spec.raw
    chosen: Chosen = []
    problems: list[Problem] = []
    migs = [m for g in gpus for m in g.mig_devices]
    if not migs and spec.entries:
        problems.append(
            Problem(
                "cvd_truncated",
                f"CUDA_VISIBLE_DEVICES={cvd!r} names MIG devices but nvidia-smi -L lists none here, "
                "so CUDA sees none of them",
                "use MIG UUIDs exactly as `nvidia-smi -L` prints them on this machine, or GPU UUIDs",
            )
        )
    for cand in spec.entries:
        hits = [m for m in migs if m.uuid.lower().startswith(cand.lower())]
        if len(hits) != 1:
            if migs:
                why = "matches no MIG device" if not hits else "is ambiguous"
                listed = ", ".join(m.uuid for m in migs[:4]) + (", ..." if len(migs) > 4 else "")
                problems.append(
                    Problem(
                        "cvd_truncated",
                        f"CUDA_VISIBLE_DEVICES entry {cand!r} {why}, so CUDA ignores it and every entry after it",
                        f"use one of this machine's MIG devices: {listed} (all listed by `ckptfix gpus` with "
                        "CUDA_VISIBLE_DEVICES unset)",
                    )
                )
            break
        parent = next((g for g in gpus if g.uuid == hits[0].parent_uuid), None)
        if parent is None:  # -L lists a GPU that --query-gpu could not read
            parent = SmiGpu(index=hits[0].parent_index, uuid=hits[0].parent_uuid, mig_enabled=True)
        if any(m is hits[0] for _, m in chosen):
            problems.append(
                Problem(
                    "cvd_empty",
                    f"CUDA_VISIBLE_DEVICES={cvd!r} names MIG device {hits[0].uuid} twice: CUDA then hides every GPU",
                    "list each MIG device once",
                )
            )
            return [], problems
        chosen.append((parent, hits[0]))
    return chosen, problems


def _to_visible(
    cuda_index: int, g: SmiGpu, mig: MigDevice | None, hidden_busy_mib: int, pci_index: int | None = None
) -> VisibleGpu:
    if mig is not None:
        return VisibleGpu(cuda_index, g, mig_device=mig, pci_index=pci_index)
    hidden: int | None = None
    if g.memory_used_mib is not None and g.processes is not None:
        explained = sum(p.used_memory_mib or 0 for p in g.processes)
        hidden = max(g.memory_used_mib - explained, 0) if not g.processes else None
        if hidden is not None and hidden < hidden_busy_mib:
            hidden = 0
    return VisibleGpu(cuda_index, g, hidden_used_mib=hidden, pci_index=pci_index)


def _select(
    spec: VisibleSpec, gpus: Sequence[SmiGpu], ordered: Sequence[SmiGpu]
) -> tuple[Chosen, list[tuple[SmiGpu, MigDevice]], list[Problem]]:
    """The devices CUDA enumerates under ``spec``: ``(chosen, MIG rows of an unset variable, problems)``."""
    if spec.kind == "all":
        chosen, mig_rows = _select_all(ordered)
        return chosen, mig_rows, []
    if spec.kind == "index":
        chosen, problems = _select_index(spec, ordered)
    elif spec.kind == "uuid":
        chosen, problems = _select_uuid(spec, gpus)
    elif spec.kind == "mig":
        chosen, problems = _select_mig(spec, gpus)
    else:  # "none": set but empty
        chosen, problems = [], []
    return chosen, [], problems


def _duplicate_after_invalid(
    spec: VisibleSpec, gpus: Sequence[SmiGpu], ordered: Sequence[SmiGpu]
) -> tuple[Chosen, Problem] | None:
    """``0,9,0`` on a 2-GPU machine: the entry ``9`` ends the list by NVIDIA's documented rule (CUDA sees GPU 0),
    while torch's emulation (``torch.cuda._parse_visible_devices``) rejects the repeated ``0`` first and hides
    every GPU.  The driver's order of the two checks is not documented: ``(documented devices, cvd_uncertain)``,
    or ``None`` when the two readings agree."""
    if not spec.emptied_by_duplicate or not spec.before_duplicate:
        return None
    alt = VisibleSpec(spec.raw, spec.kind, spec.before_duplicate)
    chosen, _, problems = _select(alt, gpus, ordered)
    if not any(p.code == "cvd_truncated" for p in problems):
        return None  # every entry before the repeat is valid: both rules hide every GPU
    got = ", ".join(
        f"cuda:{i} = {'MIG device ' + m.uuid if m is not None else f'GPU {g.index}'}" for i, (g, m) in enumerate(chosen)
    )
    documented = got if chosen else "no GPU"
    stop = next(p for p in problems if p.code == "cvd_truncated")
    keep = ",".join(str(e) for e in spec.before_duplicate[: len(chosen)])
    return chosen, Problem(
        "cvd_uncertain",
        f"CUDA_VISIBLE_DEVICES={spec.raw!r} reads two ways: by NVIDIA's documented rule an invalid entry ends the "
        f"list ({stop.message.split(': ', 1)[-1] if ': ' in stop.message else stop.message}), which gives "
        f"{documented}; torch's emulation (torch.cuda._parse_visible_devices) rejects the repeated entry first, "
        "which hides every GPU. Which the driver applies is not documented, so the answer is uncertain (the "
        "table shows the documented reading)",
        f"write only the GPUs you mean, each once (e.g. CUDA_VISIBLE_DEVICES={keep})"
        if keep
        else "write only the GPUs you mean, each once",
    )


def _case_uncertain(spec: VisibleSpec, gpus: Sequence[SmiGpu], chosen: Chosen) -> Problem | None:
    """``GPU-8E137FA6-...``: UUIDs that match only when case is ignored.  ckptfix reads them as the driver's
    prefix match ignoring case (the table shows that reading); torch's emulation
    (``torch.cuda._transform_uuid_to_ordinals``, behind ``torch.cuda.device_count()`` before CUDA is initialised)
    compares ``uuid.startswith(candidate)``, case-sensitively, and stops at the first entry that matches nothing.
    Which one the driver applies is not documented: a ``cvd_uncertain`` problem when the two readings differ."""
    if spec.kind != "uuid" or not spec.entries:
        return None
    exact, _ = _select_uuid(spec, gpus, exact_case=True)
    if [id(g) for g, _ in exact] == [id(g) for g, _ in chosen]:
        return None

    def reading(c: Chosen) -> str:
        return ", ".join(f"cuda:{i} = GPU {g.index}" for i, (g, _) in enumerate(c)) if c else "no GPU"

    odd = [e for e in spec.entries if e[4:] != e[4:].lower()]
    lower = ",".join("GPU-" + str(e)[4:].lower() for e in spec.entries)
    return Problem(
        "cvd_uncertain",
        f"CUDA_VISIBLE_DEVICES={spec.raw!r} has upper-case UUID hex ({', '.join(repr(e) for e in odd)}) while "
        f"nvidia-smi prints lower case: matched ignoring case it gives {reading(chosen)}; torch's emulation "
        f"(torch.cuda._transform_uuid_to_ordinals, used by torch.cuda.device_count()) matches case-sensitively, "
        f"which gives {reading(exact)}. Which the driver applies is not documented, so the answer is uncertain "
        "(the table shows the case-insensitive reading)",
        f"write the UUIDs in lower case, as nvidia-smi prints them: CUDA_VISIBLE_DEVICES={lower}",
    )


# ----------------------------------------------------------------------------- the view


def build_view(
    snapshot: SmiSnapshot,
    env: Mapping[str, str],
    *,
    cuda_is_initialized: bool = False,
    hidden_busy_mib: int = HIDDEN_BUSY_MIB,
) -> GpuView:
    """Map nvidia-smi's physical GPUs to CUDA's logical devices under ``env``.  Pure.

    Args:
        snapshot: what :func:`ckptfix.gpu.smi.query` learned.
        env: the environment whose ``CUDA_VISIBLE_DEVICES`` / ``CUDA_DEVICE_ORDER`` apply.
        cuda_is_initialized: CUDA is already initialised in the process this view is for.
        hidden_busy_mib: used memory without a visible process below this counts as none.

    Returns:
        The :class:`GpuView`: devices in CUDA order, whether that order is certain, warnings and problems.
    """
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    order = env.get("CUDA_DEVICE_ORDER")
    spec = parse_visible_devices(cvd)
    gpus = list(snapshot.gpus)
    ordered, models_certain = enumeration_order(gpus, order)
    chosen, mig_rows, problems = _select(spec, gpus, ordered)
    problems += diagnosis.spec_problems(
        spec, gpus, any_chosen=bool(chosen), already_empty=any(p.code == "cvd_empty" for p in problems)
    )
    mig_named: Chosen = []
    if spec.kind == "mig" and len(chosen) > 1:  # a CUDA process sees a single MIG instance: the first
        mig_named, chosen = chosen, chosen[:1]
        problems.append(diagnosis.mig_single_problem(spec, mig_named))
    uncertain = _duplicate_after_invalid(spec, gpus, ordered)
    if uncertain is not None:  # NVIDIA's documented rule and torch's emulation disagree: show the former, say so
        chosen, problem = uncertain
        problems = [p for p in problems if p.code != "cvd_empty"] + [problem]
    case_problem = _case_uncertain(spec, gpus, chosen) if uncertain is None else None
    if case_problem is not None:
        problems.append(case_problem)

    pci_pos = {id(g): i for i, g in enumerate(pci_order(gpus))}
    devices = [_to_visible(i, g, m, hidden_busy_mib, pci_pos.get(id(g))) for i, (g, m) in enumerate(chosen)]

    unreadable = diagnosis.unreadable_indices(gpus)
    # physical ids (or nothing) select the devices: nothing depends on CUDA_DEVICE_ORDER
    by_id = spec.kind in ("uuid", "mig", "none")
    problems += diagnosis.order_problems(gpus, order, by_id=by_id, unreadable=unreadable, models_certain=models_certain)
    if mig_rows:
        problems.append(diagnosis.mig_enumeration_problem(mig_rows))
    problems += diagnosis.device_problems(devices, gpus, mig_listed=snapshot.mig_listed)
    if cuda_is_initialized:
        problems.append(diagnosis.CUDA_INITIALIZED)
    certain = (by_id or (models_certain and not unreadable and not mig_rows)) and uncertain is None
    certain = certain and case_problem is None
    return GpuView(
        devices=tuple(devices),
        physical=tuple(gpus),
        cuda_visible_devices=cvd,
        cuda_device_order=order,
        order_certain=certain,
        driver_version=snapshot.driver_version,
        cuda_initialized=cuda_is_initialized,
        warnings=tuple(snapshot.warnings) + tuple(str(p) for p in problems),
        problems=tuple(problems),
        spec=spec,
        mig_named=tuple(
            _to_visible(i, g, m, hidden_busy_mib, pci_pos.get(id(g))) for i, (g, m) in enumerate(mig_named)
        ),
    )


def visible_gpus(
    *,
    env: Mapping[str, str] | None = None,
    runner: Runner | None = None,
    timeout: float = 10.0,
    processes: bool = True,
) -> GpuView:
    """The GPUs a CUDA process with ``env`` (default: this process's) sees, as ``cuda:0``, ``cuda:1``...

    Runs nvidia-smi once or twice (never imports torch) and applies the driver's
    ``CUDA_VISIBLE_DEVICES`` / ``CUDA_DEVICE_ORDER`` rules.

    Args:
        env: the environment (default ``os.environ``).
        runner: runs one nvidia-smi command (tests; default: the real one).
        timeout: seconds to wait for nvidia-smi.
        processes: also count the compute processes.

    Returns:
        A :class:`GpuView`: ``devices`` in CUDA order (each a :class:`VisibleGpu`
        with ``cuda_index``, ``smi_index``, ``uuid``, memory, utilization,
        ``process_count``), ``physical`` (every GPU nvidia-smi lists),
        ``order_certain``, ``warnings`` and ``problems``.

    Raises:
        GpuToolingError: nvidia-smi missing (exit code 20).
        NoGpuError: no GPU (21), driver not loaded (26), driver/library mismatch (27).
        GpuQueryError: nvidia-smi failed otherwise (25).
    """
    environ: Mapping[str, str] = os.environ if env is None else env
    wants_mig = (environ.get("CUDA_VISIBLE_DEVICES") or "").startswith("MIG-") or None
    snap = query(runner=runner, timeout=timeout, processes=processes, mig=wants_mig, env=dict(environ))
    return build_view(snap, environ, cuda_is_initialized=cuda_initialized())


def driverless_view(env: Mapping[str, str], error: CkptfixError) -> GpuView:
    """The view where nvidia-smi cannot be asked (a login node without a driver): no GPU, but what
    ``CUDA_VISIBLE_DEVICES`` asks for needs no driver, so its problems and :func:`describe_spec`'s summary are there.

    Args:
        env: the environment whose ``CUDA_VISIBLE_DEVICES`` / ``CUDA_DEVICE_ORDER`` apply.
        error: why nvidia-smi could not be asked (kept in the view and its ``--json`` document).

    Returns:
        A :class:`GpuView` with no devices, the variable's problems, ``error`` and ``cvd_summary``.
    """
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    order = env.get("CUDA_DEVICE_ORDER")
    spec = parse_visible_devices(cvd)
    problems = diagnosis.spec_problems(spec, [], any_chosen=bool(spec.entries), already_empty=False)
    bad_order = diagnosis.device_order_problem(order)
    if bad_order is not None:
        problems.append(bad_order)
    return GpuView(
        devices=(),
        physical=(),
        cuda_visible_devices=cvd,
        cuda_device_order=order,
        order_certain=spec.kind in ("uuid", "mig", "none"),
        driver_version=None,
        cuda_initialized=False,
        warnings=tuple(str(p) for p in problems),
        problems=tuple(problems),
        spec=spec,
        error=error,
        cvd_summary=describe_spec(spec),
    )
