"""Convert checkpoints to safetensors (and back) without loading them.

The fast path never imports torch: :func:`ckptfix.formats.read_checkpoint`
gives every tensor as a :class:`~ckptfix.pickles.TensorRecord` whose bytes are
a byte range of the source file (zip member, legacy stream, safetensors or
``.bin`` shard), so a contiguous tensor is copied straight from the source
into the output with ``copy_file_range``; a strided view (transposed, sliced
with a step, expanded) is gathered from just its span of bytes.  The header
is written exactly as ``safetensors.torch.save_file`` writes it (tensors
ordered by dtype alignment, then name; header padded with spaces to a
multiple of 8), so the output is byte-identical to ``save_file``'s for the
same tensors and metadata (``save_file`` orders ``__metadata__`` entries
randomly per process; ckptfix writes ``format`` first, then its keys in a
fixed order).

Inputs torch-free records cannot express (DCP directories) go through
:func:`ckptfix.loading.load_checkpoint` and are written from real tensors.

Metadata written (all values are strings; JSON where noted):

``format``                 ``"pt"``
``ckptfix.source_format``  the input's format (``torch-zip``, ``torch-legacy`` ...)
``ckptfix.key_path``       JSON list: where the state dict was in the checkpoint
``ckptfix.order``          JSON list: every state-dict name in its original order
``ckptfix.aliases``        JSON object ``{alias: stored_name}`` (exact duplicates stored once)
``ckptfix.views``          JSON object ``{name: {"base", "offset", "shape", "stride"}}``
``ckptfix.extra``          JSON object: the representable non-tensor entries (epoch, step, hparams ...)

:func:`restore_aliases` turns the aliases and views back into shared tensors.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import math
import os
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence

from ckptfix._torch import require_torch
from ckptfix.atomic import fsync_dir, new_temp, same_file
from ckptfix.errors import (
    CheckpointNotFoundError,
    CkptfixError,
    CorruptCheckpointError,
    KeyConflictError,
    NoTensorsError,
    OutputError,
    UnsupportedError,
    VerificationError,
)
from ckptfix.formats.safetensors_fmt import DTYPE_TO_ST, MAX_HEADER, read_header
from ckptfix.formats.zipfmt import copy_range, pwrite_all
from ckptfix.pickles import Stub, TensorRecord, global_name, is_tensor_like

__all__ = [
    "convert_to_safetensors",
    "convert_from_safetensors",
    "convert",
    "restore_aliases",
    "rebuild_checkpoint",
    "parse_size",
    "ConvertReport",
    "safetensors_header",
]

Progress = Callable[[int, int], None]

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

_CHUNK = 8 << 20
_OPTIMIZER_KEYS = ("opt", "opt_state", "opt_state_dict")
_PTH_SUFFIXES = (".pth", ".pt", ".bin", ".ckpt", ".tar", ".pkl")
_MAX_EXTRA_JSON = 16 << 20


# --------------------------------------------------------------------------- sizes

_UNITS = {
    "": 1,
    "B": 1,
    "K": 10**3,
    "KB": 10**3,
    "M": 10**6,
    "MB": 10**6,
    "G": 10**9,
    "GB": 10**9,
    "T": 10**12,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(text: str | int) -> int:
    """``"5GB"`` -> 5_000_000_000 (decimal, the Hugging Face convention); ``KiB/MiB/GiB`` are binary."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"cannot read size {text!r}; write it like 5GB, 500MB, 2GiB or a number of bytes")
    n = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if n <= 0:
        raise ValueError(f"size {text!r} must be positive")
    return n


# --------------------------------------------------------------------------- report


@dataclass
class ConvertReport:
    """What a conversion did.  ``to_dict()`` is the ``--json`` document."""

    source: str
    outputs: list[str]
    source_format: str = ""
    direction: str = "to-safetensors"
    index: str | None = None
    key_path: tuple[str, ...] = ()
    tensors: int = 0
    aliases: dict[str, str] = field(default_factory=dict)
    views: dict[str, str] = field(default_factory=dict)
    copied_views: list[str] = field(default_factory=list)
    tied_rule: str | None = None
    excluded: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    placeholders: dict[str, str] = field(default_factory=dict)
    converted: dict[str, str] = field(default_factory=dict)
    stubbed_globals: list[str] = field(default_factory=list)
    renamed: int = 0
    optimizer_tensors: int = 0
    bytes: int = 0
    verified: bool = False
    used_torch: bool = False
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["key_path"] = list(self.key_path)
        d["seconds"] = round(self.seconds, 3)
        return d


# --------------------------------------------------------------------------- items


