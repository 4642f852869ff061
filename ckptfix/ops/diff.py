"""``ckptfix diff A B``: what differs between two checkpoints, in any containers, streamed.

Each side is read as :mod:`ckptfix.ops.diffsides` reads it (any format, folder or URL the other commands read,
torch-free: the tensors as byte ranges); the keys are aligned as :func:`~ckptfix.ops.prefixes.align_state_dict`
aligns them; then every pair of tensors is compared piece by piece (:data:`PIECE` bytes at a time per side,
in the order the tensors lie in A's files): bit equality is a ``memcmp`` of the two pieces and needs no torch;
the statistics of the tensors that differ (max abs / max relative difference, how many elements are not
``torch.isclose``, NaN/Inf mismatches) are computed with torch, chunked, only once a piece differs.
Without torch the report still says which tensors are bit-identical and where each other one first differs.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Sequence

from ckptfix.errors import UnsupportedError
from ckptfix.files.source import in_session
from ckptfix.ops.diffsides import Side, SideTensor, read_side, retie, where

if TYPE_CHECKING:
    from ckptfix.files.fileio import Fds

__all__ = ["DIFF_SCHEMA", "DiffReport", "EntryDiff", "TensorDiff", "diff"]

#: the JSON Schema of ``diff --json`` (docs/schemas/)
DIFF_SCHEMA = "docs/schemas/diff.schema.json"

#: bytes read per side per step of a comparison (the memory of one comparison: two of these)
PIECE = 8 << 20
#: elements per step of the statistics (torch temporaries: a few of these in the compute dtype)
STAT_ELEMS = 1 << 20

#: how each status reads, in the report's order
STATUS_ORDER = ("shape", "dtype", "identical", "close", "differ", "skipped")


@dataclass
class TensorDiff:
    """One tensor present on both sides, compared.

    Attributes:
        name: its name in B (A's name, renamed as the alignment said).
        name_a: its name in A.
        status: ``identical`` (same dtype, shape and bytes), ``close`` (every element within
            ``atol + rtol * |b|``), ``differ``, ``shape`` (shapes differ), ``dtype`` (dtypes differ and no
            ``dtype_cast``), ``unchecked`` (``keys_only``), ``skipped`` (its bytes cannot be compared: ``note``).
        dtype_a, dtype_b, shape_a, shape_b: as stored.
        numel: elements (of A).
        max_abs: the largest ``|a - b|`` over the elements finite on both sides (None: not computed).
        max_abs_index: where it is, as a flat (C-order) element index.
        max_rel: the largest ``|a - b| / |b|`` there (``0`` where both are 0, ``inf`` where only ``b`` is 0).
        differing: elements not ``torch.isclose(a, b, rtol, atol, equal_nan=True)``.
        fraction: ``differing / numel``.
        nan_mismatch: elements NaN on one side only.
        inf_mismatch: elements infinite on either side and not equal.
        first_diff: the first element whose bytes differ (flat index; None when identical).
        tied_with: the name this one was compared as (tied / shared tensors are compared once).
        note: why it was skipped, or what is missing (no torch: how to get the statistics).
    """

    name: str
    name_a: str
    status: str
    dtype_a: str
    dtype_b: str
    shape_a: list[int]
    shape_b: list[int]
    numel: int = 0
    max_abs: float | None = None
    max_abs_index: int | None = None
    max_rel: float | None = None
    differing: int | None = None
    fraction: float | None = None
    nan_mismatch: int | None = None
    inf_mismatch: int | None = None
    first_diff: int | None = None
    tied_with: str | None = None
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (every field)."""
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


@dataclass
class EntryDiff:
    """A non-tensor entry (epoch, config, safetensors metadata ...) that differs, briefly: ``None`` is absent."""

    key: str
    a: str | None
    b: str | None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"key": self.key, "a": self.a, "b": self.b}


