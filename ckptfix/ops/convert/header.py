"""The safetensors file layout: tensor order, the JSON header, shards.

The header is written exactly as ``safetensors.torch.save_file`` writes it (tensors ordered by
dtype alignment, then name; header padded with spaces to a multiple of 8), so the output is
byte-identical to ``save_file``'s for the same tensors and metadata.
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

from ckptfix.formats.safetensors_fmt import st_shape
from ckptfix.ops.convert.items import Item

#: safetensors' Rust ``Dtype`` enum order; ``save_file`` sorts tensors by it, descending, then by name
_ST_ENUM_ORDER = [
    "BOOL",
    "F4",
    "F6_E2M3",
    "F6_E3M2",
    "U8",
    "I8",
    "F8_E5M2",
    "F8_E4M3",
    "F8_E8M0",
    "F8_E4M3FNUZ",  # (safetensors 0.8: after F8_E8M0, as save_file orders them)
    "F8_E5M2FNUZ",
    "I16",
    "U16",
    "F16",
    "BF16",
    "I32",
    "U32",
    "F32",
    "C64",
    "F64",
    "I64",
    "U64",
]
_ST_RANK = {code: i for i, code in enumerate(_ST_ENUM_ORDER)}


def _sorted_items(items: Sequence[Item]) -> list[Item]:
    return sorted(items, key=lambda it: (-_ST_RANK[it.st_dtype], it.name))


def safetensors_header(items: Sequence[Any], metadata: Mapping[str, str] | None) -> bytes:
    """The 8-byte length + JSON header ``save_file`` writes, for items in file order with ``begin`` set.

    Args:
        items: objects with ``name``, ``st_dtype``, ``shape``, ``begin`` and ``nbytes``.
        metadata: the ``__metadata__`` entries, written in their order.

    Returns:
        The header bytes, padded with spaces to a multiple of 8.
    """
    parts = []
    if metadata:
        meta = ",".join(f"{_js(k)}:{_js(v)}" for k, v in metadata.items())
        parts.append(f'"__metadata__":{{{meta}}}')
    for it in items:
        shape = ",".join(str(s) for s in st_shape(it.dtype, it.shape))
        parts.append(
            f'{_js(it.name)}:{{"dtype":"{it.st_dtype}","shape":[{shape}],'
            f'"data_offsets":[{it.begin},{it.begin + it.nbytes}]}}'
        )
    text = ("{" + ",".join(parts) + "}").encode("utf-8")
    text += b" " * ((-len(text)) % 8)
    return len(text).to_bytes(8, "little") + text


def _js(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)


def layout(items: Sequence[Item]) -> list[Item]:
    """Order items as ``save_file`` does (dtype alignment, then name) and set each one's ``begin``.

    Args:
        items: the items of one file.

    Returns:
        The items in file order.
    """
    ordered = _sorted_items(items)
    pos = 0
    for it in ordered:
        it.begin = pos
        pos += it.nbytes
    return ordered


def shard(items: Sequence[Item], max_size: int | None) -> list[list[Item]]:
    """Split in state-dict order, as huggingface_hub does: a tensor larger than the limit gets its own shard.

    Args:
        items: the items in state-dict order.
        max_size: bytes per shard; None or 0 for one file.

    Returns:
        The shards, each a list of items.
    """
    if not max_size:
        return [list(items)]
    shards: list[list[Item]] = [[]]
    size = 0
    for it in items:
        if shards[-1] and size + it.nbytes > max_size:
            shards.append([])
            size = 0
        shards[-1].append(it)
        size += it.nbytes
    return shards