@dataclass
class _Item:
    """One tensor to write: where its bytes come from and what it is."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    path: str | None = None  # contiguous byte range of this file ...
    offset: int = 0
    rec: TensorRecord | None = None  # ... or a strided view to gather ...
    tensor: Any = None  # ... or a torch tensor
    begin: int = 0  # data offset in the output, filled by the planner

    @property
    def st_dtype(self) -> str:
        return DTYPE_TO_ST[self.dtype]

    def chunks(self, fds: "_Fds") -> Iterator[bytes | memoryview]:
        """The bytes of a gathered view or a torch tensor, C-contiguous, in bounded chunks.

        (Contiguous byte ranges of a file are copied by ``_Writer._copy`` instead.)
        """
        if self.rec is not None:
            yield from _gather(self.rec, fds)
        elif self.tensor is not None:
            yield from _tensor_chunks(self.tensor)


class _Fds:
    """Read-only file descriptors, opened once per path."""

    def __init__(self) -> None:
        self.fds: dict[str, int] = {}

    def get(self, path: str) -> int:
        fd = self.fds.get(path)
        if fd is None:  # two threads may race here: one descriptor is kept, the other closed
            new = os.open(path, os.O_RDONLY)
            fd = self.fds.setdefault(path, new)
            if fd != new:
                os.close(new)
        return fd

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


#: memoryview formats by element size: a strided run of elements is one C-level slice copy
_FMT = {1: "B", 2: "H", 4: "I", 8: "Q"}


def check_view(name: str, rec: TensorRecord) -> None:
    """Refuse a tensor record no torch tensor can have: negative offset, size or stride.

    Raises:
        CorruptCheckpointError: naming the tensor.
    """
    bad = [int(x) for x in (rec.offset, *rec.shape, *rec.stride) if not isinstance(x, int) or x < 0]
    if bad or len(rec.shape) != len(rec.stride):
        raise CorruptCheckpointError(
            f"tensor {name!r} has offset {rec.offset}, shape {list(rec.shape)} and stride "
            f"{list(rec.stride)}: negative or mismatched values no torch tensor has; the "
            "checkpoint is corrupt"
        )


#: output bytes allowed per input byte, plus a constant, before ``allow_expand`` is needed
EXPAND_FACTOR = 4
EXPAND_SLACK = 64 << 20


def check_expansion(items: Sequence[_Item], input_bytes: int, allow_expand: bool) -> None:
    """Refuse an output much larger than its input (stride-0 / expanded views), unless ``allow_expand``.

    A legitimate 2 KB ``torch.zeros(1).expand(N, N)`` holds N*N elements once written densely;
    the limit is ``4 x input + 64 MiB``.

    Raises:
        ResourceLimitError: naming the largest expanded tensor and the output size.
    """
    total = sum(it.nbytes for it in items)
    limit = EXPAND_FACTOR * input_bytes + EXPAND_SLACK
    if allow_expand or total <= limit:
        return
    from ckptfix.errors import ResourceLimitError

    views = [it for it in items if it.rec is not None] or list(items)
    big = max(views, key=lambda it: it.nbytes)
    raise ResourceLimitError(
        f"tensor {big.name!r} {list(big.shape)} expands to {big.nbytes} bytes (the whole output "
        f"{total} bytes, from {input_bytes} bytes of input; the limit is {EXPAND_FACTOR}x the "
        "input + 64 MiB); pass --allow-expand (allow_expand=True) to write it anyway"
    )


def _simplify(shape: Sequence[int], stride: Sequence[int]) -> tuple[list[int], list[int]]:
    """Drop size-1 dims and merge dims that step through memory as one (stride-0 runs included)."""
    dims = [(int(n), int(s)) for n, s in zip(shape, stride, strict=False) if n != 1]
    out: list[list[int]] = []
    for n, s in dims:
        if out and out[-1][1] == n * s:
            out[-1] = [out[-1][0] * n, s]
        else:
            out.append([n, s])
    if not out:
        out = [[1, 1]]
    return [n for n, _ in out], [s for _, s in out]


def _run(src: memoryview, o: int, n: int, s: int) -> bytes:
    """``n`` elements from element ``o`` of ``src``, ``s`` apart, as bytes (one C-level copy)."""
    if s == 0:
        return src[o : o + 1].tobytes() * n
    if s == 1:
        return src[o : o + n].tobytes()
    return src[o : o + (n - 1) * s + 1 : s].tobytes()


def _block(src: memoryview, off: int, a: int, sa: int, b: int, sb: int, es: int) -> Iterator[bytes | bytearray]:
    """The C-order bytes of an ``a x b`` view (element strides ``sa``, ``sb``) from element ``off``, in chunks.

    Per chunk the Python loop runs over the smaller of its two dimensions; each step is one strided
    slice copy of the other (``bytes * n`` for stride 0), so no per-element Python work.
    """
    row = b * es
    if row >= _CHUNK:
        per = max(1, _CHUNK // es)
        for i in range(a):
            o = off + i * sa
            for j0 in range(0, b, per):
                yield _run(src, o + j0 * sb, min(per, b - j0), sb)
        return
    rows = max(1, _CHUNK // row)
    same: bytes | None = None
    for i0 in range(0, a, rows):
        n = min(rows, a - i0)
        if sa == 0:
            if same is None:
                same = _run(src, off, b, sb)
            yield same * n
        elif n <= b:
            yield b"".join(_run(src, off + i * sa, b, sb) for i in range(i0, i0 + n))
        else:
            out = bytearray(n * row)
            ov = memoryview(out).cast(src.format)
            for j in range(b):
                o = off + i0 * sa + j * sb
                ov[j::b] = src[o : o + (n - 1) * sa + 1 : sa]
            ov.release()
            yield out


def _gather(rec: TensorRecord, fds: _Fds) -> Iterator[bytes | bytearray]:
    """C-order bytes of a strided view in bounded chunks, reading only its span of the storage.

    The span is memory-mapped (pages come and go through the page cache, however large the storage)
    and copied with strided slices of a typed ``memoryview``: no numpy, no per-element Python loop,
    and stride-0 (expanded) dimensions repeat bytes instead of re-reading them.
    """
    import mmap

    if rec.numel == 0:
        return
    es = rec.element_size
    fmt = _FMT.get(es)
    if fmt is None:
        raise UnsupportedError(f"tensor of dtype {rec.dtype} ({es}-byte elements) cannot be gathered")
    first, end = rec.span()
    st = rec.storage
    assert st is not None and st.source is not None and st.file_offset is not None
    fd = fds.get(st.source)
    start = st.file_offset + first * es
    length = (end - first) * es
    if os.fstat(fd).st_size < start + length:
        raise CorruptCheckpointError(f"{st.source}: file ended inside storage {st.key!r} (truncated?)")
    shape, stride = _simplify(rec.shape, rec.stride)
    if len(shape) == 1:
        shape, stride = [1] + shape, [0] + stride
    base = start - start % mmap.ALLOCATIONGRANULARITY
    mm = mmap.mmap(fd, start + length - base, offset=base, prot=mmap.PROT_READ)
    raw = memoryview(mm)
    src = raw[start - base : start - base + length].cast(fmt)
    pending: list[bytes | bytearray] = []
    size = 0
    try:
        outer = shape[:-2]
        a, b = shape[-2:]
        sa, sb = stride[-2:]
        for idx in itertools.product(*(range(n) for n in outer)):
            off = sum(i * s for i, s in zip(idx, stride, strict=False))
            for chunk in _block(src, off, a, sa, b, sb, es):
                pending.append(chunk)
                size += len(chunk)
                if size >= _CHUNK:  # small blocks are written together, not one syscall each
                    yield pending[0] if len(pending) == 1 else b"".join(pending)
                    pending, size = [], 0
        if pending:
            yield pending[0] if len(pending) == 1 else b"".join(pending)
    finally:
        src.release()
        raw.release()
        mm.close()


def _tensor_chunks(t: Any) -> Iterator[memoryview]:
    import torch

    flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
    n = flat.numel()
    for i in range(0, n, _CHUNK):
        yield memoryview(flat[i : i + _CHUNK].numpy())


def _check_dtype(name: str, dtype: str, kind: str = "dense") -> None:
    if kind != "dense":
        raise UnsupportedError(
            f"tensor {name!r} is a {kind} tensor; safetensors stores dense tensors only — "
            "convert it to dense in torch first, or drop it"
        )
    if dtype not in DTYPE_TO_ST:
        raise UnsupportedError(
            f"tensor {name!r} has dtype {dtype}, which safetensors cannot store; "
            "cast it (e.g. complex128 -> complex64 or a real view) or drop it"
        )


class _NeedsTorch(Exception):
    pass


class TiedNames:
    """Which name of a group of tied (identical) tensors is stored; the others become aliases.

    In order: a name passed with ``keep`` (``--keep``); else, when ``drop`` patterns are known (the
    ``_tied_weights_keys`` of the transformers class ``config.json`` names), the first name that
    matches none of them; else the first name in the state dict's own order (embeddings come
    before heads, ``cls.predictions.bias`` before ``cls.predictions.decoder.bias``) -- the name
    ``transformers``' own ``save_pretrained`` keeps.
    """

    def __init__(self, keep: Sequence[str] = (), drop: Sequence[str] = (), source: str = "state-dict order") -> None:
        self.keep = set(keep)
        self.drop = [re.compile(p) for p in drop]
        self.source = source
        self.used_keep: set[str] = set()

    def _dropped(self, name: str) -> bool:
        return any(p.fullmatch(name) or p.pattern == name for p in self.drop)

    def choose(self, names: Sequence[str]) -> str:
        """The name to store for one group, ``names`` in state-dict order."""
        kept = [n for n in names if n in self.keep]
        if kept:
            self.used_keep.add(kept[0])
            return kept[0]
        ok = [n for n in names if not self._dropped(n)]
        return (ok or list(names))[0]


def hf_tied_weights(src: str) -> tuple[list[str], str] | None:
    """The tied-weight names transformers drops, for the class a ``config.json`` beside ``src`` names.

    Only the installed transformers package is imported (and only when such a ``config.json``
    exists); nothing from the checkpoint runs.

    Args:
        src: the checkpoint file (or its folder).

    Returns:
        ``(patterns, source)``: the class's ``_tied_weights_keys`` (dict keys in transformers 5, list
        entries in 4.x) and a description for the report; None when there is no ``config.json`` with
        ``architectures`` next to the input or transformers is not importable (then the state-dict
        order decides).
    """
    d = src if os.path.isdir(src) else os.path.dirname(os.path.abspath(src))
    cfg = os.path.join(d, "config.json")
    if not os.path.isfile(cfg):
        return None
    try:
        with open(cfg, encoding="utf-8") as f:
            archs = json.load(f).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(archs, list) or not archs:
        return None
    try:
        import transformers
    except Exception:  # noqa: BLE001 - not installed, or broken: fall back to the state-dict order
        return None
    pats: list[str] = []
    found = []
    for arch in archs:
        if not isinstance(arch, str):
            continue
        try:
            cls = getattr(transformers, arch)
        except Exception:  # noqa: BLE001 - unknown architecture or missing optional dependency
            continue
        tied = getattr(cls, "_tied_weights_keys", None) or {}
        pats += [str(k) for k in (tied.keys() if isinstance(tied, dict) else tied)]
        found.append(arch)
    if not found:
        return None
    return pats, f"transformers {', '.join(found)}._tied_weights_keys"


def _plan_records(
    named: Sequence[tuple[str, TensorRecord]], report: ConvertReport, tied: TiedNames | None = None
) -> list[_Item]:
    """Items to store (exact duplicates once), with aliases and views recorded in the report."""
    groups: dict[tuple, list[str]] = {}
    recs: dict[str, TensorRecord] = {}
    for name, rec in named:
        _check_dtype(name, rec.dtype, rec.kind)
        check_view(name, rec)
        st = rec.storage
        if st is None or st.file_offset is None or st.source is None or st.nbytes is None:
            raise _NeedsTorch(name)
        if rec.numel and rec.span()[1] * rec.element_size > st.nbytes:
            raise CorruptCheckpointError(
                f"tensor {name!r} reaches past the end of its storage {st.key!r}; the checkpoint is corrupt"
            )
        recs[name] = rec
        groups.setdefault((id(st), rec.offset, rec.shape, rec.stride if rec.numel else (), rec.dtype), []).append(name)
    keep: dict[tuple, str] = {}
    for gkey, names in groups.items():
        stored = (tied or TiedNames()).choose(names)
        keep[gkey] = stored
        for n in names:
            if n != stored:
                report.aliases[n] = stored
    # views of one storage that are not the same tensor: restorable as views when a stored tensor covers it
    by_storage: dict[int, list[str]] = {}
    for gkey, stored in keep.items():
        by_storage.setdefault(gkey[0], []).append(stored)
    views: dict[str, dict[str, Any]] = {}
    for names in by_storage.values():
        if len(names) < 2:
            continue
        bases = sorted(n for n in names if recs[n].covers_storage())
        for n in sorted(names):
            if bases and n != bases[0] and recs[n].dtype == recs[bases[0]].dtype:
                r = recs[n]
                views[n] = {"base": bases[0], "offset": r.offset, "shape": list(r.shape), "stride": list(r.stride)}
            elif not (bases and n == bases[0]):
                report.copied_views.append(n)
    report.views = {n: v["base"] for n, v in views.items()}
    report._views_meta = views  # type: ignore[attr-defined]
    items = []
    for name, rec in named:
        if name in report.aliases:
            continue
        st = rec.storage
        assert st is not None and st.file_offset is not None
        if rec.is_contiguous() or rec.numel <= 1:
            items.append(
                _Item(
                    name,
                    rec.dtype,
                    tuple(rec.shape),
                    rec.nbytes,
                    path=st.source,
                    offset=st.file_offset + rec.offset * rec.element_size,
                )
            )
        else:
            items.append(_Item(name, rec.dtype, tuple(rec.shape), rec.nbytes, rec=rec))
    return items


def _has_tied_groups(named: Sequence[tuple[str, Any]]) -> bool:
    seen: set[tuple] = set()
    for _, v in named:
        if isinstance(v, TensorRecord):
            k: tuple = (id(v.storage), v.offset, tuple(v.shape), tuple(v.stride), v.dtype)
        else:
            k = (
                v.untyped_storage().data_ptr() if v.numel() else id(v),
                v.storage_offset(),
                tuple(v.shape),
                tuple(v.stride()),
                v.dtype,
            )
        if k in seen:
            return True
        seen.add(k)
    return False


def _torch_dtype_name(t: Any) -> str:
    return str(t.dtype).replace("torch.", "")


def _plan_tensors(
    named: Sequence[tuple[str, Any]], report: ConvertReport, tied: TiedNames | None = None
) -> list[_Item]:
    import torch

    groups: dict[tuple, list[str]] = {}
    for name, t in named:
        kind = "dense"
        if t.layout != torch.strided:
            kind = "sparse"
        elif t.is_quantized:
            kind = "quantized"
        elif t.device.type == "meta":
            kind = "meta"
        _check_dtype(name, _torch_dtype_name(t), kind)
        if t.device.type != "cpu":
            t = t.cpu()
        ptr = t.untyped_storage().data_ptr() if t.numel() else id(t)
        groups.setdefault((ptr, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype), []).append(name)
    for names in groups.values():
        stored = (tied or TiedNames()).choose(names)
        for n in names:
            if n != stored:
                report.aliases[n] = stored
    report._views_meta = {}  # type: ignore[attr-defined]
    items = []
    for name, t in named:
        if name in report.aliases:
            continue
        items.append(_Item(name, _torch_dtype_name(t), tuple(t.shape), t.numel() * t.element_size(), tensor=t))
    return items


# --------------------------------------------------------------------------- header


def _sorted_items(items: Sequence[_Item]) -> list[_Item]:
    return sorted(items, key=lambda it: (-_ST_RANK[it.st_dtype], it.name))


def safetensors_header(items: Sequence[Any], metadata: Mapping[str, str] | None) -> bytes:
    """The 8-byte length + JSON header ``save_file`` writes, for items in file order with ``begin`` set."""
    parts = []
    if metadata:
        meta = ",".join(f"{_js(k)}:{_js(v)}" for k, v in metadata.items())
        parts.append(f'"__metadata__":{{{meta}}}')
    for it in items:
        shape = ",".join(str(int(s)) for s in it.shape)
        parts.append(
            f'{_js(it.name)}:{{"dtype":"{it.st_dtype}","shape":[{shape}],'
            f'"data_offsets":[{it.begin},{it.begin + it.nbytes}]}}'
        )
    text = ("{" + ",".join(parts) + "}").encode("utf-8")
    text += b" " * ((-len(text)) % 8)
    return len(text).to_bytes(8, "little") + text


def _js(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)


def _layout(items: Sequence[_Item]) -> list[_Item]:
    ordered = _sorted_items(items)
    pos = 0
    for it in ordered:
        it.begin = pos
        pos += it.nbytes
    return ordered


# --------------------------------------------------------------------------- extras


def _is_optimizer_key(k: Any) -> bool:
    return isinstance(k, str) and ("optim" in k.lower() or k.lower() in _OPTIMIZER_KEYS)


_OMIT = object()


class _Extras:
    """Turns the non-tensor part of a checkpoint into JSON, noting what it cannot represent."""

    def __init__(self, sd_node: Any, report: ConvertReport) -> None:
        self.sd_node = sd_node
        self.report = report
        self.opt_tensors: list[tuple[str, Any]] = []
        self._seen: set[int] = set()

    def value(self, v: Any, path: str, opt: bool = False, depth: int = 0) -> Any:
        if v is self.sd_node:
            return _OMIT
        if v is None or isinstance(v, (bool, int, str)):
            return v
        if isinstance(v, float):
            if math.isfinite(v):
                return v
            return {"__float__": repr(v)}
        if is_tensor_like(v):
            if opt:
                name = "optimizer." + path
                self.opt_tensors.append((name, v))
                return {"__tensor__": name}
            self._skip(path, "a tensor outside the state dict")
            return _OMIT
        if depth > 32 or id(v) in self._seen:
            self._skip(path, "nested too deep or recursive")
            return _OMIT
        if isinstance(v, (Stub, type, slice, range, frozenset)) or callable(v):
            # placeholders of instances *and* of classes (numpy arrays, {"dtype": int}, omegaconf, Namespace ...)
            return self._plain(v, path, opt, depth)
        self._seen.add(id(v))
        try:
            if isinstance(v, Mapping) or (hasattr(v, "items") and hasattr(v, "keys") and not isinstance(v, type)):
                out = {}
                for k, x in list(v.items()):
                    if not isinstance(k, (str, int, float, bool)) and k is not None:
                        self._skip(f"{path}.{k!r}" if path else repr(k), f"a {type(k).__name__} key")
                        continue
                    sub = f"{path}.{k}" if path else str(k)
                    r = self.value(x, sub, opt, depth + 1)
                    if r is not _OMIT:
                        out[str(k)] = r
                return out
            if isinstance(v, (list, tuple, set, frozenset)):
                seq = list(v)
                if isinstance(v, (set, frozenset)):
                    try:
                        seq = sorted(seq)
                    except TypeError:
                        pass
                res = []
                for i, x in enumerate(seq):
                    r = self.value(x, f"{path}.{i}" if path else str(i), opt, depth + 1)
                    res.append(None if r is _OMIT else r)
                return res
        finally:
            self._seen.discard(id(v))
        self._skip(path, f"a {type(v).__name__} (not representable as JSON)")
        return _OMIT

    def _plain(self, v: Any, path: str, opt: bool, depth: int) -> Any:
        """A placeholder (or class, function, frozenset ...) as the plain data ``sanitize`` would write, as JSON."""
        from ckptfix.sanitize import _LOSSY, Plainer, normalise_global

        pl = Plainer(arrays="list", sep=".")
        plain = pl.convert(v, path)
        if isinstance(v, type) and issubclass(v, Stub):
            self.report.placeholders[path] = "class " + normalise_global(global_name(v))
        elif isinstance(v, Stub):
            self.report.placeholders[path] = normalise_global(global_name(type(v)))
        for c in pl.changes:
            self.report.converted[c.path] = f"{c.was} -> {c.now}"
        for p, why in pl.lossy.items():
            self._skip(p, why)
        if plain is _LOSSY:
            return _OMIT
        return self.value(_strip_lossy(plain), path, opt, depth + 1)

    def _skip(self, path: str, why: str) -> None:
        if len(self.report.skipped) < 200:
            self.report.skipped[path] = why


def _kind_of(v: Any) -> str:
    from ckptfix.sanitize import normalise_global

    if isinstance(v, type):
        return "class " + (normalise_global(global_name(v)) if issubclass(v, Stub) else v.__qualname__)
    return normalise_global(global_name(type(v))) if isinstance(v, Stub) else type(v).__name__


def _strip_lossy(v: Any) -> Any:
    """``v`` without the markers of values too large for JSON (already listed in ``skipped``)."""
    from ckptfix.sanitize import _LOSSY

    if isinstance(v, dict):
        return {k: _strip_lossy(x) for k, x in v.items() if x is not _LOSSY}
    if isinstance(v, list):
        return [None if x is _LOSSY else _strip_lossy(x) for x in v]
    return v


def _split_checkpoint(
    obj: Any,
    key_path: tuple[str, ...],
    sd: Mapping[str, Any],
    include_optimizer: bool,
    report: ConvertReport,
    node: Any = None,
) -> tuple[dict[str, Any], list[tuple[str, Any]]]:
    """(extra JSON object, optimizer tensors) for everything outside the state dict (``node``: what holds it)."""
    ex = _Extras(sd if node is None else node, report)
    extra: dict[str, Any] = {}
    if not key_path and _module_state(obj) is not None and not isinstance(obj, dict):
        return extra, []  # a whole pickled module: its state dict is all there is to keep
    if not key_path:
        for k, v in sd.items():  # a state dict with some non-tensor values mixed in
            if not is_tensor_like(v):
                r = ex.value(v, str(k))
                if r is not _OMIT:
                    extra[str(k)] = r
        return extra, []
    if not (isinstance(obj, Mapping) or hasattr(obj, "items")) or isinstance(obj, type):
        return extra, []
    for k, v in sd.items():  # non-tensor values inside a nested state dict: no place in the file
        if not is_tensor_like(v):
            ex._skip(".".join((*key_path, str(k))), f"a non-tensor value inside the state dict ({_kind_of(v)})")
    for k, v in list(obj.items()):
        if _is_optimizer_key(k) and k != key_path[0]:
            if not include_optimizer:
                report.excluded.append(str(k))
                continue
            r = ex.value(v, str(k), opt=True)
        else:
            r = ex.value(v, str(k))
        if r is not _OMIT:
            extra[str(k)] = r
    return extra, ex.opt_tensors


# --------------------------------------------------------------------------- paths and atomic files


def _default_output(src: str, suffix: str) -> str:
    s = os.path.abspath(src).rstrip(os.sep)
    base = os.path.basename(s)
    if base.endswith(".index.json"):
        base = base[: -len(".index.json")]
    stem, ext = os.path.splitext(base)
    if ext.lower() in _PTH_SUFFIXES + (".safetensors",):
        base = stem
    return os.path.join(os.path.dirname(s), base + suffix)


def _default_st_output(src: str) -> str:
    """``model.safetensors`` for a Hugging Face ``pytorch_model*.bin`` (or its index / folder).

    Anything else: ``<stem>.safetensors`` next to the input.
    """
    s = os.path.abspath(src).rstrip(os.sep)
    if os.path.isdir(s):
        if os.path.isfile(os.path.join(s, "pytorch_model.bin.index.json")):
            return os.path.join(s, "model.safetensors")
        return _default_output(src, ".safetensors")
    base = os.path.basename(s)
    if re.fullmatch(r"pytorch_model(-\d+-of-\d+)?\.bin(\.index\.json)?", base):
        return os.path.join(os.path.dirname(s), "model.safetensors")
    return _default_output(src, ".safetensors")


def _shard_names(dst: str, n: int) -> list[str]:
    d, base = os.path.split(dst)
    stem = base[: -len(".safetensors")] if base.endswith(".safetensors") else os.path.splitext(base)[0]
    return [os.path.join(d, f"{stem}-{i:05d}-of-{n:05d}.safetensors") for i in range(1, n + 1)]


def _check_outputs(paths: Sequence[str], src: str, force: bool) -> None:
    for p in paths:
        if same_file(p, src):
            raise OutputError(f"{p}: that is the input; choose another output with -o")
        if os.path.isdir(p):
            raise OutputError(f"{p}: is a directory; pass a file name with -o")
        if p.endswith(("/", os.sep)):
            raise OutputError(f"{p}: names a directory (it ends with a slash); pass a file name with -o")
        if os.path.lexists(p) and not force:
            raise OutputError(f"{p} already exists; pass --force to overwrite it, or choose another name with -o")
        d = os.path.dirname(os.path.abspath(p))
        if not os.path.isdir(d):
            raise OutputError(f"{d}: the output directory does not exist; create it first")
        if not os.access(d, os.W_OK):
            raise OutputError(f"{d}: no permission to write there; choose another output with -o")


def _new_temp(final: str) -> str:
    fd, tmp = new_temp(final)
    os.close(fd)
    return tmp


# --------------------------------------------------------------------------- write + verify


class _Writer:
    """Writes safetensors files; with ``verify`` every chunk is read back from the file and compared.

    Verification happens right after each chunk is written, while its source bytes are still in
    our buffer: the written pages are mapped (no copy) and ``memcmp``-ed against it.  Together with
    the structural check in :meth:`check` (header read back, offsets tiling the data section
    exactly, file size), that proves every byte of the file equals the source, at the cost of one
    extra pass over memory instead of re-reading both files.
    """

    def __init__(self, total: int, progress: Progress | None, verify: bool) -> None:
        from ckptfix.parallel import Tally

        self.tally = Tally(progress, total)
        self.verify = verify
        self.fds = _Fds()
        self._local = threading.local()  # one copy buffer per thread

    def tick(self, n: int) -> None:
        self.tally.add(n)

    def write(
        self, path: str, items: list[_Item], metadata: Mapping[str, str] | None, fsync: bool, jobs: int = 1
    ) -> None:
        """Write one safetensors file, its tensors in up to ``jobs`` threads (each at its own offset)."""
        from ckptfix.parallel import run_tasks

        header = safetensors_header(items, metadata)
        # no O_TRUNC: the temp file is new and empty, and truncating makes ext4 flush it on close (auto_da_alloc)
        fd = os.open(path, os.O_RDWR)
        try:
            pwrite_all(fd, header, 0)
            base = len(header)
            run_tasks([functools.partial(self._item, it, fd, base, path) for it in items], jobs)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

    def _item(self, it: _Item, fd: int, base: int, path: str) -> None:
        pos = base + it.begin
        if it.path is not None:
            self._copy(it, fd, pos, path)
            return
        for chunk in it.chunks(self.fds):
            n = pwrite_all(fd, chunk, pos)
            if self.verify and not _written_equal(fd, pos, chunk, n):
                raise _differs(path, it, pos - base - it.begin)
            pos += n
            self.tick(n)
        if pos != base + it.begin + it.nbytes:
            raise CorruptCheckpointError(f"tensor {it.name!r}: got {pos - base - it.begin} bytes, expected {it.nbytes}")

    def _copy(self, it: _Item, fd: int, pos: int, path: str) -> None:
        """A contiguous byte range of a source file -> the output ``path`` (open as ``fd``) at ``pos``."""
        src = self.fds.get(it.path)  # type: ignore[arg-type]
        if not self.verify:
            copy_range(src, it.offset, fd, pos, it.nbytes)
            self.tick(it.nbytes)
            return
        buf = getattr(self._local, "buf", None)
        if buf is None:
            buf = self._local.buf = bytearray(_CHUNK)
        view = memoryview(buf)
        off, left, start = it.offset, it.nbytes, pos
        while left > 0:
            n = min(left, len(buf))
            if os.preadv(src, [view[:n]], off) != n:
                raise CorruptCheckpointError(f"{it.path}: file ended inside tensor {it.name!r} (truncated?)")
            pwrite_all(fd, view[:n], pos)
            if not _written_equal(fd, pos, buf, n):
                raise _differs(path, it, pos - start)
            off += n
            pos += n
            left -= n
            self.tick(n)

    def check(self, path: str, items: list[_Item], metadata: Mapping[str, str] | None) -> None:
        """Re-read the written file's header: dtype, shape and offsets of every tensor, metadata, size."""
        try:
            header, start = read_header(path, max_bytes=MAX_HEADER)
        except CkptfixError as e:
            raise VerificationError(f"{path}: the written file does not read back: {e}") from None
        meta = header.pop("__metadata__", None)
        if (meta or None) != (dict(metadata) if metadata else None):
            raise VerificationError(f"{path}: metadata read back differs from what was written")
        if set(header) != {it.name for it in items}:
            raise VerificationError(f"{path}: the written file holds other tensors than the source")
        end = 0
        for it in sorted(items, key=lambda i: i.begin):  # the byte ranges tile the data section exactly
            h = header[it.name]
            if (
                h.get("dtype") != it.st_dtype
                or list(h.get("shape", ())) != list(it.shape)
                or list(h.get("data_offsets", ())) != [it.begin, it.begin + it.nbytes]
                or it.begin != end
            ):
                raise VerificationError(
                    f"{path}: tensor {it.name!r} reads back as {h}, expected dtype "
                    f"{it.st_dtype} shape {list(it.shape)} at [{end}, {end + it.nbytes}]"
                )
            end += it.nbytes
        if os.path.getsize(path) != start + end:
            raise VerificationError(f"{path}: file size {os.path.getsize(path)} != expected {start + end}")