@dataclass
class DiffReport:
    """What :func:`diff` found.

    Attributes:
        a, b: the two sides as given.
        format_a, format_b: what each is (``torch-zip``, ``safetensors``, ``dcp``, ``deepspeed-zero2`` ...).
        key_a, key_b: where each side's state dict sits.
        mapping: the key renaming used on A's keys (``"no change"``, ``"strip 'module.'"`` ...).
        mapping_candidates: when the alignment was ambiguous, the tied renamings (nothing applied).
        atol, rtol, dtype_cast, keys_only: the options.
        statistics: ``"torch"`` (numeric statistics computed) or ``"none"`` (bit equality only).
        only_a, only_b: names present on one side only (A's names renamed).
        tensors: every tensor present on both, in the report's order (see :data:`STATUS_ORDER`).
        entries: non-tensor entries that differ.
        notes: remarks (tied tensors, what the statistics need).
    """

    a: str
    b: str
    format_a: str
    format_b: str
    key_a: list[str]
    key_b: list[str]
    mapping: str
    atol: float
    rtol: float
    dtype_cast: bool
    keys_only: bool
    statistics: str
    only_a: list[str]
    only_b: list[str]
    tensors: list[TensorDiff]
    entries: list[EntryDiff]
    notes: list[str]
    mapping_candidates: list[str] | None = None

    def of(self, status: str) -> list[TensorDiff]:
        """The compared tensors with ``status``."""
        return [t for t in self.tensors if t.status == status]

    @property
    def equal(self) -> bool:
        """Same keys, shapes, dtypes (or cast) and values within tolerance (non-tensor entries do not count)."""
        if self.only_a or self.only_b:
            return False
        return all(t.status in ("identical", "close", "unchecked") for t in self.tensors)

    def summary(self) -> str:
        """The one-line summary: ``2 of 148 tensors differ (max abs 3.1e-2 at x.weight); 0 missing; 0 extra``.

        ``missing``: names of A that B lacks (``diff ORIGINAL CONVERTED``: what the conversion dropped; as
        ``load_state_dict`` of B into A's model calls them); ``extra``: names only B holds.
        """
        bad = [t for t in self.tensors if t.status not in ("identical", "close", "unchecked")]
        n = len(self.tensors)
        if self.keys_only:
            head = f"{len(bad)} of {n} tensors differ in shape or dtype (values not compared: --keys-only)"
        else:
            head = f"{len(bad)} of {n} tensors differ"
            worst = max((t for t in bad if t.max_abs is not None), key=lambda t: t.max_abs or 0.0, default=None)
            if worst is not None:
                head += f" (max abs {_g(worst.max_abs)} at {worst.name})"
            elif bad and not self.keys_only and self.statistics == "none":
                head += f" (first at {bad[0].name})"
            close = len(self.of("close"))
            if close:
                head += f"; {close} equal within tolerance"
        shapes, dtypes = len(self.of("shape")), len(self.of("dtype"))
        if shapes:
            head += f"; {shapes} in shape"
        if dtypes:
            head += f"; {dtypes} in dtype (--dtype-cast compares them)"
        return f"{head}; {len(self.only_a)} missing; {len(self.only_b)} extra"

    def to_dict(self) -> dict[str, Any]:
        """The ``diff --json`` document (docs/schemas/diff.schema.json)."""
        counts = {s: len(self.of(s)) for s in (*STATUS_ORDER, "unchecked")}
        return {
            "a": self.a,
            "b": self.b,
            "format_a": self.format_a,
            "format_b": self.format_b,
            "key_a": self.key_a,
            "key_b": self.key_b,
            "mapping": self.mapping,
            "mapping_candidates": self.mapping_candidates,
            "atol": self.atol,
            "rtol": self.rtol,
            "dtype_cast": self.dtype_cast,
            "keys_only": self.keys_only,
            "statistics": self.statistics,
            "equal": self.equal,
            "only_a": self.only_a,
            "only_b": self.only_b,
            "counts": counts,
            "tensors": [t.to_dict() for t in self.tensors],
            "entries": [e.to_dict() for e in self.entries],
            "notes": self.notes,
            "summary": self.summary(),
        }


def _g(x: float | None) -> str:
    """A difference in a few characters: ``3.1e-2``, ``0.25``, ``inf``, ``0``."""
    if x is None:
        return "-"
    s = f"{x:.3g}"
    if x == 0 or x != x or x in (float("inf"), float("-inf")) or (abs(x) >= 0.1 and "e" not in s):
        return s
    m, e = f"{x:.2e}".split("e")
    return f"{m.rstrip('0').rstrip('.')}e{int(e)}"


