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

__all__ = ["Kind", "VisibleSpec", "strtoul_prefix", "parse_visible_devices", "cvd_fix"]

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


def strtoul_prefix(s: str) -> int | None:
    """Like C ``strtoul`` on one entry: leading blanks, optional sign, digits; junk after is ignored.

    Returns ``None`` when there is no digit, and a negative number for ``-N``
    (the driver stops at such an entry).  Never raises.

    >>> strtoul_prefix("1gpu2"), strtoul_prefix(" 3"), strtoul_prefix("-1"), strtoul_prefix("gpu")
    (1, 3, -1, None)

    Args:
        s: one entry of ``CUDA_VISIBLE_DEVICES``.

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
                )
            if not elem.startswith(prefix):
                other = "an index" if strtoul_prefix(elem) is not None else "not a " + prefix + " id"
                note = f"entry {elem!r} is {other} after {prefix} ids: CUDA ignores it and everything after it"
                return VisibleSpec(value, kind, tuple(seen), (note,))
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
            )
        if x is None or x < 0:
            why = "negative" if x is not None else "not a number"
            if elem.strip().startswith(("GPU-", "MIG-")):
                why = "a UUID after indices (CUDA does not mix the two)"
            notes.append(f"entry {elem!r} is {why}: CUDA ignores it and everything after it")
            return VisibleSpec(value, "index", tuple(ints), tuple(notes), read_as=tuple(read_as))
        if not elem.strip().isdigit():
            read_as.append(f"entry {elem!r} is read as {x} (CUDA parses entries like strtoul)")
        ints.append(x)
    return VisibleSpec(value, "index", tuple(ints), tuple(notes), read_as=tuple(read_as))


def cvd_fix(spec: VisibleSpec, gpus: Sequence[SmiGpu] = ()) -> str:
    """How to fix a ``CUDA_VISIBLE_DEVICES`` that hides or drops GPUs.

    Args:
        spec: the parsed variable.
        gpus: the physical GPUs.

    Returns:
        The fix, one sentence.
    """
    if spec.kind == "none":
        return "unset CUDA_VISIBLE_DEVICES to see every GPU, or set it to the GPUs you want"
    if spec.emptied_by_duplicate:
        return "list each GPU once"
    if spec.kind == "index" and not spec.entries:
        n = len(gpus)
        return "unset CUDA_VISIBLE_DEVICES, or set it to GPUs that exist " + (
            f"(indices 0..{n - 1}, or UUIDs from `ckptfix gpus`)" if n else "(UUIDs from `ckptfix gpus`)"
        )
    return "remove the invalid entry (use indices or UUIDs from `ckptfix gpus`, not both)"