def _differs(path: str, it: _Item, at: int) -> VerificationError:
    return VerificationError(
        f"{path}: tensor {it.name!r} differs from the source near byte {at} of the tensor "
        "when read back; the output was removed"
    )


def _written_equal(fd: int, pos: int, data: bytes | bytearray | memoryview, n: int) -> bool:
    """Do the ``n`` bytes of the file ``fd`` at ``pos`` equal the first ``n`` bytes of ``data``?

    The file's pages are mapped, not copied, and compared with ``memcmp`` (``bytes.startswith``).
    """
    import mmap

    if not isinstance(data, (bytes, bytearray)):
        data = bytes(data)
    if n == 0:
        return True
    gran = mmap.ALLOCATIONGRANULARITY
    base = pos - pos % gran
    try:
        m = mmap.mmap(
            fd,
            n + (pos - base),
            flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
            prot=mmap.PROT_READ,
            offset=base,
        )
    except (ValueError, OSError):
        return False
    try:
        with memoryview(m) as v, v[pos - base : pos - base + n] as w:
            return len(w) == n and data.startswith(w)
    finally:
        m.close()


@contextlib.contextmanager
def _named_as(tmp: str, final: str) -> Iterator[None]:
    """Verification errors name the output the user asked for, not the temp file (which is removed)."""
    try:
        yield
    except VerificationError as e:
        raise VerificationError(str(e).replace(tmp, final)) from None


