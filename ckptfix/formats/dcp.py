"""``torch.distributed.checkpoint`` directories, read without torch (metadata only).

``.metadata`` is a pickle of dataclasses from ``torch.distributed.checkpoint``;
the restricted reader turns them into placeholders whose recorded state gives
every entry's fully-qualified name, dtype, shape and the shard files.  Tensor
bytes live in ``__<rank>_<n>.distcp`` files (each item a small torch archive);
loading them is :mod:`ckptfix.loading`'s job.
"""

from __future__ import annotations

import os
from typing import Any

from ckptfix.errors import CorruptCheckpointError
from ckptfix.formats import CheckpointFile
from ckptfix.pickles import RecordingUnpickler, Stub, StorageRecord, TensorRecord, stub_dtype


def _state(x: Any) -> dict:
    st = x._state if isinstance(x, Stub) else None
    if isinstance(st, tuple) and len(st) == 2 and isinstance(st[1], dict):  # (dict, slots)
        merged = dict(st[0] or {})
        merged.update(st[1])
        return merged
    return st if isinstance(st, dict) else {}


def _tuple(x: Any) -> tuple:
    if isinstance(x, Stub):
        return tuple(x._args[0]) if x._args else ()
    return tuple(x)


def read_dcp(path: str) -> CheckpointFile:
    meta_path = os.path.join(path, ".metadata")
    with open(meta_path, "rb") as f:
        up = RecordingUnpickler(f)
        try:
            meta = up.load()
        except Exception as e:
            raise CorruptCheckpointError(f"{meta_path}: cannot read DCP metadata ({type(e).__name__}: {e})") from None
    st = _state(meta)
    sdm = st.get("state_dict_metadata")
    if not isinstance(sdm, dict):
        raise CorruptCheckpointError(f"{meta_path}: not DCP metadata (no state_dict_metadata)")
    planner = st.get("planner_data") or {}
    storage_data = st.get("storage_data") or {}
    files: dict[str, list[str]] = {}
    for idx, info in storage_data.items():
        fqn = _state(idx).get("fqn")
        rel = _state(info).get("relative_path")
        files.setdefault(str(fqn), []).append(str(rel))
    obj: dict[str, Any] = {}
    storages: dict[str, StorageRecord] = {}
    for fqn, md in sdm.items():
        mst = _state(md)
        if "size" in mst:
            props = mst.get("properties")
            pst = props._state if isinstance(props, Stub) else None
            dtype_cls = pst[0] if isinstance(pst, tuple) and pst else _state(props).get("dtype")
            dtype = stub_dtype(dtype_cls) or "unknown"
            shape = _tuple(mst["size"])
            stride, acc = [], 1
            for s in reversed(shape):
                stride.insert(0, acc)
                acc *= s
            rec = StorageRecord(key=fqn, dtype=dtype, location="cpu", source=os.path.join(path, (files.get(fqn) or
                                                                                                  ["?"])[0]))
            t = TensorRecord(rec, 0, shape, tuple(stride), dtype)
            rec.nbytes = t.nbytes
            storages[fqn] = rec
            value: Any = t
        else:
            value = "<bytes entry>"
        keys = planner.get(fqn) or (fqn,)
        node = obj
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                break
        else:
            node[keys[-1]] = value
    size = sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path)
               if os.path.isfile(os.path.join(path, n)))
    shard_files = sorted(n for n in os.listdir(path) if n.endswith(".distcp"))
    return CheckpointFile(path=path, format="dcp", obj=obj, storages=storages, globals_seen=dict(up.globals_seen),
                          stubbed=set(up.stubbed), file_size=size, extra={"shards": shard_files})
