"""``inspect`` and ``scan``: report on a checkpoint without torch and without running pickle code."""

from __future__ import annotations

import collections
import io
import os
import zipfile
from dataclasses import asdict, dataclass, field
from typing import Any

from ckptfix.formats import is_tensor_like, read_checkpoint, sniff
from ckptfix.pickles import Stub, TensorRecord, classify_global, global_name, scan_globals

INSPECT_SCHEMA = "ckptfix.inspect/1"
SCAN_SCHEMA = "ckptfix.scan/1"


@dataclass
class InspectReport:
    """What :func:`inspect_checkpoint` found; ``to_dict()`` is the ``--json`` document.

    Counting (tied = one tensor under several names, as GPT-2's ``lm_head.weight`` and
    ``transformer.wte.weight``):

    ``tensor_count``            names in the state dict that hold a tensor
    ``parameter_count``         values summed over every name (tied counted once per name, as
                                ``sum(t.numel() for t in model.state_dict().values())``)
    ``unique_parameter_count``  values summed over distinct tensors (tied counted once, as
                                ``sum(p.numel() for p in model.parameters())`` for parameters)
    ``total_bytes``             bytes summed over every name (``numel * element_size``)
    ``unique_bytes``            bytes of the distinct storages the state dict uses (tied tensors and views
                                of one storage counted once): what loading it costs
    ``storage_bytes``           bytes of every storage in the file, inside the state dict or not

    A valid file without tensors (``training_args.bin``, a scheduler state) has ``tensor_count`` 0,
    ``state_dict_key`` None and its entries in ``non_tensor_entries``.
    """

    path: str
    format: str
    file_size: int
    state_dict_key: list[str] | None
    tensor_count: int
    parameter_count: int
    unique_parameter_count: int
    total_bytes: int
    unique_bytes: int
    storage_bytes: int
    dtypes: dict[str, int]
    locations: dict[str, int]
    prefixes: dict[str, int]
    shared: list[list[str]]
    non_tensor_entries: dict[str, str]
    globals: dict[str, str]
    stubbed_globals: list[str]
    weights_only_ok: bool
    weights_only_reason: str
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        d = {"schema": INSPECT_SCHEMA}
        d.update(asdict(self))
        return d


def _describe(v: Any) -> str:
    if isinstance(v, TensorRecord):
        return f"tensor {v.dtype} {list(v.shape)}"
    if isinstance(v, type):
        from ckptfix.sanitize import normalise_global

        name = normalise_global(global_name(v)) if issubclass(v, Stub) else f"{v.__module__}.{v.__qualname__}"
        return f"class {name} (a reference, not an instance)"
    if isinstance(v, Stub):
        from ckptfix.sanitize import NUMPY_TO_TORCH, _dtype_code, normalise_global

        name = normalise_global(global_name(type(v)))
        st = v._state
        if name.endswith("multiarray._reconstruct") and isinstance(st, tuple) and len(st) == 5:
            code = _dtype_code(st[2]) or "?"
            shape = list(st[1]) if isinstance(st[1], tuple) else "?"
            return f"numpy.ndarray {NUMPY_TO_TORCH.get(code, code)} {shape} (placeholder)"
        if name.endswith("multiarray.scalar") and v._args:
            code = _dtype_code(v._args[0]) or "?"
            return f"numpy scalar {NUMPY_TO_TORCH.get(code, code)} (placeholder)"
        return f"object {name} (placeholder)"
    if isinstance(v, dict):
        n = sum(1 for _ in v)
        return f"dict ({n} keys)"
    if isinstance(v, (list, tuple)):
        return f"{type(v).__name__} ({len(v)} items)"
    if isinstance(v, (int, float, bool, str)) or v is None:
        s = repr(v)
        return s if len(s) <= 60 else s[:57] + "..."
    return type(v).__name__


def _prefix_counts(keys: list[str]) -> dict[str, int]:
    try:
        from ckptfix.prefixes import detect_prefixes
    except ImportError:  # pragma: no cover
        return {}
    rep = detect_prefixes(keys)
    out = dict(rep.leading)
    out.update({f"(inner) {k}": v for k, v in rep.inner.items()})
    return out