def _shard(items: list[_Item], max_size: int | None) -> list[list[_Item]]:
    """Split in state-dict order, as huggingface_hub does: a tensor larger than the limit gets its own shard."""
    if not max_size:
        return [items]
    shards: list[list[_Item]] = [[]]
    size = 0
    for it in items:
        if shards[-1] and size + it.nbytes > max_size:
            shards.append([])
            size = 0
        shards[-1].append(it)
        size += it.nbytes
    return shards


def _write_outputs(
    dst: str,
    items: list[_Item],
    metadata: dict[str, str],
    *,
    max_shard_size: int | None,
    verify: bool,
    fsync: bool,
    force: bool,
    src: str,
    progress: Progress | None,
    report: ConvertReport,
    jobs: int = 1,
) -> None:
    shards = _shard(items, max_shard_size)
    if len(shards) == 1:
        finals = [dst]
        index_path = None
    else:
        finals = _shard_names(dst, len(shards))
        index_path = dst + ".index.json" if dst.endswith(".safetensors") else dst + ".safetensors.index.json"
    _check_outputs(finals + ([index_path] if index_path else []), src, force)
    total = sum(it.nbytes for it in items)
    w = _Writer(total, progress, verify)
    temps: list[str] = []
    try:
        laid = []
        for final, shard in zip(finals, shards, strict=False):
            tmp = _new_temp(final)
            temps.append(tmp)
            ordered = _layout(shard)
            laid.append(ordered)
            with _named_as(tmp, final):
                w.write(tmp, ordered, metadata, fsync, jobs)
        if verify:
            for tmp, final, ordered in zip(temps, finals, laid, strict=False):
                with _named_as(tmp, final):
                    w.check(tmp, ordered, metadata)
            report.verified = True
        idx_tmp = None
        if index_path:
            weight_map = {}
            for final, shard in zip(finals, shards, strict=False):
                for it in shard:
                    weight_map[it.name] = os.path.basename(final)
            doc = {"metadata": {"total_size": total, **metadata}, "weight_map": weight_map}
            idx_tmp = _new_temp(index_path)
            temps.append(idx_tmp)
            with open(idx_tmp, "w", encoding="utf-8") as f:
                json.dump(doc, f, indent=2)
                f.write("\n")
                if fsync:
                    f.flush()
                    os.fsync(f.fileno())
        for tmp, final in zip(temps, finals + ([index_path] if index_path else []), strict=False):
            try:
                os.replace(tmp, final)
            except OSError as e:
                from ckptfix.atomic import _os_error

                raise _os_error(e, final) from None
        temps.clear()
        if fsync:
            fsync_dir(dst)
    finally:
        w.fds.close()
        for tmp in temps:
            try:
                os.unlink(tmp)
            except OSError:
                pass
    report.outputs = finals
    report.index = index_path
    report.bytes = total
    report.tensors = len(items)


