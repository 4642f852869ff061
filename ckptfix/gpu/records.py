"""The GPU records: what nvidia-smi reports (:class:`SmiGpu`, its processes and MIG devices) and what a CUDA
process sees (:class:`VisibleGpu`, a :class:`SmiGpu` under a ``cuda:N`` number).  Pure data, no I/O.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

__all__ = [
    "GpuProcess",
    "MigDevice",
    "SmiGpu",
    "SmiSnapshot",
    "Problem",
    "VisibleGpu",
    "mig_size_mib",
    "short_uuid",
]


@dataclass(frozen=True)
class GpuProcess:
    """One row of ``--query-compute-apps``."""

    gpu_uuid: str | None
    pid: int | None
    name: str | None  # None for ``[Not Found]`` (a process in another PID namespace)
    used_memory_mib: int | None

    def to_dict(self) -> dict[str, Any]:
        """The process as JSON."""
        return {"gpu_uuid": self.gpu_uuid, "pid": self.pid, "name": self.name, "used_memory_mib": self.used_memory_mib}


@dataclass(frozen=True)
class MigDevice:
    """One MIG device line of ``nvidia-smi -L``."""

    uuid: str  # ``MIG-<uuid>`` (R470+) or legacy ``MIG-GPU-<uuid>/<gi>/<ci>``
    parent_uuid: str | None
    parent_index: int
    device_index: int
    profile: str  # e.g. ``1g.5gb`` or ``1c.3g.20gb``

    def to_dict(self) -> dict[str, Any]:
        """The MIG device as JSON.

        Returns:
            ``uuid``, ``parent_uuid``, ``parent_index``, ``device_index``, ``profile``.
        """
        return {
            "uuid": self.uuid,
            "parent_uuid": self.parent_uuid,
            "parent_index": self.parent_index,
            "device_index": self.device_index,
            "profile": self.profile,
        }


@dataclass(frozen=True)
class SmiGpu:
    """One physical GPU as nvidia-smi reports it.  ``None`` means unavailable; why is in ``unavailable``."""

    index: int
    uuid: str | None = None
    pci_bus_id: str | None = None
    name: str | None = None
    memory_total_mib: int | None = None
    memory_used_mib: int | None = None
    memory_free_mib: int | None = None
    utilization_pct: int | None = None
    temperature_c: float | None = None
    power_w: float | None = None
    mig_enabled: bool | None = None
    driver_version: str | None = None
    compute_cap: tuple[int, int] | None = None  # e.g. (9, 0); None: not reported (driver < R510) or N/A
    max_sm_clock_mhz: int | None = None
    unavailable: tuple[tuple[str, str], ...] = ()  # (field, placeholder text) pairs
    processes: tuple[GpuProcess, ...] | None = None  # None: not queried
    mig_devices: tuple[MigDevice, ...] = ()

    @property
    def process_count(self) -> int | None:
        """How many compute processes nvidia-smi lists on this GPU.

        Returns:
            The number of compute processes, ``None`` when they were not (or could not be) listed.
        """
        return None if self.processes is None else len(self.processes)

    def unavailable_reason(self, fieldname: str) -> str | None:
        """Why ``fieldname`` has no value.

        Returns:
            The placeholder printed instead of its value (``N/A``, ``Insufficient Permissions``...), or ``None``.
        """
        for f, why in self.unavailable:
            if f == fieldname:
                return why
        return None

    def to_dict(self) -> dict[str, Any]:
        """The GPU as JSON (``physical[]`` of ``ckptfix gpus --json`` adds the CUDA numbering).

        Returns:
            Every field; ``compute_cap`` as ``"9.0"``, ``unavailable`` as a mapping.
        """
        return {
            "index": self.index,
            "uuid": self.uuid,
            "pci_bus_id": self.pci_bus_id,
            "name": self.name,
            "memory_total_mib": self.memory_total_mib,
            "memory_used_mib": self.memory_used_mib,
            "memory_free_mib": self.memory_free_mib,
            "utilization_pct": self.utilization_pct,
            "temperature_c": self.temperature_c,
            "power_w": self.power_w,
            "mig_enabled": self.mig_enabled,
            "driver_version": self.driver_version,
            "compute_cap": None if self.compute_cap is None else f"{self.compute_cap[0]}.{self.compute_cap[1]}",
            "max_sm_clock_mhz": self.max_sm_clock_mhz,
            "unavailable": dict(self.unavailable),
            "processes": None if self.processes is None else [p.to_dict() for p in self.processes],
            "mig_devices": [m.to_dict() for m in self.mig_devices],
        }


@dataclass(frozen=True)
class SmiSnapshot:
    """Everything one :func:`query` learned."""

    gpus: tuple[SmiGpu, ...]
    driver_version: str | None = None
    warnings: tuple[str, ...] = ()
    calls: int = 0
    processes_known: bool = False
    mig_listed: bool = False


@dataclass(frozen=True)
class Problem:
    """A detected problem and how to fix it (shown by ``gpus`` as a warning and by ``doctor``)."""

    code: str
    message: str
    fix: str

    def to_dict(self) -> dict[str, str]:
        """The problem as JSON."""
        return {"code": self.code, "message": self.message, "fix": self.fix}

    def __str__(self) -> str:
        return f"{self.message}; fix: {self.fix}" if self.fix else self.message


def mig_size_mib(profile: str) -> int | None:
    """Memory of a MIG device from its profile name (``1g.5gb`` -> 5120, ``1c.3g.20gb`` -> 20480); None if unknown.

    The profile names the instance's nominal memory in GB; nvidia-smi reports slightly less usable memory.

    Returns:
        The nominal memory in MiB, or ``None``.
    """
    m = re.search(r"(\d+)gb$", profile.strip().lower())
    return int(m.group(1)) * 1024 if m else None


def short_uuid(uuid: str | None) -> str:
    """``GPU-a44622e3-...`` -> ``GPU-a44622e3`` (CUDA accepts any unambiguous prefix).

    Args:
        uuid: a GPU or MIG UUID, or ``None``.
    """
    if not uuid:
        return "-"
    if uuid.startswith("MIG-GPU-"):
        return uuid  # legacy MIG ids need the /gi/ci tail
    head, _, rest = uuid.partition("-")
    return f"{head}-{rest[:8]}" if rest else uuid


MIG_MEMORY_NOTE = "MIG device: per-instance memory is not in --query-gpu"


@dataclass(frozen=True)
class VisibleGpu:
    """One device as CUDA in a process with this environment will number it (``cuda:<cuda_index>``).

    It is the physical :class:`SmiGpu` ``gpu`` (or, with ``mig_device``, one MIG device of it) under the
    number CUDA gives it; the nvidia-smi fields are read through to ``gpu``, except that a MIG device
    reports its profile's memory and nothing per instance.
    """

    cuda_index: int
    gpu: SmiGpu
    mig_device: MigDevice | None = None  # set when CUDA enumerates (or CUDA_VISIBLE_DEVICES names) a MIG device
    hidden_used_mib: int | None = None  # used memory not explained by visible processes
    pci_index: int | None = None  # position in PCI bus order: the index meant with CUDA_DEVICE_ORDER=PCI_BUS_ID

    @property
    def smi_index(self) -> int:
        """nvidia-smi's index of the physical GPU."""
        return self.gpu.index

    @property
    def uuid(self) -> str | None:
        """The physical GPU's UUID (a MIG device's own UUID is ``mig_device.uuid``)."""
        return self.gpu.uuid

    @property
    def pci_bus_id(self) -> str | None:
        """The physical GPU's PCI bus id."""
        return self.gpu.pci_bus_id

    @property
    def name(self) -> str | None:
        """Product name; a MIG device's adds its profile (``NVIDIA A100 MIG 1g.5gb``)."""
        if self.mig_device is not None:
            return f"{self.gpu.name or 'GPU'} MIG {self.mig_device.profile}"
        return self.gpu.name

    @property
    def memory_total_mib(self) -> int | None:
        """Total memory; a MIG device's from its profile name."""
        if self.mig_device is not None:
            return mig_size_mib(self.mig_device.profile)
        return self.gpu.memory_total_mib

    @property
    def memory_used_mib(self) -> int | None:
        """Used memory (``None`` for a MIG device: not reported per instance)."""
        return None if self.mig_device is not None else self.gpu.memory_used_mib

    @property
    def memory_free_mib(self) -> int | None:
        """Free memory (``None`` for a MIG device: not reported per instance)."""
        return None if self.mig_device is not None else self.gpu.memory_free_mib

    @property
    def utilization_pct(self) -> int | None:
        """Utilization in percent (``None`` for a MIG device)."""
        return None if self.mig_device is not None else self.gpu.utilization_pct

    @property
    def temperature_c(self) -> float | None:
        """The physical GPU's temperature."""
        return self.gpu.temperature_c

    @property
    def power_w(self) -> float | None:
        """The physical GPU's power draw."""
        return self.gpu.power_w

    @property
    def process_count(self) -> int | None:
        """Compute processes on it (``None``: unknown, or a MIG device)."""
        return None if self.mig_device is not None else self.gpu.process_count

    @property
    def mig_enabled(self) -> bool | None:
        """Whether MIG is on (always for a MIG device)."""
        return True if self.mig_device is not None else self.gpu.mig_enabled

    @property
    def unavailable(self) -> tuple[tuple[str, str], ...]:
        """``(field, placeholder)`` pairs nvidia-smi could not report."""
        if self.mig_device is not None:
            return (("memory", MIG_MEMORY_NOTE),)
        return self.gpu.unavailable

    @property
    def id(self) -> str:
        """The id to put in CUDA_VISIBLE_DEVICES: MIG uuid, GPU uuid, or the nvidia-smi index."""
        if self.mig_device is not None:
            return self.mig_device.uuid
        return self.uuid if self.uuid else str(self.smi_index)

    def to_dict(self) -> dict[str, Any]:
        """The ``devices[]`` entry of ``ckptfix gpus --json``.

        Returns:
            A dict valid against the ``devices`` items of docs/schemas/gpus.schema.json.
        """
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
