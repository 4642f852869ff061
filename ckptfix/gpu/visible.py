"""``CUDA_VISIBLE_DEVICES`` / ``CUDA_DEVICE_ORDER`` -> the physical GPUs CUDA will use, in order.  Pure.

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

import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping, Sequence

from ckptfix.gpu.smi import MigDevice, SmiGpu, SmiSnapshot

__all__ = [
    "VisibleSpec",
    "Problem",
    "VisibleGpu",
    "GpuView",
    "parse_visible_devices",
    "strtoul_prefix",
    "cuda_initialized",
    "cuda_init_route",
    "enumeration_order",
    "build_view",
    "pci_sort_key",
    "pci_order",
    "speed_key",
    "model_info",
    "mig_size_mib",
    "is_unified_memory",
]

Kind = Literal["all", "none", "index", "uuid", "mig"]


@dataclass(frozen=True)
class VisibleSpec:
    """What ``CUDA_VISIBLE_DEVICES`` asks for, before looking at the machine."""

    raw: str | None
    kind: Kind
    entries: tuple[Any, ...] = ()  # ints for "index", str for "uuid"/"mig"
    notes: tuple[str, ...] = ()  # what the parser dropped and why
    emptied_by_duplicate: bool = False
    stopped_at: str | None = None  # the entry that stopped the list, if any
    read_as: tuple[str, ...] = ()  # entries CUDA accepts but reads leniently ("1gpu2" is 1): nothing dropped


@dataclass(frozen=True)
class Problem:
    """A detected problem and how to fix it (shown by ``gpus`` as a warning and by ``doctor``)."""

    code: str
    message: str
    fix: str

    def to_dict(self) -> dict[str, str]:
        return {"code": self.code, "message": self.message, "fix": self.fix}

    def __str__(self) -> str:
        return f"{self.message}; fix: {self.fix}" if self.fix else self.message


def strtoul_prefix(s: str) -> int | None:
    """Like C ``strtoul`` on one entry: leading blanks, optional sign, digits; junk after is ignored.

    Returns ``None`` when there is no digit, and a negative number for ``-N``
    (the driver stops at such an entry).  Never raises.

    >>> strtoul_prefix("1gpu2"), strtoul_prefix(" 3"), strtoul_prefix("-1"), strtoul_prefix("gpu")
    (1, 3, -1, None)
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


# ----------------------------------------------------------------------------- records


@dataclass(frozen=True)
class VisibleGpu:
    """One device as CUDA in a process with this environment will number it (``cuda:<cuda_index>``)."""

    cuda_index: int
    smi_index: int
    uuid: str | None
    pci_bus_id: str | None
    name: str | None
    memory_total_mib: int | None
    memory_used_mib: int | None
    memory_free_mib: int | None
    utilization_pct: int | None
    temperature_c: float | None
    power_w: float | None
    process_count: int | None
    mig_enabled: bool | None = None
    mig_device: MigDevice | None = None  # set when CUDA_VISIBLE_DEVICES names a MIG device
    unavailable: tuple[tuple[str, str], ...] = ()
    hidden_used_mib: int | None = None  # used memory not explained by visible processes
    pci_index: int | None = None  # position in PCI bus order: the index meant with CUDA_DEVICE_ORDER=PCI_BUS_ID

    @property
    def id(self) -> str:
        """The id to put in CUDA_VISIBLE_DEVICES: MIG uuid, GPU uuid, or the nvidia-smi index."""
        if self.mig_device is not None:
            return self.mig_device.uuid
        return self.uuid if self.uuid else str(self.smi_index)

    def to_dict(self) -> dict[str, Any]:
        return {
            "cuda_index": self.cuda_index,
            "device": f"cuda:{self.cuda_index}",
            "smi_index": self.smi_index,
            "pci_index": self.pci_index,
            "uuid": self.uuid,
            "pci_bus_id": self.pci_bus_id,
            "name": self.name,
            "memory_total_mib": self.memory_total_mib,
            "memory_used_mib": self.memory_used_mib,
            "memory_free_mib": self.memory_free_mib,
            "utilization_pct": self.utilization_pct,
            "temperature_c": self.temperature_c,
            "power_w": self.power_w,
            "process_count": self.process_count,
            "hidden_used_mib": self.hidden_used_mib,
            "mig_enabled": self.mig_enabled,
            "mig_device": None if self.mig_device is None else self.mig_device.to_dict(),
            "unavailable": dict(self.unavailable),
        }


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

    def cuda_index_of(self, g: SmiGpu) -> int | None:
        """``cuda:N`` of the whole physical GPU ``g`` in this environment, ``None`` if CUDA does not see it."""
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

    @property
    def effective_order(self) -> str:
        return "PCI_BUS_ID" if self.cuda_device_order == "PCI_BUS_ID" else "FASTEST_FIRST"

    def to_dict(self) -> dict[str, Any]:
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
        }


