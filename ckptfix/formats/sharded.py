"""Sharded checkpoints: ``*.index.json`` with a ``weight_map`` (``.bin`` or ``.safetensors`` shards)."""

from __future__ import annotations

import json
import os

from ckptfix.errors import CheckpointNotFoundError, CorruptCheckpointError
from ckptfix.formats import CheckpointFile


def index_path(path: str) -> str:
    if os.path.isdir(path):
        idx = sorted(n for n in os.listdir(path) if n.endswith(".index.json"))
        if len(idx) > 1:
            raise CorruptCheckpointError(f"{path}: several *.index.json files ({', '.join(idx)}); pass one")
        return os.path.join(path, idx[0])
    return path


def read_index(path: str) -> CheckpointFile:
    """Read every shard (without torch) and merge the tensors named in the weight map."""
    from ckptfix.formats import read_checkpoint

    ipath = index_path(path)
    try:
        with open(ipath, encoding="utf-8") as f:
            doc = json.load(f)
        weight_map = doc["weight_map"]
        assert isinstance(weight_map, dict)
    except (ValueError, KeyError, AssertionError, UnicodeDecodeError):
        raise CorruptCheckpointError(f"{ipath}: not a valid sharded index (needs a 'weight_map' object)") from None
    base = os.path.dirname(os.path.abspath(ipath))
    shards: dict[str, CheckpointFile] = {}
    for shard in dict.fromkeys(weight_map.values()):
        sp = os.path.join(base, str(shard))
        if not os.path.isfile(sp):
            raise CheckpointNotFoundError(f"{ipath}: shard {shard!r} is listed in the index but missing from {base}; "
                                          "download or copy every shard next to the index")
        shards[str(shard)] = read_checkpoint(sp)
    obj: dict = {}
    storages: dict = {}
    globals_seen: dict[str, int] = {}
    stubbed: set[str] = set()
    for name, shard in weight_map.items():
        cf = shards[str(shard)]
        _, sd = cf.state_dict()
        if name not in sd:
            raise CorruptCheckpointError(f"{ipath}: tensor {name!r} is mapped to {shard!r} but not in it")
        obj[name] = sd[name]
    for shard, cf in shards.items():
        for k, rec in cf.storages.items():
            storages[f"{shard}:{k}"] = rec
        for g, n in cf.globals_seen.items():
            globals_seen[g] = globals_seen.get(g, 0) + n
        stubbed |= cf.stubbed
    total = sum(cf.file_size for cf in shards.values())
    return CheckpointFile(path=ipath, format="sharded", obj=obj, storages=storages, globals_seen=globals_seen,
                          stubbed=stubbed, file_size=total,
                          extra={"shards": shards, "index": doc, "shard_format": next(iter(shards.values())).format
                                 if shards else None})