def inspect_checkpoint(path: str | os.PathLike, key: str | None = None) -> InspectReport:
    """Summarise a checkpoint without loading tensor data and without running any pickle code.

    Args:
        path: any checkpoint ckptfix reads (torch zip/legacy, safetensors, sharded index, DCP, TorchScript).
        key: where the state dict sits (found automatically otherwise).

    Returns:
        InspectReport (see its docstring for what each count means).  A valid torch file without
        tensors is summarised too (``tensor_count`` 0).

    Raises:
        CheckpointNotFoundError, CorruptCheckpointError, UnsupportedError: unreadable input.
        KeyConflictError: ``key`` does not exist.
    """
    cf = read_checkpoint(path)
    obj = cf.obj
    if cf.format == "torchscript":
        obj = cf.extra.get("torchscript_state_dict") or {}
    from ckptfix.convert import contains_tensors, locate_state_dict

    holder = "mapping"
    if key is None and cf.format not in ("safetensors", "sharded", "dcp") and not contains_tensors(obj):
        key_path: tuple[str, ...] | None = None
        sd: Any = {}
    else:
        key_path, sd, holder = locate_state_dict(obj, key)
    tensors = {k: v for k, v in sd.items() if is_tensor_like(v)}
    dtypes: collections.Counter[str] = collections.Counter(t.dtype for t in tensors.values())
    by_storage: dict[int, list[str]] = collections.defaultdict(list)
    for name, t in tensors.items():
        if t.storage is not None:
            by_storage[id(t.storage)].append(name)
    shared = [names for names in by_storage.values() if len(names) > 1]
    locations: collections.Counter[str] = collections.Counter(st.location for st in cf.storages.values())
    storage_bytes = sum(st.nbytes or 0 for st in cf.storages.values())
    distinct: dict[tuple, Any] = {}
    for t in tensors.values():
        st = t.storage
        distinct.setdefault((id(st), t.offset, tuple(t.shape), tuple(t.stride), t.dtype) if st is not None
                            else (id(t),), t)
    sd_storages = {id(t.storage): t.storage for t in tensors.values() if t.storage is not None}
    unique_bytes = (sum(st.nbytes or 0 for st in sd_storages.values())
                    + sum(t.nbytes for t in distinct.values() if t.storage is None))
    non_tensor: dict[str, str] = {}
    if key_path is None:  # no tensors at all: the entries themselves
        top = obj._state if isinstance(obj, Stub) and isinstance(obj._state, dict) else obj
        if isinstance(top, Stub) and top._dictitems:
            top = top._dictitems
        if isinstance(top, dict):
            for k, v in top.items():
                non_tensor[str(k)] = _describe(v)
        else:
            non_tensor["(top level)"] = _describe(obj)
        if isinstance(obj, Stub):
            non_tensor = {"(top level)": _describe(obj), **non_tensor}
    elif key_path and hasattr(cf.obj, "items") and not isinstance(cf.obj, type):
        for k, v in cf.obj.items():
            if k != key_path[0]:
                non_tensor[str(k)] = _describe(v)
    for k, v in sd.items():
        if not is_tensor_like(v):
            non_tensor[f"{'/'.join(key_path) + '/' if key_path else ''}{k}"] = _describe(v)
    ctx = {"dcp": "dcp", "torchscript": "torchscript"}.get(cf.format)
    gl = {g: classify_global(g, ctx) for g in sorted(cf.globals_seen)}
    bad = [g for g, c in gl.items() if c != "safe"]
    from ckptfix.sanitize import _opcodes_weights_only_cannot_read

    if cf.format in ("safetensors",):
        wo_ok, why = True, "safetensors holds no pickle"
    elif cf.format == "torchscript":
        wo_ok, why = True, "torch.load hands TorchScript archives to torch.jit.load"
    elif cf.format == "dcp":
        wo_ok, why = False, "a DCP directory is not a torch.load file (use load_anywhere or dcp.load)"
    elif bad:
        wo_ok, why = False, f"globals not allowed by weights_only: {', '.join(bad[:5])}" + (" ..." if len(bad) > 5
                                                                                              else "")
    elif cf.format in ("torch-zip", "torch-legacy") and (ops := _opcodes_weights_only_cannot_read(cf.path, cf.format)):
        wo_ok, why = False, (f"the pickle uses opcodes torch's weights-only unpickler cannot read ({', '.join(ops)}: "
                             "pickle protocol 3 or newer); `ckptfix sanitize` rewrites it")
    else:
        wo_ok, why = True, "only globals torch's weights-only unpickler allows"
    notes = list(cf.notes)
    cuda = [loc for loc in locations if loc.startswith("cuda")]
    if cuda:
        notes.append(f"storages are tagged {', '.join(sorted(cuda))}: plain torch.load fails without those GPUs; "
                     "load_anywhere / --map-location remaps them")
    if cf.format == "torch-legacy":
        notes.append("legacy (pre-1.6) format: cannot be memory-mapped; strip-prefix/convert rewrite it as zip")
    if holder == "module":
        notes.append("a whole pickled nn.Module (torch.save(model)): the state dict is its state_dict(); loading "
                     "the module itself runs its class's code (load_anywhere gives the state dict)")
    elif holder == "sequence":
        notes.append("a list/tuple holding tensors, not a state dict: each named by its position (\"0\", \"1.2\" ...)")
    if key_path is None:
        notes.append("no tensors in this file (e.g. training arguments or a scheduler state); load it with "
                     "load_checkpoint(...).checkpoint, or make it weights_only-loadable with ckptfix sanitize")
    return InspectReport(
        path=cf.path, format=cf.format, file_size=cf.file_size,
        state_dict_key=None if key_path is None else list(key_path),
        tensor_count=len(tensors), parameter_count=sum(t.numel for t in tensors.values()),
        unique_parameter_count=sum(t.numel for t in distinct.values()),
        total_bytes=sum(t.nbytes for t in tensors.values()), unique_bytes=unique_bytes,
        storage_bytes=storage_bytes,
        dtypes=dict(sorted(dtypes.items())), locations=dict(sorted(locations.items())),
        prefixes=_prefix_counts(list(map(str, sd.keys()))), shared=shared, non_tensor_entries=non_tensor,
        globals=gl, stubbed_globals=sorted(cf.stubbed), weights_only_ok=wo_ok, weights_only_reason=why,
        notes=notes)


