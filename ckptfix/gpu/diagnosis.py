"""What is wrong with a GPU view, each :class:`Problem` with its fix.  Pure.

:func:`ckptfix.gpu.visible.build_view` selects the devices CUDA will see; the functions here say what
in that selection, the environment or the machine will surprise the user (``ckptfix gpus`` prints them as
warnings, ``ckptfix doctor`` as problems).
"""

from __future__ import annotations

from typing import Sequence

from ckptfix.gpu.cvd import VisibleSpec, cvd_fix
from ckptfix.gpu.order import is_unified_memory
from ckptfix.gpu.records import MigDevice, Problem, SmiGpu, VisibleGpu

__all__ = [
    "spec_problems",
    "unreadable_indices",
    "unreadable_problem",
    "device_order_problem",
    "order_uncertain_problem",
    "order_problems",
    "mig_enumeration_problem",
    "mig_single_problem",
    "device_problems",
    "CUDA_INITIALIZED",
]

CUDA_INITIALIZED = Problem(
    "cuda_initialized",
    "CUDA is already initialised in this process: changing CUDA_VISIBLE_DEVICES now has no effect",
    "set CUDA_VISIBLE_DEVICES before the first CUDA call (or in the shell that starts Python)",
)


def spec_problems(spec: VisibleSpec, gpus: Sequence[SmiGpu], *, any_chosen: bool, already_empty: bool) -> list[Problem]:
    """What the driver drops from ``CUDA_VISIBLE_DEVICES`` or reads leniently, and a list that hides every GPU.

    Args:
        spec: the parsed ``CUDA_VISIBLE_DEVICES``.
        gpus: the physical GPUs.
        any_chosen: whether the selection kept any device.
        already_empty: whether the selection already reported ``cvd_empty``.

    Returns:
        ``cvd_empty`` / ``cvd_truncated`` / ``cvd_lenient`` problems, in that order of the notes.
    """
    cvd = spec.raw
    problems: list[Problem] = []
    for note in spec.notes:
        if spec.emptied_by_duplicate or spec.kind == "none" or not any_chosen:
            code = "cvd_empty"
            note += " (CUDA sees no GPU at all)" if not spec.emptied_by_duplicate and spec.kind != "none" else ""
        else:
            code = "cvd_truncated"
        problems.append(Problem(code, f"CUDA_VISIBLE_DEVICES={cvd!r}: {note}", cvd_fix(spec, gpus)))
    for note in spec.read_as:
        problems.append(
            Problem(
                "cvd_lenient",
                f"CUDA_VISIBLE_DEVICES={cvd!r}: {note}",
                "nothing is lost; write plain indices (e.g. 0,1) or UUIDs so that other tools read it alike",
            )
        )
    if not any_chosen and gpus and not already_empty and not any(p.code == "cvd_empty" for p in problems):
        problems.append(
            Problem(
                "cvd_empty",
                f"CUDA_VISIBLE_DEVICES={cvd!r} hides every GPU: CUDA sees none of the {len(gpus)} GPU(s) here",
                cvd_fix(spec, gpus),
            )
        )
    return problems


def unreadable_indices(gpus: Sequence[SmiGpu]) -> list[int]:
    """nvidia-smi indices missing from its listing (GPUs it could not read), e.g. ``[1]`` for rows 0 and 2."""
    present = {g.index for g in gpus}
    return [i for i in range(max(present, default=-1) + 1) if i not in present]


def unreadable_problem(unreadable: Sequence[int]) -> Problem:
    """``gpu_unreadable``: GPUs nvidia-smi skipped may still shift CUDA's numbering.

    Args:
        unreadable: from :func:`unreadable_indices` (not empty).
    """
    return Problem(
        "gpu_unreadable",
        f"nvidia-smi could not read GPU(s) {', '.join(map(str, unreadable))}: if CUDA still counts "
        "them, cuda:N and index-based CUDA_VISIBLE_DEVICES entries after them are shifted (the cuda "
        "column is a guess)",
        "select GPUs by UUID (pick-gpu does by default), and check `nvidia-smi` and `dmesg` (Xid "
        "errors) for the missing GPU",
    )


