"""The probe: the model's output on a fixed batch, computed so that equal weights give equal bits.

Every saved epoch records this output (in ``checkpoints.json`` and a ``.probe.pt`` sidecar);
:func:`ckptfix.train.resume.verify_probe` recomputes it on restored weights to prove a restoration exact.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import hashlib
from typing import Iterator

import torch
from torch import nn

from ckptfix.train import data as _data


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The raw bytes of a tensor in C order (native byte order), without numpy.

    Returns:
        ``numel * element_size`` bytes (``b""`` for an empty tensor).
    """
    t = t.detach().to("cpu").contiguous()
    return ctypes.string_at(t.data_ptr(), t.numel() * t.element_size()) if t.numel() else b""


def tensor_sha256(t: torch.Tensor) -> str:
    """sha256 of the tensor's float32 bytes (C order, native little-endian)."""
    return hashlib.sha256(tensor_bytes(t.detach().to("cpu", torch.float32))).hexdigest()


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def probe_output(model: nn.Module, probe: torch.Tensor | None = None) -> torch.Tensor:
    """The model's logits on the probe batch: a CPU float32 copy, eval mode, one intra-op thread.

    One thread makes the summation order fixed, so the same weights give the
    same bits on the same machine (the basis of the bit-exact restoration check).

    Args:
        model: The model (not modified: a copy runs).
        probe: The input batch; default :func:`ckptfix.train.data.probe_batch`.
    """
    if probe is None:
        probe = _data.probe_batch()
    m = copy.deepcopy(model).to("cpu", torch.float32).eval()
    if hasattr(m, "show_split"):
        setattr(m, "show_split", False)  # noqa: B010 - an attribute of some models only
    with _one_thread(), torch.no_grad():
        return m(probe).detach().clone()