# --------------------------------------------------------------------------- scan

@dataclass
class ScanReport:
    path: str
    format: str
    pickles: list[str]
    globals: dict[str, dict[str, Any]]  # name -> {"class": ..., "count": n}
    errors: list[str]

    @property
    def dangerous(self) -> list[str]:
        return [g for g, d in self.globals.items() if d["class"] == "dangerous"]

    @property
    def unknown(self) -> list[str]:
        return [g for g, d in self.globals.items() if d["class"] == "unknown"]

    @property
    def verdict(self) -> str:
        if self.dangerous:
            return "dangerous"
        if self.unknown:
            return "unknown"
        if self.errors:
            return "malformed"
        return "safe"

    def to_dict(self) -> dict[str, Any]:
        return {"schema": SCAN_SCHEMA, "path": self.path, "format": self.format, "verdict": self.verdict,
                "pickles": self.pickles, "globals": self.globals, "dangerous": self.dangerous,
                "unknown": self.unknown, "errors": self.errors}


class _Slice(io.RawIOBase):
    """A read-only window of a file, for zip archives embedded in DCP shard files."""

    def __init__(self, f: Any, start: int, length: int):
        self.f, self.start, self.length, self.pos = f, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, off: int, whence: int = 0) -> int:
        self.pos = off if whence == 0 else self.pos + off if whence == 1 else self.length + off
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, b: Any) -> int:
        n = max(0, min(len(b), self.length - self.pos))
        self.f.seek(self.start + self.pos)
        data = self.f.read(n)
        b[: len(data)] = data
        self.pos += len(data)
        return len(data)