def device_order_problem(order: str | None) -> Problem | None:
    """``device_order_invalid`` when ``CUDA_DEVICE_ORDER`` is set to something CUDA does not know.

    Args:
        order: the value of ``CUDA_DEVICE_ORDER`` (``None``: unset).

    Returns:
        The problem, or ``None``.
    """
    if order is None or order in ("PCI_BUS_ID", "FASTEST_FIRST"):
        return None
    # CUDA compares the exact string: "pci_bus_id", " PCI_BUS_ID" or a typo silently means FASTEST_FIRST
    return Problem(
        "device_order_invalid",
        f"CUDA_DEVICE_ORDER={order!r} is not a value CUDA knows (only exactly PCI_BUS_ID or "
        "FASTEST_FIRST), so CUDA ignores it and uses FASTEST_FIRST",
        "export CUDA_DEVICE_ORDER=PCI_BUS_ID exactly (upper case, no spaces), or unset it",
    )


def order_uncertain_problem(gpus: Sequence[SmiGpu]) -> Problem:
    """``order_uncertain``: mixed models numbered FASTEST_FIRST by a rule CUDA does not publish."""
    models = sorted({(g.name or "?") for g in gpus})
    return Problem(
        "order_uncertain",
        "GPUs are different models ("
        + ", ".join(models)
        + ") and CUDA_DEVICE_ORDER is not PCI_BUS_ID: CUDA numbers the fastest first by a rule it does not "
        "publish, so cuda:N may not be nvidia-smi GPU N (the cuda column is a guess: compute "
        "capability, then multiprocessors x clock, as CUDA ranks devices)",
        "export CUDA_DEVICE_ORDER=PCI_BUS_ID (or select GPUs by UUID)",
    )


def order_problems(
    gpus: Sequence[SmiGpu], order: str | None, *, by_id: bool, unreadable: Sequence[int], models_certain: bool
) -> list[Problem]:
    """What makes CUDA's numbering differ from what the user expects.

    Args:
        gpus: the physical GPUs.
        order: the value of ``CUDA_DEVICE_ORDER``.
        by_id: devices are selected by UUID (or none at all): the numbering does not depend on the order.
        unreadable: from :func:`unreadable_indices`.
        models_certain: the enumeration order is known (PCI_BUS_ID, or one model).

    Returns:
        ``gpu_unreadable``, ``device_order_invalid`` and ``order_uncertain`` as they apply.
    """
    problems: list[Problem] = []
    if not by_id and unreadable:
        # nvidia-smi skipped a GPU it could not read (e.g. "Unable to determine the device handle for GPU1");
        # whether CUDA still counts it decides every cuda:N after it
        problems.append(unreadable_problem(unreadable))
    bad_order = device_order_problem(order)
    if bad_order is not None:
        problems.append(bad_order)
    if not by_id and not models_certain:
        problems.append(order_uncertain_problem(gpus))
    return problems


def mig_enumeration_problem(mig_rows: Sequence[tuple[SmiGpu, MigDevice]]) -> Problem:
    """``mig_enumeration``: CUDA enumerates MIG devices, at most one per process.

    Args:
        mig_rows: the ``(parent, MIG device)`` pairs CUDA enumerates (not empty).
    """
    parents = sorted({g.index for g, _ in mig_rows})
    others = ", ".join(m.uuid for _, m in mig_rows[1:4]) + (", ..." if len(mig_rows) > 4 else "")
    return Problem(
        "mig_enumeration",
        f"GPU(s) {', '.join(map(str, parents))} have MIG enabled: CUDA enumerates their "
        f"{len(mig_rows)} MIG device(s) (listed as cuda rows), never the whole GPU, and CUDA 11/12 give a "
        "process at most one MIG device, so which cuda:N exist here is a guess",
        "pick one MIG device: export CUDA_VISIBLE_DEVICES="
        + mig_rows[0][1].uuid
        + (f" (or one of {others})" if len(mig_rows) > 1 else ""),
    )