def _torch_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("torch") is not None


def _parse_maps(maps: Sequence[str] | Mapping[str, str]) -> list[tuple[str, str]]:
    if isinstance(maps, Mapping):
        return [(str(k), str(v)) for k, v in maps.items()]
    out = []
    for m in maps:
        if "=" not in m:
            raise UnsupportedError(f"--map {m!r}: write it as A_PREFIX=B_PREFIX (e.g. --map module.=model.)")
        a, b = m.split("=", 1)
        out.append((a, b))
    return out


def _mapped(name: str, maps: list[tuple[str, str]]) -> str:
    for a, b in maps:
        if name.startswith(a):
            return b + name[len(a) :]
    return name


@in_session
def diff(
    a: str | os.PathLike,
    b: str | os.PathLike,
    *,
    atol: float = 1e-8,
    rtol: float = 1e-5,
    align: bool = True,
    maps: Sequence[str] | Mapping[str, str] = (),
    key_a: str | None = None,
    key_b: str | None = None,
    dtype_cast: bool = False,
    keys_only: bool = False,
    jobs: int = 1,
    use_torch: bool | None = None,
) -> DiffReport:
    """Compare two checkpoints' state dicts, streamed: keys, shapes, dtypes, values, then other entries.

    Args:
        a, b: anything ``inspect`` reads: a torch zip / legacy file, safetensors, a sharded index (or its folder),
            a DCP directory, a DeepSpeed ZeRO folder, a Trainer / accelerate / Lightning / Hugging Face folder, a URL.
        atol, rtol: elements within ``atol + rtol * |b|`` are equal (``torch.allclose``'s defaults).
        align: rename A's keys to B's as ``align`` matches them (wrapper prefixes on either side); False: raw keys.
        maps: ``["A_PREFIX=B_PREFIX", ...]`` (or a mapping): leading prefixes of A's keys replaced first.
        key_a, key_b: where each side's state dict sits (``"state_dict_ema"``); found as ``inspect`` finds it.
        dtype_cast: compare tensors of different dtypes in their promoted dtype (fp32 vs bf16: the cast's error).
        keys_only: compare names, shapes and dtypes only; no tensor bytes are read.
        jobs: tensors compared at a time (``0``: one per CPU); memory: ``jobs`` x 2 x :data:`PIECE`.
        use_torch: None: statistics with torch when it is installed; False: bit equality only.

    Returns:
        A :class:`DiffReport`; ``report.equal`` says whether they are the same model.

    Raises:
        As :func:`ckptfix.formats.read_checkpoint` for either side (CheckpointNotFoundError, CorruptCheckpointError,
        UnsupportedError, KeyConflictError ...); NoTensorsError: a side holds no tensors.
    """
    from ckptfix.files.parallel import resolve_jobs

    jobs = resolve_jobs(jobs)
    if atol < 0 or rtol < 0:
        raise UnsupportedError(f"--atol {atol} / --rtol {rtol}: tolerances are not negative; pass 0 or more")
    pairs = _parse_maps(maps)
    sa = read_side(os.fspath(a), key_a)
    sb = read_side(os.fspath(b), key_b)
    retie(sa, sb)
    retie(sb, sa)
    stats = (_torch_available() if use_torch is None else use_torch) and not keys_only
    try:
        names_a = {_mapped(n, pairs): t for n, t in sa.tensors.items()}
        original = {_mapped(n, pairs): n for n in sa.tensors}
        if len(names_a) != len(sa.tensors):
            raise UnsupportedError(f"--map {' '.join(maps)}: two of A's keys map to one name; use narrower prefixes")
        mapping = "no change" if not pairs else "; ".join(f"replace {x!r} with {y!r}" for x, y in pairs)
        candidates = None
        if align:
            from ckptfix.ops.prefixes import align_state_dict

            renamed, rep = align_state_dict(names_a, sb.tensors)
            if rep.applied:
                back = dict(zip(renamed, names_a, strict=True))
                original = {n: original[back[n]] for n in renamed}
                names_a = dict(renamed)
                mapping = rep.rename if not pairs else f"{mapping}; {rep.rename}"
            elif rep.ambiguous:
                candidates = [c.rename for c in rep.candidates]
        only_a = [n for n in names_a if n not in sb.tensors]
        only_b = [n for n in sb.tensors if n not in names_a]
        common = [n for n in names_a if n in sb.tensors]
        rows = _compare_all(names_a, sb, common, original, atol, rtol, dtype_cast, keys_only, stats, jobs)
        notes = list(sa.notes) + list(sb.notes)
        tied = [r for r in rows if r.tied_with]
        if tied:
            notes.append(f"{len(tied)} tied/shared tensor name(s) compared once with the tensor they share")
        if not stats and not keys_only and any(r.status == "differ" for r in rows):
            notes.append(
                "statistics (max abs/rel difference, how many elements differ) need torch: "
                "pip install torch and run the diff again"
            )
        order = {s: i for i, s in enumerate(STATUS_ORDER)}
        rows.sort(key=lambda r: order.get(r.status, len(order)))
        return DiffReport(
            a=os.fspath(a),
            b=os.fspath(b),
            format_a=sa.format,
            format_b=sb.format,
            key_a=list(sa.key_path),
            key_b=list(sb.key_path),
            mapping=mapping,
            mapping_candidates=candidates,
            atol=atol,
            rtol=rtol,
            dtype_cast=dtype_cast,
            keys_only=keys_only,
            statistics="torch" if stats else "none",
            only_a=only_a,
            only_b=only_b,
            tensors=rows,
            entries=_entries(sa.entries, sb.entries),
            notes=notes,
        )
    finally:
        sa.close()
        sb.close()