def _scan_zip(fileobj: Any, label: str, counts: collections.Counter, pickles: list[str], errors: list[str]) -> None:
    try:
        zf = zipfile.ZipFile(fileobj)
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, NotImplementedError, KeyError, IndexError) as e:
        errors.append(f"{label}: damaged zip ({e})")
        return
    with zf:
        for name in zf.namelist():
            if name.endswith(".pkl") and not name.endswith(".debug_pkl"):
                try:
                    data = zf.read(name)
                except Exception as e:  # noqa: BLE001 - report, never crash
                    errors.append(f"{label}:{name}: unreadable ({e})")
                    continue
                r = scan_globals(data)
                pickles.append(f"{label}:{name}")
                counts.update(r.globals)
                if r.error:
                    errors.append(f"{label}:{name}: {r.error}")


def scan_checkpoint(path: str | os.PathLike) -> ScanReport:
    """List every global the checkpoint's pickles reference and classify each. Never unpickles anything."""
    path = os.fspath(path)
    kind = sniff(path)
    counts: collections.Counter[str] = collections.Counter()
    pickles: list[str] = []
    errors: list[str] = []
    fmt = kind
    if kind in ("torch-zip", "torchscript"):
        with open(path, "rb") as f:
            _scan_zip(f, os.path.basename(path), counts, pickles, errors)
    elif kind == "pickle-stream":
        from ckptfix.formats.legacy import scan_stream

        r = scan_stream(path)
        counts.update(r.globals)
        pickles.append(os.path.basename(path))
        if r.error:
            errors.append(r.error)
        fmt = "torch-legacy/pickle"
        from ckptfix.errors import CorruptCheckpointError
        from ckptfix.formats.legacy import read_pickle_stream

        try:  # the storage table too (restricted reader: nothing runs)
            fmt = read_pickle_stream(path).format
        except CorruptCheckpointError as e:
            errors.append(str(e))
    elif kind == "safetensors":
        read_checkpoint(path)  # validates the header
    elif kind in ("sharded", "sharded-dir"):
        cf = read_checkpoint(path)
        for shard, scf in cf.extra["shards"].items():
            sub = scan_checkpoint(scf.path)
            for g, d in sub.globals.items():
                counts[g] += d["count"]
            pickles += [f"{shard}:{p}" for p in sub.pickles]
            errors += sub.errors
    elif kind == "dcp":
        meta = os.path.join(path, ".metadata")
        with open(meta, "rb") as f:
            r = scan_globals(f)
        counts.update(r.globals)
        pickles.append(".metadata")
        if r.error:
            errors.append(f".metadata: {r.error}")
        for item, (rel, off, length) in _dcp_items(path).items():
            with open(os.path.join(path, rel), "rb") as f:
                _scan_zip(_Slice(f, off, length), f"{rel}@{off}", counts, pickles, errors)
    ctx = {"dcp": "dcp", "torchscript": "torchscript"}.get(kind)
    gl = {g: {"class": classify_global(g, ctx), "count": n} for g, n in sorted(counts.items())}
    return ScanReport(path=path, format=fmt, pickles=pickles, globals=gl, errors=errors)


def _dcp_items(path: str) -> dict[str, tuple[str, int, int]]:
    """fqn -> (shard file, offset, length) from DCP metadata, read with the restricted reader."""
    from ckptfix.pickles import RecordingUnpickler

    out: dict[str, tuple[str, int, int]] = {}
    try:
        with open(os.path.join(path, ".metadata"), "rb") as f:
            meta = RecordingUnpickler(f).load()
        sd = meta._state.get("storage_data", {}) if isinstance(meta, Stub) and isinstance(meta._state, dict) else {}
        for idx, info in sd.items():
            ist = idx._state if isinstance(idx, Stub) and isinstance(idx._state, dict) else {}
            st = info._state if isinstance(info, Stub) and isinstance(info._state, dict) else {}
            rel, off, length = st.get("relative_path"), st.get("offset"), st.get("length")
            if isinstance(rel, str) and "/" not in rel and isinstance(off, int) and isinstance(length, int):
                out[f"{ist.get('fqn')}#{ist.get('index')}"] = (rel, off, length)
    except Exception:  # noqa: BLE001 - metadata problems are reported by the .metadata scan
        pass
    return out