# ----------------------------------------------------------------------------- mapping


CUDA_NOT_INITIALIZED = 3  # CUresult CUDA_ERROR_NOT_INITIALIZED: cuInit() has not run in this process


def _read_maps() -> str:
    """This process's memory map (``/proc/self/maps``); empty where there is none."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _loaded_libcuda(maps: str) -> str | None:
    """Path of the CUDA driver library (``libcuda.so*``) mapped into this process, if any."""
    for line in maps.splitlines():
        parts = line.split(None, 5)  # address perms offset dev inode [path]
        if len(parts) == 6 and os.path.basename(parts[5].strip()).startswith("libcuda.so"):
            return parts[5].strip()
    return None


def _probe_cuinit(path: str) -> int | None:
    """``cuDeviceGetCount`` through the *already loaded* driver library: ``0`` once ``cuInit`` has run,
    ``CUDA_NOT_INITIALIZED`` (3) before; ``None`` if it cannot be asked.  Never loads or initialises it."""
    import ctypes  # only reached when libcuda is already mapped

    try:
        lib = ctypes.CDLL(path, mode=getattr(os, "RTLD_NOLOAD", 4) | getattr(os, "RTLD_LOCAL", 0))
        fn = lib.cuDeviceGetCount
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.POINTER(ctypes.c_int)]
    n = ctypes.c_int(0)
    try:
        return int(fn(ctypes.byref(n)))
    except Exception:  # a foreign library of that name
        return None


def cuda_init_route() -> str | None:
    """How CUDA was already initialised in *this* process, or ``None`` if it was not.  Never imports torch.

    Detected routes:

    * torch (only if already imported: ``sys.modules``): ``torch.cuda.is_initialized()`` (a CUDA tensor,
      ``torch.cuda.init()``, ``set_device``...), a forked child of a CUDA process
      (``torch.cuda._is_in_bad_fork()``), a cached device count;
    * any route through the CUDA driver, whoever took it: ``torch.cuda.is_available()`` /
      ``device_count()`` on CUDA builds (``cudaGetDeviceCount`` runs ``cuInit``), cupy, jax, numba,
      pycuda, a C extension: the driver library ``libcuda.so`` is mapped into the process
      (``/proc/self/maps``) and answers ``cuDeviceGetCount`` with success (it answers
      ``CUDA_ERROR_NOT_INITIALIZED`` before ``cuInit``, so merely importing a library that links
      libcuda does not count).  If libcuda is loaded but cannot be asked, it counts as initialised.

    Returns:
        A short description of the route, or ``None``.
    """
    tcuda = getattr(sys.modules.get("torch"), "cuda", None)
    if tcuda is not None:
        try:
            if tcuda.is_initialized():
                return "torch.cuda is initialised (a CUDA tensor, torch.cuda.init(), set_device(), ...)"
        except Exception:  # a half-imported or stubbed torch
            pass
        try:
            if tcuda._is_in_bad_fork():
                return "this process was forked from one that had initialised CUDA"
        except Exception:
            pass
        if getattr(tcuda, "_cached_device_count", None) is not None:
            return "torch.cuda has cached its device count (CUDA was initialised)"
    lib = _loaded_libcuda(_read_maps())
    if lib is None:
        return None
    rc = _probe_cuinit(lib)
    if rc == CUDA_NOT_INITIALIZED:
        return None
    if rc is None:
        return f"the CUDA driver library is loaded ({lib}) and could not be asked whether cuInit ran"
    return (
        f"the CUDA driver was initialised (cuInit) by some call in this process, e.g. torch.cuda.is_available() "
        f"or device_count(), or another CUDA library ({lib})"
    )


def cuda_initialized() -> bool:
    """True if CUDA is already initialised in *this* process, by any route (see :func:`cuda_init_route`)."""
    return cuda_init_route() is not None


def pci_sort_key(g: SmiGpu) -> tuple[int, str, int]:
    """PCI bus order (``00000000:5E:00.0`` and ``0000:5e:00.0`` compare alike), then nvidia-smi index."""
    if not g.pci_bus_id:
        return (1, "", g.index)
    bus = g.pci_bus_id.strip().lower()
    dom, _, rest = bus.partition(":")
    if rest:
        try:
            bus = f"{int(dom, 16):08x}:{rest}"
        except ValueError:
            pass
    return (0, bus, g.index)


# Fallback when nvidia-smi does not report compute_cap: (name fragment, (major, minor), multiprocessors).
# Fragments are matched in order against the upper-cased product name, most specific first.  Sources: NVIDIA's
# CUDA GPUs compute capability list and the product data sheets (SM counts).
_MODELS: tuple[tuple[str, tuple[int, int], int | None], ...] = (
    ("GB200", (10, 0), 148), ("B200", (10, 0), 148), ("B100", (10, 0), 132), ("GB10", (12, 1), 48),
    ("RTX PRO 6000", (12, 0), 188), ("RTX 5090", (12, 0), 170), ("RTX 5080", (12, 0), 84),
    ("RTX 5070 TI", (12, 0), 70), ("RTX 5070", (12, 0), 48), ("RTX 5060 TI", (12, 0), 36), ("RTX 5060", (12, 0), 30),
    ("GH200", (9, 0), 132), ("H200", (9, 0), 132), ("H100 PCIE", (9, 0), 114), ("H100 NVL", (9, 0), 132),
    ("H100", (9, 0), 132), ("H800", (9, 0), 132), ("H20", (9, 0), 78),
    ("L40S", (8, 9), 142), ("L40", (8, 9), 142), ("L4", (8, 9), 58), ("RTX 6000 ADA", (8, 9), 142),
    ("RTX 4090", (8, 9), 128), ("RTX 4080", (8, 9), 76), ("RTX 4070", (8, 9), 46), ("RTX 4060", (8, 9), 24),
    ("A100", (8, 0), 108), ("A800", (8, 0), 108), ("A30", (8, 0), 56), ("A40", (8, 6), 84), ("A10G", (8, 6), 80),
    ("A10", (8, 6), 72), ("A16", (8, 6), 10), ("A2", (8, 6), 10), ("RTX A6000", (8, 6), 84), ("RTX A5000", (8, 6), 64),
    ("RTX 3090", (8, 6), 82), ("RTX 3080", (8, 6), 68), ("RTX 3070", (8, 6), 46), ("RTX 3060", (8, 6), 28),
    ("RTX 2080 TI", (7, 5), 68), ("RTX 2080 SUPER", (7, 5), 48), ("RTX 2080", (7, 5), 46), ("RTX 2070", (7, 5), 36), ("RTX 2060", (7, 5), 30),
    ("GTX 1660 TI", (7, 5), 24), ("GTX 1660 SUPER", (7, 5), 22), ("GTX 1660", (7, 5), 22), ("GTX 1650", (7, 5), 14),
    ("TITAN RTX", (7, 5), 72), ("QUADRO RTX 8000", (7, 5), 72), ("T1000", (7, 5), 14),
    ("T600", (7, 5), 10), ("T400", (7, 5), 6), ("T4", (7, 5), 40), ("V100", (7, 0), 80), ("TITAN V", (7, 0), 80),
    ("P100", (6, 0), 56), ("P40", (6, 1), 30), ("P4", (6, 1), 20), ("TITAN XP", (6, 1), 30),
    ("GTX 1080 TI", (6, 1), 28), ("TITAN X", (6, 1), 28), ("K80", (3, 7), 13),
)


def model_info(name: str | None) -> tuple[tuple[int, int] | None, int | None]:
    """``(compute capability, multiprocessor count)`` of a product name from the small built-in table.

    >>> model_info("NVIDIA A100-SXM4-40GB")
    ((8, 0), 108)
    """
    up = (name or "").upper()
    for frag, cc, sms in _MODELS:
        if re.search(r"(?<![A-Z0-9])" + re.escape(frag) + r"(?![0-9])", up):
            return cc, sms
    return None, None


def speed_key(g: SmiGpu) -> tuple[int, int, float]:
    """How CUDA's FASTEST_FIRST ranks devices (higher first): compute capability, then multiprocessors x
    max SM clock.  From nvidia-smi's ``compute_cap`` / ``clocks.max.sm`` where reported, else the model table."""
    cc_table, sms = model_info(g.name)
    cc = g.compute_cap or cc_table or (0, 0)
    clock = g.max_sm_clock_mhz or 1
    return (cc[0], cc[1], float((sms or 0) * clock))