def _entries(ea: Mapping[str, str], eb: Mapping[str, str]) -> list[EntryDiff]:
    out = []
    for k in dict.fromkeys([*ea, *eb]):
        va, vb = ea.get(k), eb.get(k)
        if va != vb:
            out.append(EntryDiff(k, va, vb))
    return out


class _Context:
    """What the comparisons share: the open local files and remote sources."""

    def __init__(self, jobs: int) -> None:
        from ckptfix.files.fileio import Fds

        self.fds: Fds = Fds()
        self.jobs = jobs
        self._sources: Any = None
        self._lock = threading.Lock()
        self._local = threading.local()

    def buffers(self) -> tuple[bytearray, bytearray]:
        """This thread's two piece buffers (A's, B's), made once: no allocation, no page faults per tensor."""
        bufs = getattr(self._local, "bufs", None)
        if bufs is None:
            bufs = self._local.bufs = (bytearray(PIECE), bytearray(PIECE))
        return bufs

    def sources(self) -> Any:
        with self._lock:
            if self._sources is None:
                from ckptfix.ops.convert.remote_in import Sources

                self._sources = Sources(max(2, self.jobs))
            return self._sources

    def close(self) -> None:
        self.fds.close()
        if self._sources is not None:
            self._sources.close()


def _compare_all(
    names_a: Mapping[str, SideTensor],
    sb: Side,
    common: list[str],
    original: Mapping[str, str],
    atol: float,
    rtol: float,
    dtype_cast: bool,
    keys_only: bool,
    stats: bool,
    jobs: int,
) -> list[TensorDiff]:
    """Every common tensor compared (each distinct pair of tensors once), in the order A's bytes lie."""
    import functools

    from ckptfix.files.parallel import run_tasks

    rows: dict[str, TensorDiff] = {}
    todo: dict[tuple[int, int], list[str]] = {}
    for n in common:
        ta, tb = names_a[n], sb.tensors[n]
        row = TensorDiff(n, original[n], "", ta.dtype, tb.dtype, list(ta.shape), list(tb.shape), numel=ta.numel)
        rows[n] = row
        if ta.shape != tb.shape:
            row.status = "shape"
        elif ta.dtype != tb.dtype and not dtype_cast:
            row.status = "dtype"
        elif keys_only:
            row.status = "unchecked"
        elif ta.note or tb.note:
            row.status, row.note = "skipped", ta.note or tb.note
        else:
            todo.setdefault((ta.group, tb.group), []).append(n)
    ctx = _Context(jobs)
    groups = sorted(todo.values(), key=lambda ns: where(names_a[ns[0]]))
    tasks = [functools.partial(_compare, names_a[ns[0]], sb.tensors[ns[0]], atol, rtol, stats, ctx) for ns in groups]
    try:
        results = run_tasks(tasks, jobs)
    finally:
        ctx.close()
    for ns, res in zip(groups, results, strict=True):
        for i, n in enumerate(ns):
            row = rows[n]
            for k, v in res.items():
                setattr(row, k, v)
            if i:
                row.tied_with = ns[0]
    return [rows[n] for n in common]


