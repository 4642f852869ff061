"""Which GPU architectures each CUDA build of torch ships kernels for, and whether a GPU can run it.  Pure.

A CUDA wheel carries machine code (SASS) for a list of architectures, and PTX for at most the last one.  A GPU
of compute capability ``M.m`` runs a wheel when the wheel has SASS for ``M.k`` with ``k <= m`` (a cubin runs on
later minor revisions of its major version) or PTX for an architecture ``<= M.m`` (JIT-compiled at first use).
Otherwise every kernel fails with "no kernel image is available for execution on the device".

Sources of :data:`WHEEL_ARCHS` (checked 2026-11):

* pytorch/pytorch ``RELEASE.md``, "PyTorch CUDA Support Matrix" (added for release 2.9 by pytorch/pytorch#164471;
  release 2.11's by #175253): cu126 = Maxwell 5.0, Pascal 6.0, Volta 7.0, Turing 7.5, Ampere 8.0/8.6, Hopper 9.0;
  cu128 (2.9, 2.10) = Volta 7.0 ... Blackwell 10.0/12.0, and from 2.11 without Volta (pytorch/pytorch#172352);
  cu130 = Turing 7.5, Ampere 8.0/8.6, Hopper 9.0, Blackwell 10.0/12.0 (+PTX 12.0 on Linux): CUDA 13 cannot build
  for Maxwell, Pascal or Volta at all.
* "Maxwell and Pascal architecture support removed in CUDA 12.8 and 12.9 builds" (dev-discuss.pytorch.org, PyTorch
  2.8, 2025-07): cu128/cu129 of 2.8 = 7.0, 7.5, 8.0, 8.6, 9.0, 10.0, 12.0; before 2.8 cu128 still had 5.0/6.0.
* ``.ci/manywheel/build_cuda.sh`` of the release branches for cu118/cu121/cu124 (5.0, 6.0, 7.0, 7.5, 8.0, 8.6, 9.0).
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["WHEEL_ARCHS", "wheel_archs", "runs_on", "arch_text"]

Arch = tuple[int, int]

_PRE_TURING_12 = ((5, 0), (6, 0), (7, 0), (7, 5), (8, 0), (8, 6), (9, 0))
_BLACKWELL_WITH_VOLTA = ((7, 0), (7, 5), (8, 0), (8, 6), (9, 0), (10, 0), (12, 0))
_BLACKWELL_FROM_TURING = ((7, 5), (8, 0), (8, 6), (9, 0), (10, 0), (12, 0))

#: (torch major, minor) -> CUDA build -> (SASS architectures, PTX architecture or None)
WHEEL_ARCHS: dict[tuple[int, int], dict[str, tuple[tuple[Arch, ...], Arch | None]]] = {
    (2, 4): {"cu118": (_PRE_TURING_12, None), "cu121": (_PRE_TURING_12, None), "cu124": (_PRE_TURING_12, None)},
    (2, 5): {"cu118": (_PRE_TURING_12, None), "cu121": (_PRE_TURING_12, None), "cu124": (_PRE_TURING_12, None)},
    (2, 6): {"cu118": (_PRE_TURING_12, None), "cu124": (_PRE_TURING_12, None), "cu126": (_PRE_TURING_12, None)},
    (2, 7): {
        "cu118": (_PRE_TURING_12, None),
        "cu126": (_PRE_TURING_12, None),
        "cu128": (((5, 0), (6, 0)) + _BLACKWELL_WITH_VOLTA, None),
    },
    (2, 8): {
        "cu126": (_PRE_TURING_12, None),
        "cu128": (_BLACKWELL_WITH_VOLTA, None),
        "cu129": (_BLACKWELL_WITH_VOLTA, (12, 0)),
    },
    (2, 9): {
        "cu126": (_PRE_TURING_12, None),
        "cu128": (_BLACKWELL_WITH_VOLTA, None),
        "cu130": (_BLACKWELL_FROM_TURING, (12, 0)),
    },
    (2, 10): {
        "cu126": (_PRE_TURING_12, None),
        "cu128": (_BLACKWELL_WITH_VOLTA, None),
        "cu130": (_BLACKWELL_FROM_TURING, (12, 0)),
    },
    (2, 11): {
        "cu126": (_PRE_TURING_12, None),
        "cu128": (_BLACKWELL_FROM_TURING, None),
        "cu130": (_BLACKWELL_FROM_TURING, (12, 0)),
    },
}


def wheel_archs(torch_key: tuple[int, int], build: str) -> tuple[tuple[Arch, ...], Arch | None] | None:
    """The architectures of one CUDA build: the table's row, the nearest older release's, or by CUDA major.

    Returns:
        ``(SASS architectures, PTX architecture)``, or ``None`` when nothing is known of the build.
    """
    for key in sorted((k for k in WHEEL_ARCHS if k <= torch_key), reverse=True) or sorted(WHEEL_ARCHS):
        if build in WHEEL_ARCHS[key]:
            return WHEEL_ARCHS[key][build]
    if build.startswith("cu13"):  # any CUDA 13 build: Turing and newer only (CUDA 13 dropped sm_50..sm_72)
        return _BLACKWELL_FROM_TURING, (12, 0)
    return None


def runs_on(archs: tuple[tuple[Arch, ...], Arch | None], cc: Arch) -> bool:
    """Whether a GPU of compute capability ``cc`` runs a build with these architectures.

    >>> runs_on(((( 6, 0), (7, 0)), None), (6, 1)), runs_on((((7, 5),), None), (7, 0))
    (True, False)

    Returns:
        ``True`` when it has SASS for ``cc``'s major at or below ``cc``, or PTX at or below ``cc``.
    """
    sass, ptx = archs
    if any(a[0] == cc[0] and a[1] <= cc[1] for a in sass):
        return True
    return ptx is not None and ptx <= cc


def arch_text(archs: Sequence[Arch]) -> str:
    """``[(7, 5), (8, 0)] -> "sm_75, sm_80"``."""
    return ", ".join(f"sm_{a[0]}{a[1]}" for a in archs)