def enumeration_order(gpus: Sequence[SmiGpu], device_order: str | None) -> tuple[list[SmiGpu], bool]:
    """CUDA's numbering of every physical GPU: ``(gpus_in_cuda_order, certain)``.

    With ``PCI_BUS_ID`` (or all GPUs the same model) this is PCI order and certain.
    Otherwise CUDA puts the fastest first by an undocumented heuristic: we guess it like CUDA ranks
    devices (:func:`speed_key`, ties in PCI order) and return ``certain=False``.
    """
    if all(g.pci_bus_id for g in gpus):
        ordered = sorted(gpus, key=pci_sort_key)
    else:  # a row nvidia-smi could not read: its listing order (PCI order too) is the best guess
        ordered = sorted(gpus, key=lambda g: g.index)
    if device_order == "PCI_BUS_ID":
        return ordered, True
    names = {(g.name or "").strip() for g in gpus}
    same_model = len(names) <= 1 and "" not in names
    if same_model or len(gpus) <= 1:
        return ordered, True
    keys = [speed_key(g) for g in ordered]
    if any(k[:2] == (0, 0) for k in keys):  # a model we know nothing about: no better guess than PCI order
        return ordered, False
    order = sorted(range(len(ordered)), key=lambda i: tuple(-k for k in keys[i]))  # stable: PCI order on ties
    return [ordered[i] for i in order], False