def _pieces(t: SideTensor, piece: int, ctx: _Context, buf: bytearray, mapped: bool = False) -> Iterator[memoryview]:
    """The tensor's bytes, C-contiguous, in views of ``piece`` bytes (the last one shorter), read into ``buf``.

    Each view is valid until the next is asked for; ``buf`` is the thread's, reused tensor after tensor.
    ``mapped``: a piece that is one stretch of a local file is a read-only view of its mapped pages instead (no
    copy: the comparison reads the page cache; the mapping is dropped before the next piece, so memory stays flat).
    """
    from ckptfix.errors import CorruptCheckpointError

    total = t.nbytes
    if total == 0:
        return
    size = min(piece, total, len(buf))
    view = memoryview(buf)[:size]
    fill = 0
    seen = 0
    ranges = t.item.ranges() if t.item is not None else None
    if ranges is not None:
        from ckptfix.ops.convert.remote_in import is_remote, uncached_pread

        for path, off, n, _crc in ranges:
            pos = 0
            src = ctx.sources().get(path) if is_remote(path) else None
            fd = None if src is not None else ctx.fds.get(path)
            while pos < n:
                k = min(size - fill, n - pos)
                if src is not None:
                    data = uncached_pread(src, k, off + pos)
                    got = len(data)
                    view[fill : fill + got] = data
                else:
                    assert fd is not None
                    if mapped and fill == 0 and (k == size or seen + k == total):
                        m = _map(fd, off + pos, k)
                        if m is not None:
                            with m, memoryview(m) as whole, whole[(off + pos) % mmap_gran() :] as w:
                                yield w
                            pos, seen = pos + k, seen + k
                            continue
                    got = os.preadv(fd, [view[fill : fill + k]], off + pos)
                if got <= 0:
                    raise CorruptCheckpointError(f"{path}: ends inside tensor {t.name!r} (truncated?)")
                fill, pos, seen = fill + got, pos + got, seen + got
                if fill == size:
                    yield view
                    fill = 0
    else:
        assert t.item is not None
        for chunk in t.item.chunks(ctx.fds):
            mv = memoryview(chunk).cast("B")
            pos = 0
            while pos < len(mv):
                k = min(size - fill, len(mv) - pos)
                view[fill : fill + k] = mv[pos : pos + k]
                fill, pos, seen = fill + k, pos + k, seen + k
                if fill == size:
                    yield view
                    fill = 0
    if fill:
        yield view[:fill]
    if seen != total:
        raise CorruptCheckpointError(f"tensor {t.name!r}: read {seen} bytes, expected {total}; the file is damaged")


def mmap_gran() -> int:
    import mmap

    return mmap.ALLOCATIONGRANULARITY


def _map(fd: int, offset: int, n: int) -> Any:
    """``n`` bytes of the file at ``offset``, mapped read-only and populated, or None (past its end: read instead,
    which reports the truncation; or the mapping failed)."""
    import mmap

    if offset + n > os.fstat(fd).st_size:
        return None
    base = offset - offset % mmap.ALLOCATIONGRANULARITY
    try:
        return mmap.mmap(
            fd, n + offset - base, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0), prot=mmap.PROT_READ,
            offset=base,
        )  # fmt: skip
    except (OSError, ValueError):
        return None


def _same(buf_a: bytearray, va: memoryview, vb: memoryview) -> bool:
    """Are two pieces' bytes equal: one ``memcmp``, no copy (a memoryview's ``==`` goes element by element).

    ``va`` is a view of the start of ``buf_a`` (as :func:`_pieces` yields them), so ``buf_a.startswith(vb)``
    compares exactly ``va`` with ``vb``.
    """
    return len(va) == len(vb) and buf_a.startswith(vb)