def mig_single_problem(spec: VisibleSpec, named: Sequence[tuple[SmiGpu, MigDevice | None]]) -> Problem:
    """``mig_single``: ``CUDA_VISIBLE_DEVICES`` names several MIG devices, and a CUDA process sees a single MIG
    instance (NVIDIA's MIG user guide, "CUDA Device Enumeration"): only the first is ``cuda:0``.

    Args:
        spec: the parsed variable.
        named: the ``(parent, MIG device)`` pairs it names, in order (more than one).
    """
    uuids = [m.uuid for _, m in named if m is not None]
    return Problem(
        "mig_single",
        f"CUDA_VISIBLE_DEVICES names {len(uuids)} MIG devices, but a CUDA process sees a single MIG instance: "
        f"cuda:0 = {uuids[0]}, and {', '.join(uuids[1:3])}{', ...' if len(uuids) > 3 else ''} "
        f"{'is' if len(uuids) == 2 else 'are'} not visible to this process (there is no cuda:1)",
        "run one process per MIG device, each with CUDA_VISIBLE_DEVICES set to one MIG UUID "
        "(`ckptfix pick-gpu -- CMD` picks a free one and leases it by UUID)",
    )


def _mig_parent_problem(d: VisibleGpu, gpus: Sequence[SmiGpu], mig_listed: bool) -> Problem:
    g = next((x for x in gpus if x.index == d.smi_index), None)
    listed = [m.uuid for m in g.mig_devices] if g is not None else []
    if listed:
        fix = f"set CUDA_VISIBLE_DEVICES to one of its MIG devices: {', '.join(listed[:4])}"
    elif mig_listed:
        fix = (
            f"it has no MIG device yet: create one (`sudo nvidia-smi mig -i {d.smi_index} -cgi 1g.5gb -C`, "
            f"profiles: `nvidia-smi mig -i {d.smi_index} -lgip`) or disable MIG "
            f"(`sudo nvidia-smi -i {d.smi_index} -mig 0`)"
        )
    else:
        fix = "set CUDA_VISIBLE_DEVICES to one of its MIG UUIDs (the MIG device list could not be read here)"
    return Problem(
        "mig_parent", f"GPU {d.smi_index} has MIG enabled: CUDA uses its MIG devices, not the whole GPU", fix
    )


def _memory_problem(d: VisibleGpu) -> Problem | None:
    unavailable = dict(d.unavailable)
    why = unavailable.get("memory.free") or unavailable.get("memory.total")
    if not why:
        return None
    if "permission" in why.lower():
        fix = "run with access to the GPU's memory counters; pick-gpu skips this GPU"
    elif why.upper() in ("N/A", "NOT SUPPORTED") and is_unified_memory(d.name):
        fix = (
            "this GPU has no framebuffer memory of its own (unified memory, shared with the CPU): pick-gpu picks it "
            "with memory unknown, and refuses it with --min-free (which cannot be checked here)"
        )
    elif why.upper() in ("N/A", "NOT SUPPORTED"):
        fix = (
            "this driver does not report memory for this GPU (seen on consumer cards and old drivers): "
            "pick-gpu cannot rank it and skips it; select it by UUID yourself, or update the driver"
        )
    else:  # [Unknown Error], [GPU is lost]...: the GPU itself is in trouble
        fix = (
            f"check `nvidia-smi -q -i {d.smi_index}` and `dmesg` (Xid errors); a reset or reboot may be "
            "needed; pick-gpu skips this GPU"
        )
    return Problem("memory_unavailable", f"GPU {d.smi_index}: nvidia-smi reports memory as [{why}]", fix)


def device_problems(devices: Sequence[VisibleGpu], gpus: Sequence[SmiGpu], *, mig_listed: bool) -> list[Problem]:
    """Per visible device: a whole GPU with MIG on (``mig_parent``), memory not reported (``memory_unavailable``).

    Args:
        devices: the devices CUDA will see.
        gpus: the physical GPUs (for their MIG device lists).
        mig_listed: whether ``nvidia-smi -L`` answered (a GPU without MIG devices then has none).
    """
    problems: list[Problem] = []
    for d in devices:
        if d.mig_enabled and d.mig_device is None:
            problems.append(_mig_parent_problem(d, gpus, mig_listed))
        if d.memory_free_mib is None and d.mig_device is None:
            p = _memory_problem(d)
            if p is not None:
                problems.append(p)
    return problems