def pci_order(gpus: Sequence[SmiGpu]) -> list[SmiGpu]:
    """The physical GPUs in PCI bus order (what ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` numbers)."""
    return enumeration_order(gpus, "PCI_BUS_ID")[0]


def _uuid_match(candidate: str, uuids: Sequence[str | None]) -> tuple[int, str]:
    """Index of the unique uuid starting with candidate, or (-1, why)."""
    hits = [i for i, u in enumerate(uuids) if u and u.lower().startswith(candidate.lower())]
    if len(hits) == 1:
        return hits[0], ""
    return -1, ("matches no GPU" if not hits else f"is ambiguous ({len(hits)} GPUs start with it)")


def _mig_matches(candidate: str, mig: MigDevice) -> bool:
    return mig.uuid.lower().startswith(candidate.lower())


def mig_size_mib(profile: str) -> int | None:
    """Memory of a MIG device from its profile name (``1g.5gb`` -> 5120, ``1c.3g.20gb`` -> 20480); None if unknown.

    The profile names the instance's nominal memory in GB; nvidia-smi reports slightly less usable memory.
    """
    m = re.search(r"(\d+)gb$", profile.strip().lower())
    return int(m.group(1)) * 1024 if m else None


def _to_visible(
    cuda_index: int, g: SmiGpu, mig: MigDevice | None, hidden_busy_mib: int, pci_index: int | None = None
) -> VisibleGpu:
    hidden: int | None = None
    if g.memory_used_mib is not None and g.processes is not None:
        explained = sum(p.used_memory_mib or 0 for p in g.processes)
        hidden = max(g.memory_used_mib - explained, 0) if not g.processes else None
        if hidden is not None and hidden < hidden_busy_mib:
            hidden = 0
    if mig is not None:
        return VisibleGpu(
            cuda_index=cuda_index,
            smi_index=g.index,
            uuid=g.uuid,
            pci_bus_id=g.pci_bus_id,
            name=f"{g.name or 'GPU'} MIG {mig.profile}",
            memory_total_mib=mig_size_mib(mig.profile),
            memory_used_mib=None,
            memory_free_mib=None,
            utilization_pct=None,
            temperature_c=g.temperature_c,
            power_w=g.power_w,
            process_count=None,
            mig_enabled=True,
            mig_device=mig,
            unavailable=(("memory", "MIG device: per-instance memory is not in --query-gpu"),),
            pci_index=pci_index,
        )
    return VisibleGpu(
        cuda_index=cuda_index,
        smi_index=g.index,
        uuid=g.uuid,
        pci_bus_id=g.pci_bus_id,
        name=g.name,
        memory_total_mib=g.memory_total_mib,
        memory_used_mib=g.memory_used_mib,
        memory_free_mib=g.memory_free_mib,
        utilization_pct=g.utilization_pct,
        temperature_c=g.temperature_c,
        power_w=g.power_w,
        process_count=g.process_count,
        mig_enabled=g.mig_enabled,
        unavailable=g.unavailable,
        hidden_used_mib=hidden,
        pci_index=pci_index,
    )