# --------------------------------------------------------------------------- state dict acquisition


def _load_with_torch(src: str, key: str | None, allow_globals: Sequence[str], trust: bool) -> tuple[Any, tuple, Any]:
    """(state dict of torch tensors, key path, whole checkpoint object) through the lead's loader."""
    try:
        from ckptfix.loading import load_checkpoint
    except ImportError:  # pragma: no cover - until ckptfix.loading lands
        load_checkpoint = None
    if load_checkpoint is not None:
        lc = load_checkpoint(src, "cpu", key=key, allow_globals=tuple(allow_globals), trust=trust)
        return lc.state_dict, tuple(getattr(lc, "key_path", ()) or ()), getattr(lc, "checkpoint", None)
    if os.path.isdir(src) and os.path.isfile(os.path.join(src, ".metadata")):  # pragma: no cover
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

        sd: dict = {}
        _load_state_dict(sd, storage_reader=FileSystemReader(src), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
        from ckptfix.formats import find_state_dict

        kp, node = find_state_dict(sd, key)
        return node, kp, sd
    raise UnsupportedError(f"{src}: this input needs torch-level loading (ckptfix.loading is not available)")


def contains_tensors(obj: Any, depth: int = 200) -> bool:
    """Is there a tensor (record or torch tensor) anywhere in ``obj``, placeholder state included?

    Args:
        obj: any object graph from the restricted reader or torch.
        depth: how deep to look.

    Returns:
        True at the first tensor found.
    """
    seen: set[int] = set()
    todo: list[tuple[Any, int]] = [(obj, 0)]
    while todo:
        v, d = todo.pop()
        if is_tensor_like(v):
            return True
        if d > depth or id(v) in seen or isinstance(v, (str, bytes, int, float, type)) or v is None:
            continue
        seen.add(id(v))
        if isinstance(v, Stub):
            todo += [
                (v._state, d + 1),
                (list(v._args), d + 1),
                (list(v._listitems), d + 1),
                (list(v._dictitems.values()), d + 1),
            ]
        elif isinstance(v, Mapping):
            todo += [(x, d + 1) for x in v.values()]
        elif isinstance(v, (list, tuple, set, frozenset)):
            todo += [(x, d + 1) for x in v]
        elif hasattr(v, "__dict__"):
            todo.append((vars(v), d + 1))
    return False


def _module_state(obj: Any) -> dict | None:
    """The ``__dict__`` of a pickled ``nn.Module`` (a placeholder, a plain dict after sanitize, or a real module)."""
    if isinstance(obj, Stub):
        st = obj._state
    elif isinstance(obj, dict):
        st = obj
    elif hasattr(obj, "_parameters") and hasattr(obj, "_modules"):
        st = vars(obj)
    else:
        return None
    return st if isinstance(st, dict) and "_parameters" in st and "_modules" in st else None


def module_state_dict(obj: Any, prefix: str = "", out: dict | None = None, depth: int = 0) -> dict | None:
    """What ``module.state_dict()`` returns, for a whole pickled ``nn.Module`` (``torch.save(model)``), without torch.

    Args:
        obj: the module: a placeholder, a plain dict (after ``sanitize``) or a real ``nn.Module``.
        prefix, out, depth: used by the recursion.

    Returns:
        name -> tensor: parameters, then persistent buffers, then each submodule's, recursively, as
        torch orders them; None when ``obj`` is not a module.
    """
    import collections

    st = _module_state(obj)
    if st is None or depth > 100:
        return None
    out = collections.OrderedDict() if out is None else out
    for name, p in (st.get("_parameters") or {}).items():
        if p is not None and is_tensor_like(p):
            out[prefix + str(name)] = p
    skip = st.get("_non_persistent_buffers_set") or set()
    for name, b in (st.get("_buffers") or {}).items():
        if b is not None and is_tensor_like(b) and name not in skip:
            out[prefix + str(name)] = b
    for name, m in (st.get("_modules") or {}).items():
        if m is not None:
            module_state_dict(m, f"{prefix}{name}.", out, depth + 1)
    return out


def locate_state_dict(obj: Any, key: str | None = None) -> tuple[tuple[str, ...], Mapping[str, Any], str]:
    """Find the tensors of any checkpoint object and name them.

    Args:
        obj: the unpickled checkpoint (records and placeholders, or torch objects).
        key: where the state dict sits (``"model"``, ``"model/state_dict"``); found automatically otherwise.

    Returns:
        ``(key path, state dict, kind)``.  ``kind`` ``"mapping"``: a state dict (as
        :func:`ckptfix.formats.find_state_dict` finds it); ``"module"``: a whole pickled ``nn.Module``
        (at the top or under a top-level key), its ``state_dict()`` computed from the placeholders;
        ``"sequence"``: a top-level list/tuple holding tensors (nested lists, tuples and dicts too),
        each named by its path: ``"0"``, ``"1.2"`` ...

    Raises:
        KeyConflictError: ``key`` does not exist.  CorruptCheckpointError: no tensors found.
    """
    from ckptfix.formats import find_state_dict

    if key is None:
        if _module_state(obj) is not None and not isinstance(obj, dict):
            sd = module_state_dict(obj)
            if sd:
                return (), sd, "module"
        if isinstance(obj, Mapping) and not is_tensor_like(obj):
            for k, v in obj.items():
                if isinstance(k, str) and not isinstance(v, dict) and _module_state(v) is not None:
                    sd = module_state_dict(v)
                    if sd:
                        return (k,), sd, "module"
    try:
        kp, sd = find_state_dict(obj, key)
    except CorruptCheckpointError:
        if key is not None:
            raise
        mixed = _mixed_state_dict(obj)
        if mixed is not None:
            return mixed[0], mixed[1], "mapping"
        flat = _flatten_containers(obj) if isinstance(obj, (list, tuple)) else {}
        if not flat:
            raise
        return (), flat, "sequence"
    return tuple(kp), sd, "mapping"


def _mixed_state_dict(obj: Any) -> tuple[tuple[str, ...], Mapping[str, Any]] | None:
    """A nested state dict that also holds non-tensor values (``{"w": tensor, "kind": int}``, ``_extra_state``).

    Preferred names (``state_dict``, ``model`` ...) first, else the mapping with the most tensors, three levels
    down at most.  None when no mapping holds a tensor directly.
    """
    from ckptfix.formats import STATE_DICT_KEYS

    best: tuple[int, int, tuple[str, ...], Any] | None = None
    todo: list[tuple[tuple[str, ...], Any]] = [((), obj)]
    while todo:
        path, node = todo.pop(0)
        if not isinstance(node, Mapping) or len(path) > 3:
            continue
        n = sum(1 for v in node.values() if is_tensor_like(v))
        if n and path:
            rank = (1 if path[-1] in STATE_DICT_KEYS else 0, n)
            if best is None or rank > best[:2]:
                best = (rank[0], rank[1], path, node)
        todo += [(path + (k,), v) for k, v in node.items() if isinstance(k, str) and isinstance(v, Mapping)]
    return (best[2], best[3]) if best else None


def _flatten_containers(obj: Any, prefix: str = "", out: dict | None = None, depth: int = 0) -> dict[str, Any]:
    """{"0.1": tensor, ...}: every tensor in nested lists, tuples and dicts, named by its path."""
    out = {} if out is None else out
    if depth > 32:
        return out
    if is_tensor_like(obj):
        out[prefix.rstrip(".")] = obj
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _flatten_containers(v, f"{prefix}{i}.", out, depth + 1)
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            if isinstance(k, (str, int)):
                _flatten_containers(v, f"{prefix}{k}.", out, depth + 1)
    return out


def _require_tensors(cf: Any, src: str, what: str) -> None:
    """NoTensorsError when a valid checkpoint holds no tensors anywhere (training_args.bin, scheduler.pt)."""
    if not contains_tensors(cf.obj) and not cf.extra.get("torchscript_state_dict"):
        raise NoTensorsError(
            f"{src}: a valid {cf.format} file with no tensors in it (arguments, scheduler or "
            f"other state), so there is nothing to {what}; `ckptfix inspect` summarises it and "
            "`ckptfix sanitize` makes it load with weights_only=True"
        )


def _flatten_state_dict(sd: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for k, v in sd.items():
        name = f"{prefix}{k}"
        if is_tensor_like(v):
            out.append((name, v))
        elif isinstance(v, Mapping) and prefix == "" and any(is_tensor_like(x) for x in v.values()):
            out.extend(_flatten_state_dict(v, name + "."))  # DCP nested state dicts
    return out


# --------------------------------------------------------------------------- public API


def output_names(
    named: Sequence[tuple[str, Any]],
    opt_named: Sequence[tuple[str, Any]],
    strip_prefix: bool | str,
    report: ConvertReport,
) -> tuple[list[tuple[str, Any]], list[str]]:
    """The tensors to write under their final names: the state dict's (prefixes stripped) then the optimizer's.

    Args:
        named: ``(name, tensor)`` of the state dict, in its order.
        opt_named: ``(optimizer.<path>, tensor)`` pairs (empty without ``--include-optimizer``).
        strip_prefix: strip wrapper prefixes (``True``) or exactly this prefix (a string).
        report: gets ``renamed`` and ``optimizer_tensors``.

    Returns:
        All pairs to write, and the state dict's names in order.

    Raises:
        KeyConflictError: a tensor named ``__metadata__``, or an optimizer tensor colliding with a state-dict key.
    """
    named = list(named)
    if strip_prefix:
        from ckptfix.prefixes import strip_prefix as _strip

        mapping = dict(named)
        new = _strip(mapping, None if strip_prefix is True else str(strip_prefix))
        report.renamed = sum(1 for a, b in zip(mapping, new, strict=False) if a != b)
        named = list(new.items())
    order = [n for n, _ in named]
    taken = set(order)
    if "__metadata__" in taken:
        raise KeyConflictError(
            "the state dict has a tensor named '__metadata__', which safetensors reserves for "
            "its metadata; rename it before converting"
        )
    for n, _ in opt_named:
        if n in taken:
            raise KeyConflictError(
                f"optimizer tensor {n!r} collides with a state-dict key; convert without --include-optimizer"
            )
    report.optimizer_tensors = len(opt_named)
    return named + list(opt_named), order


def convert_to_safetensors(
    src: str | os.PathLike,
    dst: str | os.PathLike | None = None,
    *,
    key: str | None = None,
    strip_prefix: bool | str | None = False,
    max_shard_size: int | str | None = None,
    include_optimizer: bool = False,
    verify: bool = True,
    force: bool = False,
    fsync: bool = False,
    allow_globals: Sequence[str] = (),
    trust: bool = False,
    progress: Progress | None = None,
    ckptfix_metadata: bool = True,
    keep: Sequence[str] = (),
    allow_expand: bool = False,
    jobs: int = 1,
) -> ConvertReport:
    """Write ``src``'s state dict as safetensors at ``dst`` (default: ``src`` with a ``.safetensors`` suffix).

    Args:
        key: where the state dict is (``"model"``, ``"model/state_dict"``); found automatically otherwise.
        strip_prefix: ``True`` strips wrapper prefixes (``module.``, ``_orig_mod.`` ...); a string strips that one.
        max_shard_size: ``"5GB"`` (decimal) or bytes: write ``stem-0000k-of-0000N.safetensors`` + an index.
        include_optimizer: also write optimizer tensors as ``optimizer.<dotted path>`` (excluded by default).
        verify: re-read every written tensor and compare dtype, shape and bytes with the source.
        force: overwrite existing outputs.  fsync: fsync files and directory before returning.
        allow_globals, trust: the loading policy, for inputs that need torch (DCP).
        progress: ``progress(done_bytes, total_bytes)`` while writing and verifying.
        ckptfix_metadata: ``False`` writes only ``{"format": "pt"}`` (aliases are then not restorable).
        keep: of tied tensors (one tensor under several names), store these names; the others become
            aliases.  By default the transformers class named by a ``config.json`` beside ``src`` decides
            (its ``_tied_weights_keys`` are the names it drops), else the state dict's own order: the
            first name is kept, as ``save_pretrained`` does.
        allow_expand: write outputs larger than 4x the input + 64 MiB (expanded, stride-0 views written
            densely); refused otherwise.
        jobs: write (and verify) tensors in this many threads (``0``: one per CPU); the output is the
            same bytes whatever the number.  Memory: ``jobs`` x the 8 MiB copy buffer (x4 for DCP chunks).

    The default output of a Hugging Face ``pytorch_model.bin`` (or its sharded index) is
    ``model.safetensors`` in the same folder (``model-0000k-of-0000N.safetensors`` and
    ``model.safetensors.index.json`` when sharded), where ``from_pretrained`` looks.

    Returns:
        A :class:`ConvertReport`.

    Raises:
        OutputError: the output exists (without ``force``), is the input, or cannot be written.
        UnsupportedError: a tensor whose dtype/kind safetensors cannot hold (named in the message).
        VerificationError: the written file does not read back identical; nothing is left behind.
        ResourceLimitError: the output would be over 4x the input + 64 MiB (without ``allow_expand``).
    """
    t0 = time.perf_counter()
    src = os.fspath(src)
    dst = os.fspath(dst) if dst is not None else _default_st_output(src)
    shard_limit = parse_size(max_shard_size) if max_shard_size else None
    report = ConvertReport(source=src, outputs=[dst])
    if not max_shard_size:
        _check_outputs([dst], src, force)  # fail before any reading

    from ckptfix.formats import read_checkpoint, sniff

    if sniff(src) == "dcp":  # streamed from the chunks, torch-free: ckptfix.dcp.consolidate
        from ckptfix.dcp.consolidate import convert_dcp

        return convert_dcp(
            src,
            dst,
            key=key,
            strip_prefix=strip_prefix,
            max_shard_size=shard_limit,
            include_optimizer=include_optimizer,
            verify=verify,
            force=force,
            fsync=fsync,
            progress=progress,
            ckptfix_metadata=ckptfix_metadata,
            jobs=jobs,
        )
    cf = read_checkpoint(src)
    report.source_format = cf.format
    report.stubbed_globals = sorted(g for g in cf.stubbed if not g.endswith("Storage"))
    obj = cf.obj
    if cf.format == "torchscript" and cf.extra.get("torchscript_state_dict") and key is None:
        key_path: tuple[str, ...] = ()
        sd: Mapping[str, Any] = cf.extra["torchscript_state_dict"]
        obj = sd
    else:
        if key is None and cf.format != "dcp":
            _require_tensors(cf, src, "convert")
        key_path, sd, _ = locate_state_dict(cf.obj, key)
    report.key_path = tuple(key_path)
    named = [(str(k), v) for k, v in sd.items() if is_tensor_like(v)]
    use_torch = cf.format == "dcp" or any(
        isinstance(v, TensorRecord)
        and v.kind == "dense"
        and v.dtype in DTYPE_TO_ST
        and (v.storage is None or v.storage.file_offset is None)
        for _, v in named
    )
    if use_torch:
        tsd, kp, tobj = _load_with_torch(src, key, allow_globals, trust)
        report.used_torch = True
        report.key_path = key_path = tuple(kp)
        sd = tsd
        obj = tobj if tobj is not None else tsd
        named = _flatten_state_dict(tsd)
    extra, opt_named = _split_checkpoint(
        obj, key_path, sd, include_optimizer, report, node=_at(obj, key_path) if key_path and not use_torch else None
    )

    named, order = output_names(named, opt_named, strip_prefix, report)
    taken = set(order)
    if not named:
        raise NoTensorsError(
            f"{src}: the state dict holds no tensors, so there is nothing to convert; "
            "`ckptfix inspect` shows what the file holds"
        )

    missing = [k for k in keep if k not in taken]
    if missing:
        raise KeyConflictError(
            f"--keep {missing[0]!r}: no tensor of that name in the state dict"
            + (" (after --strip-prefix)" if strip_prefix else "")
            + "; pass a name that "
            "`ckptfix inspect` lists"
        )
    tied = TiedNames(keep)
    if _has_tied_groups(named):
        hf = hf_tied_weights(src)
        if hf is not None:
            tied = TiedNames(keep, hf[0], hf[1])
    if use_torch:
        items = _plan_tensors(named, report, tied)
    else:
        items = _plan_records(named, report, tied)
        check_expansion(items, cf.file_size, allow_expand)
    if report.aliases:
        report.tied_rule = "--keep" if tied.used_keep else tied.source
    metadata: dict[str, str] = {"format": "pt"}
    if ckptfix_metadata:
        metadata["ckptfix.source_format"] = cf.format
        metadata["ckptfix.key_path"] = json.dumps(list(key_path))
        metadata["ckptfix.order"] = json.dumps([n for n, _ in named], ensure_ascii=False)
        if report.aliases:
            metadata["ckptfix.aliases"] = json.dumps(report.aliases, ensure_ascii=False)
        views = getattr(report, "_views_meta", {})
        if views:
            metadata["ckptfix.views"] = json.dumps(views, ensure_ascii=False)
        if extra:
            text = json.dumps(extra, ensure_ascii=False)
            if len(text) <= _MAX_EXTRA_JSON:
                metadata["ckptfix.extra"] = text
            else:
                report.skipped["<extra>"] = f"non-tensor entries are {len(text)} bytes of JSON; too large to keep"
    _write_outputs(
        dst,
        items,
        metadata,
        max_shard_size=shard_limit,
        verify=verify,
        fsync=fsync,
        force=force,
        src=src,
        progress=progress,
        report=report,
        jobs=jobs,
    )
    report.__dict__.pop("_views_meta", None)
    report.seconds = time.perf_counter() - t0
    return report


def restore_aliases(state_dict: Mapping[str, Any], metadata: Mapping[str, str] | None) -> dict[str, Any]:
    """Re-create the tensors a ckptfix-written safetensors file stored once.

    ``ckptfix.aliases`` entries become the same tensor object as their stored
    name; ``ckptfix.views`` entries become ``as_strided`` views of their base;
    keys follow ``ckptfix.order`` when recorded.  Files written by Hugging
    Face's ``convert.py`` (``{"removed_name": "kept_name"}`` in the metadata)
    are understood too.  Returns a new dict; the input is not modified.
    """
    meta = dict(metadata or {})
    out: dict[str, Any] = dict(state_dict)
    if "ckptfix.aliases" in meta:
        aliases = _json_obj(meta["ckptfix.aliases"])
    else:  # Hugging Face convert.py style
        aliases = {
            k: v
            for k, v in meta.items()
            if k != "format" and not k.startswith("ckptfix.") and k not in out and v in out
        }
    views = _json_obj(meta.get("ckptfix.views", "{}"))
    for name, spec in views.items():
        base = out.get(spec.get("base")) if isinstance(spec, dict) else None
        if base is None or not hasattr(base, "as_strided"):
            continue
        try:
            out[name] = base.as_strided(
                tuple(spec["shape"]), tuple(spec["stride"]), base.storage_offset() + int(spec["offset"])
            )
        except (RuntimeError, KeyError, TypeError, ValueError):
            continue
    for alias, stored in aliases.items():
        if stored in out:
            out[alias] = out[stored]
    order = meta.get("ckptfix.order")
    if order:
        names = _json_obj(order, list)
        if names:
            ordered = {n: out[n] for n in names if n in out}
            ordered.update((k, v) for k, v in out.items() if k not in ordered)
            out = ordered
    return out


def rebuild_checkpoint(
    state_dict: Mapping[str, Any], metadata: Mapping[str, str] | None
) -> tuple[Any, tuple[str, ...]]:
    """The checkpoint a ckptfix-written safetensors file came from, as far as its metadata holds it.

    The ``ckptfix.extra`` entries (epoch, step, hyper-parameters, ...) are put back around the state
    dict, which goes where ``ckptfix.key_path`` says it was; optimizer tensors written with
    ``include_optimizer`` go back into the optimizer state (with its integer parameter ids).  What
    could not be represented as JSON when converting (placeholders of classes become plain dicts,
    excluded optimizer state) is not there.  Returns ``(checkpoint, key_path)``.
    """
    meta = dict(metadata or {})
    sd = dict(state_dict)
    key_path = tuple(str(k) for k in _json_obj(meta.get("ckptfix.key_path", "[]"), list))
    extra = _json_obj(meta.get("ckptfix.extra", "{}"))

    def decode(v: Any, int_keys: bool = False) -> Any:
        if isinstance(v, dict):
            if len(v) == 1 and "__float__" in v:
                return float(v["__float__"])
            if len(v) == 1 and "__tensor__" in v:
                return sd.pop(str(v["__tensor__"]), None)
            return {
                (int(k) if int_keys and k.lstrip("-").isdigit() else k): decode(x, k == "state") for k, x in v.items()
            }
        if isinstance(v, list):
            return [decode(x) for x in v]
        return v

    opt = {k: decode(extra.pop(k)) for k in [k for k in extra if _is_optimizer_key(k)]}
    rest = {k: decode(v) for k, v in extra.items()}
    if not key_path:
        return {**sd, **rest, **opt}, ()
    obj: dict[str, Any] = dict(rest)
    node = obj
    for part in key_path[:-1]:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[key_path[-1]] = sd
    obj.update(opt)
    return obj, key_path


def _at(obj: Any, path: Sequence[str]) -> Any:
    for part in path:
        obj = obj[part]
    return obj


def _json_obj(text: str, kind: type = dict) -> Any:
    try:
        v = json.loads(text)
    except (ValueError, TypeError):
        return kind()
    return v if isinstance(v, kind) else kind()


def _read_safetensors_sd(src: str) -> tuple[dict[str, Any], dict[str, str], str]:
    """(state dict, metadata, format) of a .safetensors file or a sharded safetensors index, via safetensors."""
    from safetensors import safe_open

    from ckptfix.formats import sniff

    kind = sniff(src)
    if kind == "safetensors":
        files = [src]
    elif kind in ("sharded", "sharded-dir"):
        from ckptfix.formats.sharded import load_index

        files = list(load_index(src).shards.values())
        if not all(s.endswith(".safetensors") for s in files):
            raise UnsupportedError(f"{src}: the shards are not safetensors; convert the index to safetensors instead")
    else:
        raise UnsupportedError(f"{src}: not a safetensors file or index (it is {kind})")
    sd: dict[str, Any] = {}
    meta: dict[str, str] = {}
    for path in files:
        try:
            with safe_open(path, framework="pt") as f:
                meta.update(f.metadata() or {})
                for k in f.keys():
                    sd[k] = f.get_tensor(k)
        except FileNotFoundError:
            raise CheckpointNotFoundError(
                f"{src}: shard {os.path.basename(path)} is missing; download or copy every shard next to the index"
            ) from None
        except Exception as e:  # safetensors_rust.SafetensorError: a header the library refuses
            if type(e).__name__ != "SafetensorError":
                raise
            raise CorruptCheckpointError(
                f"{path}: not a valid safetensors file ({e}); the file is corrupt "
                "or truncated — re-download or re-save it"
            ) from None
    return sd, meta, kind


def convert_from_safetensors(
    src: str | os.PathLike,
    dst: str | os.PathLike | None = None,
    *,
    verify: bool = True,
    force: bool = False,
    fsync: bool = False,
    restore_wrapper: bool = False,
    progress: Progress | None = None,
) -> ConvertReport:
    """Write a ``.safetensors`` file (or sharded index) as one torch zip checkpoint, aliases restored.

    The output is the state dict; with ``restore_wrapper`` it is the checkpoint dict the file was
    converted from (see :func:`rebuild_checkpoint`), the state dict at its original key.
    """
    torch = require_torch("converting safetensors back to .pth")

    t0 = time.perf_counter()
    src = os.fspath(src)
    dst = os.fspath(dst) if dst is not None else _default_output(src, ".pth")
    report = ConvertReport(source=src, outputs=[dst], direction="to-torch")
    _check_outputs([dst], src, force)
    sd, meta, kind = _read_safetensors_sd(src)
    report.source_format = kind
    out = restore_aliases(sd, meta)
    report.aliases = {k: v for k, v in _json_obj(meta.get("ckptfix.aliases", "{}")).items() if k in out}
    report.views = {
        k: v.get("base") for k, v in _json_obj(meta.get("ckptfix.views", "{}")).items() if isinstance(v, dict)
    }
    report.tensors = len(out)
    total = sum(t.numel() * t.element_size() for t in sd.values())
    report.bytes = total
    to_save: Any = out
    if restore_wrapper:
        if "ckptfix.key_path" not in meta:
            raise UnsupportedError(
                f"{src}: no ckptfix.key_path metadata (not written by ckptfix convert), so "
                "there is no wrapper to restore; convert without --restore-wrapper"
            )
        to_save, kp = rebuild_checkpoint(out, meta)
        report.key_path = kp
        out = _at(to_save, kp)
        report.tensors = len(out)
    tmp = _new_temp(dst)
    try:
        try:
            torch.save(to_save, tmp)
        except OSError as e:
            raise OutputError(f"cannot write {dst}: {e}") from None
        if progress:
            progress(total, total * (2 if verify else 1))
        if fsync:
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        if verify:
            back = _at(
                torch.load(tmp, map_location="cpu", weights_only=True, mmap=True),
                report.key_path if restore_wrapper else (),
            )
            if list(back) != list(out):
                raise VerificationError(f"{dst}: the written checkpoint holds other keys than the source")
            for k, t in out.items():
                b = back[k]
                if (
                    b.dtype != t.dtype
                    or b.shape != t.shape
                    or not torch.equal(
                        b.contiguous().reshape(-1).view(torch.uint8), t.contiguous().reshape(-1).view(torch.uint8)
                    )
                ):
                    raise VerificationError(f"{dst}: tensor {k!r} differs from the source; the output was removed")
            for alias, stored in report.aliases.items():
                if back[alias].data_ptr() != back[stored].data_ptr():
                    raise VerificationError(f"{dst}: alias {alias!r} is not shared with {stored!r}")
            del back
            report.verified = True
            if progress:
                progress(total * 2, total * 2)
        os.replace(tmp, dst)
        tmp = ""
        if fsync:
            fsync_dir(dst)
    finally:
        if tmp:
            try:
                os.unlink(tmp)
            except OSError:
                pass
    report.seconds = time.perf_counter() - t0
    return report


def is_safetensors_input(src: str | os.PathLike) -> bool:
    """True for a ``.safetensors`` file or an index whose shards are safetensors."""
    from ckptfix.formats import sniff

    src = os.fspath(src)
    try:
        kind = sniff(src)
    except CkptfixError:
        return False
    if kind == "safetensors":
        return True
    if kind in ("sharded", "sharded-dir"):
        from ckptfix.formats.sharded import load_index

        try:
            return all(s.endswith(".safetensors") for s in load_index(src).shards)
        except (OSError, CkptfixError):
            return False
    return False


def convert(src: str | os.PathLike, dst: str | os.PathLike | None = None, **kw: Any) -> ConvertReport:
    """Pick the direction: safetensors in and a non-safetensors ``dst`` (or none) -> torch; else -> safetensors."""
    d = os.fspath(dst) if dst is not None else None
    to = kw.pop("to", None)  # "safetensors", "pt" or "dcp"; None: from the names
    if to == "dcp" or (to is None and d is not None and d.rstrip("/" + os.sep).endswith(".dcp")):
        from ckptfix.dcp.write import convert_to_dcp

        return convert_to_dcp(src, d, **kw)
    if kw.pop("shards", 1) != 1:
        raise UnsupportedError("--shards applies to DCP output (-o DIR.dcp or --to dcp)")
    if to == "pt" and not is_safetensors_input(src):
        raise UnsupportedError(f"--to pt: {src} is not a safetensors file; ckptfix writes .pth only from safetensors")
    if to == "pt" or (to is None and is_safetensors_input(src) and (d is None or not d.endswith(".safetensors"))):
        extra = set(kw) - {"verify", "force", "fsync", "progress", "restore_wrapper", "jobs"}
        used = [k for k in extra if kw.get(k) not in (None, False, (), "")]
        if used:
            raise UnsupportedError(f"options {sorted(used)} apply to conversion to safetensors, not back to torch")
        return convert_from_safetensors(src, d, **{k: v for k, v in kw.items() if k not in extra and k != "jobs"})
    if kw.pop("restore_wrapper", False):
        raise UnsupportedError("--restore-wrapper applies to conversion back to torch (a .safetensors input)")
    return convert_to_safetensors(src, d, **kw)
