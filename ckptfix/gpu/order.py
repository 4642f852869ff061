"""CUDA's numbering of the physical GPUs: PCI bus order, and the FASTEST_FIRST guess from a model table.  Pure."""

from __future__ import annotations

import re
from typing import Sequence

from ckptfix.gpu.records import SmiGpu

__all__ = ["pci_sort_key", "model_info", "speed_key", "enumeration_order", "pci_order", "is_unified_memory"]


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
    ("GB200", (10, 0), 148),
    ("B200", (10, 0), 148),
    ("B100", (10, 0), 132),
    ("GB10", (12, 1), 48),
    ("RTX PRO 6000", (12, 0), 188),
    ("RTX 5090", (12, 0), 170),
    ("RTX 5080", (12, 0), 84),
    ("RTX 5070 TI", (12, 0), 70),
    ("RTX 5070", (12, 0), 48),
    ("RTX 5060 TI", (12, 0), 36),
    ("RTX 5060", (12, 0), 30),
    ("GH200", (9, 0), 132),
    ("H200", (9, 0), 132),
    ("H100 PCIE", (9, 0), 114),
    ("H100 NVL", (9, 0), 132),
    ("H100", (9, 0), 132),
    ("H800", (9, 0), 132),
    ("H20", (9, 0), 78),
    ("L40S", (8, 9), 142),
    ("L40", (8, 9), 142),
    ("L4", (8, 9), 58),
    ("RTX 6000 ADA", (8, 9), 142),
    ("RTX 4090", (8, 9), 128),
    ("RTX 4080", (8, 9), 76),
    ("RTX 4070", (8, 9), 46),
    ("RTX 4060", (8, 9), 24),
    ("A100", (8, 0), 108),
    ("A800", (8, 0), 108),
    ("A30", (8, 0), 56),
    ("A40", (8, 6), 84),
    ("A10G", (8, 6), 80),
    ("A10", (8, 6), 72),
    ("A16", (8, 6), 10),
    ("A2", (8, 6), 10),
    ("RTX A6000", (8, 6), 84),
    ("RTX A5000", (8, 6), 64),
    ("RTX 3090", (8, 6), 82),
    ("RTX 3080", (8, 6), 68),
    ("RTX 3070", (8, 6), 46),
    ("RTX 3060", (8, 6), 28),
    ("RTX 2080 TI", (7, 5), 68),
    ("RTX 2080 SUPER", (7, 5), 48),
    ("RTX 2080", (7, 5), 46),
    ("RTX 2070", (7, 5), 36),
    ("RTX 2060", (7, 5), 30),
    ("GTX 1660 TI", (7, 5), 24),
    ("GTX 1660 SUPER", (7, 5), 22),
    ("GTX 1660", (7, 5), 22),
    ("GTX 1650", (7, 5), 14),
    ("TITAN RTX", (7, 5), 72),
    ("QUADRO RTX 8000", (7, 5), 72),
    ("T1000", (7, 5), 14),
    ("T600", (7, 5), 10),
    ("T400", (7, 5), 6),
    ("T4", (7, 5), 40),
    ("V100", (7, 0), 80),
    ("TITAN V", (7, 0), 80),
    ("P100", (6, 0), 56),
    ("P40", (6, 1), 30),
    ("P4", (6, 1), 20),
    ("TITAN XP", (6, 1), 30),
    ("GTX 1080 TI", (6, 1), 28),
    ("TITAN X", (6, 1), 28),
    ("K80", (3, 7), 13),
)


def model_info(name: str | None) -> tuple[tuple[int, int] | None, int | None]:
    """``(compute capability, multiprocessor count)`` of a product name from the small built-in table.

    >>> model_info("NVIDIA A100-SXM4-40GB")
    ((8, 0), 108)

    Returns:
        ``(compute capability, multiprocessors)``, each ``None`` when the model is unknown.
    """
    up = (name or "").upper()
    for frag, cc, sms in _MODELS:
        if re.search(r"(?<![A-Z0-9])" + re.escape(frag) + r"(?![0-9])", up):
            return cc, sms
    return None, None


def speed_key(g: SmiGpu) -> tuple[int, int, float]:
    """How CUDA's FASTEST_FIRST ranks devices (higher first): compute capability, then multiprocessors x
    max SM clock.  From nvidia-smi's ``compute_cap`` / ``clocks.max.sm`` where reported, else the model table.
    """
    cc_table, sms = model_info(g.name)
    cc = g.compute_cap or cc_table or (0, 0)
    clock = g.max_sm_clock_mhz or 1
    return (cc[0], cc[1], float((sms or 0) * clock))


def enumeration_order(gpus: Sequence[SmiGpu], device_order: str | None) -> tuple[list[SmiGpu], bool]:
    """CUDA's numbering of every physical GPU: ``(gpus_in_cuda_order, certain)``.

    With ``PCI_BUS_ID`` (or all GPUs the same model) this is PCI order and certain.
    Otherwise CUDA puts the fastest first by an undocumented heuristic: we guess it like CUDA ranks
    devices (:func:`speed_key`, ties in PCI order) and return ``certain=False``.

    Args:
        gpus: the physical GPUs.
        device_order: the value of ``CUDA_DEVICE_ORDER`` (``None``: unset).
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


_UNIFIED = ("GB10", "JETSON", "ORIN", "THOR", "XAVIER", "TEGRA")


def is_unified_memory(name: str | None) -> bool:
    """True for SoC GPUs that share system memory (no framebuffer of their own): GB10, Jetson...

    Returns:
        True for a GPU without memory of its own.
    """
    up = (name or "").upper()
    return any(f in up for f in _UNIFIED)