def _first_diff(va: memoryview, vb: memoryview) -> int:
    """The first byte index where the two differ (they do), by halving: each step one memcmp."""
    lo, hi = 0, min(len(va), len(vb))
    while hi - lo > 64:
        mid = (lo + hi) // 2
        if va[lo:mid].tobytes() != vb[lo:mid].tobytes():
            hi = mid
        else:
            lo = mid
    for i in range(lo, hi):
        if va[i] != vb[i]:
            return i
    return hi


def _compare(ta: SideTensor, tb: SideTensor, atol: float, rtol: float, stats: bool, ctx: _Context) -> dict[str, Any]:
    """One pair of tensors (same shape) compared piece by piece; the fields of its :class:`TensorDiff`."""
    esa, esb = ta.element_size, tb.element_size
    per = max(1, PIECE // max(esa, esb))
    same_dtype = ta.dtype == tb.dtype
    acc: _Stats | None = None
    first: int | None = None
    at = 0  # elements done
    if not same_dtype and not stats:
        return {"status": "skipped", "note": "comparing across dtypes (--dtype-cast) needs torch: pip install torch"}
    buf_a, buf_b = ctx.buffers()
    for va, vb in zip(_pieces(ta, per * esa, ctx, buf_a), _pieces(tb, per * esb, ctx, buf_b, True), strict=True):
        count = len(va) // esa
        if acc is None and same_dtype and _same(buf_a, va, vb):
            at += count
            continue
        if first is None and same_dtype:
            first = at + _first_diff(va, vb) // esa
        if not stats:
            break
        if acc is None:
            acc = _Stats(ta.dtype, tb.dtype, atol, rtol)
        acc.add(va, vb, at)
        at += count
    if acc is None and first is None:
        return {"status": "identical", "numel": ta.numel}
    if acc is None:
        return {"status": "differ", "numel": ta.numel, "first_diff": first}
    res = acc.result(ta.numel)
    res["first_diff"] = first if first is not None else acc.first
    res["status"] = "close" if acc.differing == 0 else "differ"
    return res


class _Stats:
    """Running statistics of ``a - b``, chunk by chunk, with torch (imported only once a tensor differs)."""

    def __init__(self, dtype_a: str, dtype_b: str, atol: float, rtol: float) -> None:
        import torch

        self.torch = torch
        self.da, self.db = getattr(torch, dtype_a), getattr(torch, dtype_b)
        dt = torch.promote_types(self.da, self.db)
        if dt.is_floating_point and dt.itemsize == 1:  # float8: no arithmetic; exact in float32
            dt = torch.float32
        self.dt = dt
        self.atol, self.rtol = atol, rtol
        self.max_abs = 0.0
        self.max_abs_index: int | None = None
        self.max_rel = 0.0
        self.differing = 0
        self.nan = 0
        self.inf = 0
        self.first: int | None = None

    def add(self, va: memoryview, vb: memoryview, at: int) -> None:
        torch = self.torch
        ea, eb = len(va) // self.da.itemsize, len(vb) // self.db.itemsize
        import warnings

        with warnings.catch_warnings():  # B's piece may be a read-only mapping: only read here
            warnings.simplefilter("ignore", UserWarning)
            ta_all = torch.frombuffer(va, dtype=self.da, count=ea)
            tb_all = torch.frombuffer(vb, dtype=self.db, count=eb)
        for s in range(0, ea, STAT_ELEMS):
            a = ta_all[s : s + STAT_ELEMS].to(self.dt)
            b = tb_all[s : s + STAT_ELEMS].to(self.dt)
            self._chunk(a, b, at + s)

    def _chunk(self, a: Any, b: Any, at: int) -> None:
        torch = self.torch
        if self.dt == torch.bool:
            a, b = a.to(torch.uint8), b.to(torch.uint8)
        floating = a.is_floating_point() or a.is_complex()
        if floating:
            close = torch.isclose(a, b, rtol=self.rtol, atol=self.atol, equal_nan=True)
        else:
            close = (
                a == b if (self.atol == 0 and self.rtol == 0) else torch.isclose(a, b, rtol=self.rtol, atol=self.atol)
            )
        bad = int((~close).sum())
        if bad and self.first is None:
            self.first = at + int((~close).nonzero()[0, 0])
        self.differing += bad
        if not floating:
            a, b = a.to(torch.int64), b.to(torch.int64)
        d = (a - b).abs()
        absb = b.abs()
        if floating:
            self.nan += int((torch.isnan(a) ^ torch.isnan(b)).sum())
            self.inf += int(((torch.isinf(a) | torch.isinf(b)) & (a != b)).sum())
            finite = torch.isfinite(a) & torch.isfinite(b)
            d = torch.where(finite, d, torch.zeros((), dtype=d.dtype))
        if d.numel() == 0:
            return
        i = int(torch.argmax(d))
        m = float(d[i])
        if m > self.max_abs:
            self.max_abs, self.max_abs_index = m, at + i
        rel = d.double() / absb.double()
        rel = torch.where(d == 0, torch.zeros((), dtype=rel.dtype), rel)
        r = float(rel.max())
        if r > self.max_rel:
            self.max_rel = r

    def result(self, numel: int) -> dict[str, Any]:
        return {
            "numel": numel,
            "max_abs": self.max_abs,
            "max_abs_index": self.max_abs_index,
            "max_rel": self.max_rel,
            "differing": self.differing,
            "fraction": self.differing / numel if numel else 0.0,
            "nan_mismatch": self.nan,
            "inf_mismatch": self.inf,
        }


def render(r: DiffReport, quiet: bool = False) -> list[str]:
    """The text report, in the order a user reads it; the summary line last (``quiet``: only that line)."""
    if quiet:
        return [r.summary()]
    out = [f"A  {r.a} ({r.format_a}{', ' + '/'.join(r.key_a) if r.key_a else ''})"]
    out.append(f"B  {r.b} ({r.format_b}{', ' + '/'.join(r.key_b) if r.key_b else ''})")
    out.append(f"keys: {r.mapping}")
    if r.mapping_candidates:
        out.append(f"  ambiguous alignment, nothing applied: {' | '.join(r.mapping_candidates)}; use --map")

    def block(title: str, lines: list[str], limit: int = 20) -> None:
        if not lines:
            return
        out.append(f"{title} ({len(lines)}):")
        out.extend(f"  {x}" for x in lines[:limit])
        if len(lines) > limit:
            out.append(f"  ... and {len(lines) - limit} more (--json lists all)")

    block("only in A (missing from B)", r.only_a)
    block("only in B (extra)", r.only_b)
    block("shape mismatch", [f"{t.name}: {t.shape_a} vs {t.shape_b}" for t in r.of("shape")])
    block("dtype mismatch", [f"{t.name}: {t.dtype_a} vs {t.dtype_b} (--dtype-cast compares)" for t in r.of("dtype")])
    same = r.of("identical")
    if same:
        out.append(f"bit-identical: {len(same)} tensors")
    block(
        "equal within tolerance", [f"{t.name}: max abs {_g(t.max_abs)}, max rel {_g(t.max_rel)}" for t in r.of("close")]
    )
    lines = []
    for t in r.of("differ"):
        if t.differing is None:
            lines.append(f"{t.name}: bytes differ from element {t.first_diff}")
            continue
        s = (
            f"{t.name}: max abs {_g(t.max_abs)} (element {t.max_abs_index}), max rel {_g(t.max_rel)}, "
            f"{t.differing:,} of {t.numel:,} differ ({t.fraction:.2%})"
        )
        if t.nan_mismatch:
            s += f", NaN mismatch {t.nan_mismatch}"
        if t.inf_mismatch:
            s += f", Inf mismatch {t.inf_mismatch}"
        lines.append(s)
    block("differ", lines)
    block("not compared", [f"{t.name}: {t.note}" for t in r.of("skipped")])
    block("other entries differ", [f"{e.key}: {e.a or '(absent)'} -> {e.b or '(absent)'}" for e in r.entries], 8)
    for n in r.notes:
        out.append(f"note: {n}")
    out.append(r.summary())
    return out
