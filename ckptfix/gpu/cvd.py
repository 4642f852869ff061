"""What ``CUDA_VISIBLE_DEVICES`` asks for, parsed the way the CUDA driver parses it.  Pure.

The CUDA driver's rules (mirrored by ``torch.cuda._parse_visible_devices``):

* unset: every GPU; set but empty: none;
* entries are parsed like ``strtoul`` (``"1gpu2"`` is ``1``); a negative entry
  (``-1``) or one that is not a number stops the list there;
* a repeated entry empties the *whole* list;
* an index past the last GPU truncates the list there;
* ``GPU-<uuid>`` entries may be abbreviated to any unambiguous prefix; an
  unknown or ambiguous one truncates the list;
* ``MIG-<uuid>`` (R470+) and legacy ``MIG-GPU-<uuid>/<gi>/<ci>`` name MIG devices;
* the first entry decides the kind: mixing integers and UUIDs stops parsing at
  the first entry of the other kind.

Indices count in ``CUDA_DEVICE_ORDER``: ``PCI_BUS_ID`` is nvidia-smi's order;
the default ``FASTEST_FIRST`` puts the fastest model first, which only
coincides with nvidia-smi's order when every GPU is the same model.  CUDA
compares the exact string: any other value (``pci_bus_id``, a typo) means
``FASTEST_FIRST`` and is reported as ``device_order_invalid``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Sequence

from ckptfix.gpu.records import SmiGpu

__all__ = ["Kind", "VisibleSpec", "strtoul_prefix", "parse_visible_devices", "cvd_fix", "describe_spec"]

Kind = Literal["all", "none", "index", "uuid", "mig"]


@dataclass(frozen=True)
class VisibleSpec:
    """What ``CUDA_VISIBLE_DEVICES`` asks for, before looking at the machine."""

    raw: str | None
    kind: Kind
    entries: tuple[Any, ...] = ()  # ints for "index", str for "uuid"/"mig"
    notes: tuple[str, ...] = ()  # what the parser dropped and why
    emptied_by_duplicate: bool = False
    read_as: tuple[str, ...] = ()  # entries CUDA accepts but reads leniently ("1gpu2" is 1): nothing dropped
    stopped_at: str | None = None  # the entry that stopped the list, if any
    # with emptied_by_duplicate: the entries read up to the repeated one ("0,9,0" -> (0, 9)); an index past the
    # last GPU among them ends the list by NVIDIA's documented rule before the repeat is ever seen
    before_duplicate: tuple[Any, ...] = ()


def strtoul_prefix(s: str) -> int | None:
    """Like C ``strtoul`` on one entry: leading blanks, optional sign, digits; junk after is ignored.

    Returns ``None`` when there is no digit, and a negative number for ``-N``
    (the driver stops at such an entry).  Never raises.

    >>> strtoul_prefix("1gpu2"), strtoul_prefix(" 3"), strtoul_prefix("-1"), strtoul_prefix("gpu")
    (1, 3, -1, None)

    Returns:
        The number, or ``None``.
    """
    s = s.lstrip(" \t\n\r\f\v")
    sign = 1
    if s[:1] in ("+", "-"):
        sign = -1 if s[0] == "-" else 1
        s = s[1:]
    n = 0
    while n < len(s) and s[n] in "0123456789":
        n += 1
    if n == 0:
        return None
    return sign * int(s[:n])


def parse_visible_devices(value: str | None) -> VisibleSpec:
    """Parse a ``CUDA_VISIBLE_DEVICES`` value the way the CUDA driver does (see module doc).  Never raises.

    >>> parse_visible_devices("0,2,-1,3").entries
    (0, 2)
    >>> parse_visible_devices("1,1").entries
    ()

    Args:
        value: the variable's value, ``None`` when unset.

    Returns:
        The :class:`VisibleSpec`: kind, kept entries, and notes on what the driver drops or reads leniently.
    """
    if value is None:
        return VisibleSpec(None, "all")
    if value.startswith("GPU-") or value.startswith("MIG-"):
        kind: Kind = "uuid" if value.startswith("GPU-") else "mig"
        prefix = "GPU-" if kind == "uuid" else "MIG-"
        seen: list[str] = []
        for elem in value.split(","):
            if elem in seen:
                return VisibleSpec(
                    value,
                    kind,
                    (),
                    (f"entry {elem!r} appears twice: CUDA then hides every GPU",),
                    emptied_by_duplicate=True,
                    before_duplicate=tuple(seen),
                )
            if not elem.startswith(prefix):
                other = "an index" if strtoul_prefix(elem) is not None else "not a " + prefix + " id"
                note = f"entry {elem!r} is {other} after {prefix} ids: CUDA ignores it and everything after it"
                return VisibleSpec(value, kind, tuple(seen), (note,), stopped_at=elem)
            seen.append(elem)
        return VisibleSpec(value, kind, tuple(seen))
    if value.strip() == "":
        return VisibleSpec(value, "none", (), ("CUDA_VISIBLE_DEVICES is set but empty: CUDA sees no GPU",))
    ints: list[int] = []
    notes: list[str] = []
    read_as: list[str] = []
    for elem in value.split(","):
        x = strtoul_prefix(elem.strip())
        if x is not None and x >= 0 and x in ints:
            return VisibleSpec(
                value,
                "index",
                (),
                (f"index {x} appears twice: CUDA then hides every GPU",),
                emptied_by_duplicate=True,
                before_duplicate=tuple(ints),
            )
        if x is None or x < 0:
            why = "negative" if x is not None else "not a number"
            if elem.strip().startswith(("GPU-", "MIG-")):
                why = "a UUID after indices (CUDA does not mix the two)"
            notes.append(f"entry {elem!r} is {why}: CUDA ignores it and everything after it")
            return VisibleSpec(value, "index", tuple(ints), tuple(notes), stopped_at=elem, read_as=tuple(read_as))
        if not elem.strip().isdigit():
            read_as.append(f"entry {elem!r} is read as {x} (CUDA parses entries like strtoul)")
        ints.append(x)
    return VisibleSpec(value, "index", tuple(ints), tuple(notes), read_as=tuple(read_as))


def cvd_fix(spec: VisibleSpec, gpus: Sequence[SmiGpu] = ()) -> str:
    """How to fix a ``CUDA_VISIBLE_DEVICES`` that hides or drops GPUs."""
    if spec.kind == "none":
        return "unset CUDA_VISIBLE_DEVICES to see every GPU, or set it to the GPUs you want"
    if spec.emptied_by_duplicate:
        return "list each GPU once"
    n = len(gpus)
    valid = f"indices 0..{n - 1}" if n else "indices of the machine the job runs on"
    stopped = (spec.stopped_at or "").strip()
    if spec.kind == "index" and stopped.startswith(("GPU-", "MIG-")):
        return f"use indices or UUIDs from `ckptfix gpus`, not both (here: {valid})"
    if spec.kind in ("uuid", "mig") and stopped and strtoul_prefix(stopped) is not None:
        return "use UUIDs or indices from `ckptfix gpus`, not both"
    if spec.kind == "index":
        out = [e for e in spec.entries if isinstance(e, int) and e >= n]
        if out and gpus:
            where = "every index" if len(out) == len(spec.entries) else f"index {out[0]}"
            return (
                f"{where} in it is past this machine's last GPU ({n} GPU(s) here: {valid}; an index of the host "
                f"or of another machine is not valid inside this container or job): use {valid}, or UUIDs from "
                "`ckptfix gpus`"
            )
        if not spec.entries:
            return "unset CUDA_VISIBLE_DEVICES, or set it to GPUs that exist " + (
                f"({valid}, or UUIDs from `ckptfix gpus`)" if n else "(UUIDs from `ckptfix gpus`)"
            )
        if stopped:
            return (
                f"remove the entry {stopped!r}: CUDA_VISIBLE_DEVICES takes comma-separated indices ({valid}) or "
                "GPU UUIDs from `ckptfix gpus`"
            )
    return f"remove the invalid entry (use {valid}, or UUIDs from `ckptfix gpus`)"


FULL_UUID_LEN = len("GPU-4e9e74b7-4977-f04d-3af3-ccfe5f570e90")


def describe_spec(spec: VisibleSpec) -> str:
    """What CUDA will do with ``CUDA_VISIBLE_DEVICES`` on any machine, in one sentence (no driver needed).

    ``"GPU-28780eb0,1gpu,0"``: CUDA will use at most ``GPU-28780eb0`` (a prefix that must match exactly one GPU
    where the job runs) and ignores ``'1gpu'`` and everything after it.
    """
    head = f"CUDA_VISIBLE_DEVICES={spec.raw!r}"
    if spec.kind == "all":
        return "CUDA_VISIBLE_DEVICES is unset: CUDA will use every GPU of the machine the job runs on"
    if spec.kind == "none":
        return f"{head}: CUDA will see no GPU"
    if spec.emptied_by_duplicate:
        return f"{head}: an entry appears twice, so CUDA will see no GPU"
    if not spec.entries:
        return f"{head}: no entry is usable ({spec.stopped_at!r} is the first), so CUDA will see no GPU"
    if spec.kind == "index":
        listed = ", ".join(f"cuda:{i} = index {e}" for i, e in enumerate(spec.entries))
        what = (
            f"{listed} (indices count in CUDA_DEVICE_ORDER on the machine the job runs on; an index past its last GPU "
            "ends the list there)"
        )
    else:
        short = [e for e in spec.entries if len(e) < FULL_UUID_LEN and e.startswith("GPU-")]
        what = ", ".join(spec.entries) + (
            " (a UUID prefix: it must match exactly one GPU of the machine the job runs on, else CUDA sees none)"
            if short and len(spec.entries) == 1
            else " (UUID prefixes must each match exactly one GPU where the job runs)"
            if short
            else ""
        )
        if spec.kind == "mig" and len(spec.entries) > 1:
            what += "; a CUDA process sees a single MIG instance: only the first"
    tail = f"; it ignores {spec.stopped_at!r} and everything after it" if spec.stopped_at is not None else ""
    return f"{head}: CUDA will use at most {what}{tail}"