HIDDEN_BUSY_MIB = 1024


def build_view(
    snapshot: SmiSnapshot,
    env: Mapping[str, str],
    *,
    cuda_is_initialized: bool = False,
    hidden_busy_mib: int = HIDDEN_BUSY_MIB,
) -> GpuView:
    """Map nvidia-smi's physical GPUs to CUDA's logical devices under ``env``.  Pure."""
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    order = env.get("CUDA_DEVICE_ORDER")
    spec = parse_visible_devices(cvd)
    gpus = list(snapshot.gpus)
    ordered, certain = enumeration_order(gpus, order)
    models_certain = certain
    warnings: list[str] = list(snapshot.warnings)
    problems: list[Problem] = []
    chosen: list[tuple[SmiGpu, MigDevice | None]] = []

    mig_rows: list[tuple[SmiGpu, MigDevice]] = []
    if spec.kind == "all":
        for g in ordered:
            if g.mig_enabled and g.mig_devices:  # CUDA enumerates its MIG devices, never the parent
                mig_rows.extend((g, m) for m in g.mig_devices)
                chosen.extend((g, m) for m in g.mig_devices)
            else:
                chosen.append((g, None))
    elif spec.kind == "index":
        for i in spec.entries:
            if i >= len(ordered):
                problems.append(
                    Problem(
                        "cvd_truncated",
                        f"CUDA_VISIBLE_DEVICES={cvd!r}: index {i} is out of range (this machine has {len(ordered)} "
                        f"GPU(s)), so CUDA ignores it and every entry after it",
                        f"use indices 0..{len(ordered) - 1}, or UUIDs from `ckptfix gpus`",
                    )
                )
                break
            chosen.append((ordered[i], None))
    elif spec.kind == "uuid":
        uuids = [g.uuid for g in gpus]
        for cand in spec.entries:
            hit, why = _uuid_match(cand, uuids)
            if hit < 0:
                problems.append(
                    Problem(
                        "cvd_truncated",
                        f"CUDA_VISIBLE_DEVICES entry {cand!r} {why}, so CUDA ignores it and every entry after it",
                        "use full UUIDs from `ckptfix gpus` (or `nvidia-smi -L`)",
                    )
                )
                break
            if any(g is gpus[hit] for g, _ in chosen):
                problems.append(
                    Problem(
                        "cvd_empty",
                        f"CUDA_VISIBLE_DEVICES={cvd!r} names GPU {gpus[hit].index} twice: CUDA then hides every GPU",
                        "list each GPU once",
                    )
                )
                chosen = []
                break
            chosen.append((gpus[hit], None))
        certain = True
    elif spec.kind == "mig":
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
            hits = [m for m in migs if _mig_matches(cand, m)]
            if len(hits) != 1:
                if migs:
                    why = "matches no MIG device" if not hits else "is ambiguous"
                    problems.append(
                        Problem(
                            "cvd_truncated",
                            f"CUDA_VISIBLE_DEVICES entry {cand!r} {why}, so CUDA ignores it and every entry after it",
                            "use one of this machine's MIG devices: " + ", ".join(m.uuid for m in migs[:4])
                            + (", ..." if len(migs) > 4 else "") + " (all listed by `ckptfix gpus` with "
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
                        f"CUDA_VISIBLE_DEVICES={cvd!r} names MIG device {hits[0].uuid} twice: CUDA then hides "
                        "every GPU",
                        "list each MIG device once",
                    )
                )
                chosen = []
                break
            chosen.append((parent, hits[0]))
        certain = True

    for note in spec.notes:
        if spec.emptied_by_duplicate or spec.kind == "none" or not chosen:
            code = "cvd_empty"
            note += " (CUDA sees no GPU at all)" if not spec.emptied_by_duplicate and spec.kind != "none" else ""
        else:
            code = "cvd_truncated"
        problems.append(Problem(code, f"CUDA_VISIBLE_DEVICES={cvd!r}: {note}", _cvd_fix(spec, gpus)))
    for note in spec.read_as:
        problems.append(
            Problem(
                "cvd_lenient",
                f"CUDA_VISIBLE_DEVICES={cvd!r}: {note}",
                "nothing is lost; write plain indices (e.g. 0,1) or UUIDs so that other tools read it alike",
            )
        )
    if not chosen and gpus and not any(p.code == "cvd_empty" for p in problems):
        problems.append(
            Problem(
                "cvd_empty",
                f"CUDA_VISIBLE_DEVICES={cvd!r} hides every GPU: CUDA sees none of the {len(gpus)} GPU(s) here",
                _cvd_fix(spec, gpus),
            )
        )

    pci = pci_order(gpus)
    pci_pos = {id(g): i for i, g in enumerate(pci)}
    devices = [
        _to_visible(i, g, m, hidden_busy_mib, pci_pos.get(id(g))) for i, (g, m) in enumerate(chosen)
    ]

    present = {g.index for g in gpus}
    unreadable = [i for i in range(max(present, default=-1) + 1) if i not in present]
    if spec.kind in ("uuid", "mig", "none"):
        certain = True  # physical ids, listed order: nothing depends on CUDA_DEVICE_ORDER
    elif unreadable:
        # nvidia-smi skipped a GPU it could not read (e.g. "Unable to determine the device handle for GPU1");
        # whether CUDA still counts it decides every cuda:N after it
        certain = False
        problems.append(
            Problem(
                "gpu_unreadable",
                f"nvidia-smi could not read GPU(s) {', '.join(map(str, unreadable))}: if CUDA still counts "
                "them, cuda:N and index-based CUDA_VISIBLE_DEVICES entries after them are shifted (the cuda "
                "column is a guess)",
                "select GPUs by UUID (pick-gpu does by default), and check `nvidia-smi` and `dmesg` (Xid "
                "errors) for the missing GPU",
            )
        )
    if order is not None and order not in ("PCI_BUS_ID", "FASTEST_FIRST"):
        # CUDA compares the exact string: "pci_bus_id", " PCI_BUS_ID" or a typo silently means FASTEST_FIRST
        problems.append(
            Problem(
                "device_order_invalid",
                f"CUDA_DEVICE_ORDER={order!r} is not a value CUDA knows (only exactly PCI_BUS_ID or "
                "FASTEST_FIRST), so CUDA ignores it and uses FASTEST_FIRST",
                "export CUDA_DEVICE_ORDER=PCI_BUS_ID exactly (upper case, no spaces), or unset it",
            )
        )
    if spec.kind not in ("uuid", "mig", "none") and not models_certain:
        models = sorted({(g.name or "?") for g in gpus})
        problems.append(
            Problem(
                "order_uncertain",
                "GPUs are different models ("
                + ", ".join(models)
                + ") and CUDA_DEVICE_ORDER is not PCI_BUS_ID: CUDA numbers the fastest first by a rule it does not "
                "publish, so cuda:N may not be nvidia-smi GPU N (the cuda column is a guess: compute "
                "capability, then multiprocessors x clock, as CUDA ranks devices)",
                "export CUDA_DEVICE_ORDER=PCI_BUS_ID (or select GPUs by UUID)",
            )
        )

    if mig_rows:
        parents = sorted({g.index for g, _ in mig_rows})
        certain = False
        problems.append(
            Problem(
                "mig_enumeration",
                f"GPU(s) {', '.join(map(str, parents))} have MIG enabled: CUDA enumerates their "
                f"{len(mig_rows)} MIG device(s) (listed as cuda rows), never the whole GPU, and CUDA 11/12 give a "
                "process at most one MIG device, so which cuda:N exist here is a guess",
                "pick one MIG device: export CUDA_VISIBLE_DEVICES=" + mig_rows[0][1].uuid
                + (f" (or one of {', '.join(m.uuid for _, m in mig_rows[1:4])}{', ...' if len(mig_rows) > 4 else ''})"
                   if len(mig_rows) > 1 else ""),
            )
        )
    for d in devices:
        if d.mig_enabled and d.mig_device is None:
            g = next((x for x in gpus if x.index == d.smi_index), None)
            listed = [m.uuid for m in g.mig_devices] if g is not None else []
            if listed:
                fix = f"set CUDA_VISIBLE_DEVICES to one of its MIG devices: {', '.join(listed[:4])}"
            elif snapshot.mig_listed:
                fix = (
                    f"it has no MIG device yet: create one (`sudo nvidia-smi mig -i {d.smi_index} -cgi 1g.5gb -C`, "
                    f"profiles: `nvidia-smi mig -i {d.smi_index} -lgip`) or disable MIG "
                    f"(`sudo nvidia-smi -i {d.smi_index} -mig 0`)"
                )
            else:
                fix = "set CUDA_VISIBLE_DEVICES to one of its MIG UUIDs (the MIG device list could not be read here)"
            problems.append(
                Problem(
                    "mig_parent",
                    f"GPU {d.smi_index} has MIG enabled: CUDA uses its MIG devices, not the whole GPU",
                    fix,
                )
            )
        if d.memory_free_mib is None and d.mig_device is None:
            why = d.unavailable and dict(d.unavailable).get("memory.free") or dict(d.unavailable).get("memory.total")
            if why:
                if "permission" in why.lower():
                    fix = "run with access to the GPU's memory counters; pick-gpu skips this GPU"
                elif why.upper() in ("N/A", "NOT SUPPORTED") and is_unified_memory(d.name):
                    fix = "this GPU has no framebuffer memory of its own (unified memory); pick-gpu skips it"
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
                problems.append(
                    Problem("memory_unavailable", f"GPU {d.smi_index}: nvidia-smi reports memory as [{why}]", fix)
                )
    if cuda_is_initialized:
        problems.append(
            Problem(
                "cuda_initialized",
                "CUDA is already initialised in this process: changing CUDA_VISIBLE_DEVICES now has no effect",
                "set CUDA_VISIBLE_DEVICES before the first CUDA call (or in the shell that starts Python)",
            )
        )
    warnings.extend(str(p) for p in problems)
    return GpuView(
        devices=tuple(devices),
        physical=tuple(gpus),
        cuda_visible_devices=cvd,
        cuda_device_order=order,
        order_certain=certain,
        driver_version=snapshot.driver_version,
        cuda_initialized=cuda_is_initialized,
        warnings=tuple(warnings),
        problems=tuple(problems),
        spec=spec,
    )


_UNIFIED = ("GB10", "JETSON", "ORIN", "THOR", "XAVIER", "TEGRA")


def is_unified_memory(name: str | None) -> bool:
    """True for SoC GPUs that share system memory (no framebuffer of their own): GB10, Jetson..."""
    up = (name or "").upper()
    return any(f in up for f in _UNIFIED)


def _cvd_fix(spec: VisibleSpec, gpus: Sequence[SmiGpu] = ()) -> str:
    if spec.kind == "none":
        return "unset CUDA_VISIBLE_DEVICES to see every GPU, or set it to the GPUs you want"
    if spec.emptied_by_duplicate:
        return "list each GPU once"
    if spec.kind == "index" and not spec.entries:
        n = len(gpus)
        return (
            "unset CUDA_VISIBLE_DEVICES, or set it to GPUs that exist "
            + (f"(indices 0..{n - 1}, or UUIDs from `ckptfix gpus`)" if n else "(UUIDs from `ckptfix gpus`)")
        )
    return "remove the invalid entry (use indices or UUIDs from `ckptfix gpus`, not both)"
