"""torchao's safetensors layout back to torch: inner tensors + ``__metadata__`` rebuilt as torchao tensor subclasses.

``convert`` writes torchao tensors (``Int8Tensor``, ``Float8Tensor`` ...) as torchao's own
``flatten_tensor_state_dict`` does (:func:`ckptfix.pickles.subclass.flatten_named`); transformers writes the
same for a ``TorchAoConfig`` model.  ``convert --to pt`` of such a file rebuilds the subclasses with torchao's
own ``unflatten_tensor_state_dict`` (the loader transformers uses), so the ``.pth`` written is what
``torch.save(model.state_dict())`` of the quantized model writes, and ``torch.load(weights_only=True)`` with
torchao imported gives the same tensors back.  That needs torchao installed (loading the output needs it too).
"""

from __future__ import annotations

from typing import Any, Mapping

from ckptfix.errors import UnsupportedError
from ckptfix.pickles.subclass import BY_TYPE, torchao_entries


def rebuild(tensors: Mapping[str, Any], meta: Mapping[str, str], src: str) -> tuple[dict[str, Any], list[str]]:
    """The state dict torchao's ``unflatten_tensor_state_dict`` gives for a file in its layout.

    Args:
        tensors: the file's tensors (torch tensors).
        meta: its ``__metadata__``.
        src: the input, for messages.

    Returns:
        ``(state dict, metadata keys consumed)``: the tensors in ``tensor_names`` order (torchao subclasses where
        the metadata says so), then any tensor the metadata does not name.

    Raises:
        UnsupportedError: torchao is not installed, or torchao cannot rebuild a tensor (its message).
    """
    entries = torchao_entries(meta)
    assert entries is not None
    try:
        from torchao.prototype.safetensors.safetensors_support import unflatten_tensor_state_dict
    except ImportError:
        kinds = sorted({t for t in entries.values() if t in BY_TYPE})
        raise UnsupportedError(
            f"{src}: its tensors are torchao {', '.join(kinds)} in torchao's safetensors layout; writing them back "
            "as torchao tensors needs torchao (`pip install torchao`; loading the .pth needs it too); "
            "`ckptfix inspect` shows the inner tensors without it"
        ) from None
    try:
        result, leftover = unflatten_tensor_state_dict(dict(tensors), dict(meta))
    except Exception as e:  # noqa: BLE001 - torchao's own refusal (a class it does not know, missing parts)
        raise UnsupportedError(f"{src}: torchao cannot rebuild its tensors ({type(e).__name__}: {e})") from None
    missing = [n for n in entries if n not in result]
    if missing:
        raise UnsupportedError(
            f"{src}: tensor(s) {', '.join(missing[:3])} named in its torchao metadata lack their parts in the file"
        )
    out = {n: result[n] for n in entries}
    for k, v in leftover.items():
        out.setdefault(k, v)
    return out, ["tensor_names", *entries]


def same_tensor(a: Any, b: Any) -> bool:
    """Whether two tensors are equal: the same class, dtype and shape, and (for a torchao subclass) every inner
    tensor bit-equal and every attribute equal.

    Args:
        a: a tensor (plain or torchao).
        b: another.

    Returns:
        True when equal.
    """
    import torch

    if type(a) is not type(b) or a.dtype != b.dtype or a.shape != b.shape:
        return False
    names = getattr(a, "tensor_data_names", None)
    if names is None:
        return bool(
            torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))
        )
    for n in list(names) + list(getattr(a, "optional_tensor_data_names", None) or []):
        x, y = getattr(a, n, None), getattr(b, n, None)
        if (x is None) != (y is None):
            return False
        if x is not None and not same_tensor(x, y):
            return False
    attrs = list(getattr(a, "tensor_attribute_names", None) or []) + list(
        getattr(a, "optional_tensor_attribute_names", None) or []
    )
    for n in attrs:
        x, y = getattr(a, n, None), getattr(b, n, None)
        if isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)):
            x, y = list(x), list(y)
        if x != y:
            return False
    return True
