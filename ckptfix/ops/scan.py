"""``scan``: every global a checkpoint's pickles reference, classified, reading opcodes only (nothing is unpickled).

Every pickle ``torch.load`` (or ``dcp.load``) would unpickle is scanned, and every other reading of the
bytes (a zip that is also a tar, a pickle with a zip appended).  A framework folder (:mod:`ckptfix.formats.layouts`)
is scanned file by file.  :mod:`ckptfix.ops.inspect` re-exports these names.
"""

from __future__ import annotations

import collections
import io
import os
import struct
import zipfile
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

from ckptfix.errors import CkptfixError, CorruptCheckpointError
from ckptfix.files import source
from ckptfix.formats import Format, Input, classify, read_checkpoint, sniff
from ckptfix.formats.layouts import resolve
from ckptfix.formats.registry import dispatch
from ckptfix.pickles import (
    LEGACY_MAGIC_NUMBER,
    PickleLimits,
    ScanResult,
    scan_globals,
    scan_pickle_sequence,
)
from ckptfix.pickles.policy import classify_pair, worst

SCAN_SCHEMA = "ckptfix.scan/1"


def scan_unsafe(path: str | Input) -> list[str]:
    """The dangerous and unknown globals of every pickle and every reading of the file (what ``scan`` reports).

    ``torch.load`` unpickles more than the pickle holding the state dict (a legacy stream's header pickles,
    a polyglot's other reading), so a weights-only verdict must consider them all.

    Args:
        path: a checkpoint file, or its :class:`~ckptfix.formats.Input` (``cf.input`` of the file read: not
            sniffed again).

    Returns:
        The globals (dangerous first), empty when scan says safe.  A file scan cannot read gives ``[]``
        (its reader's own error is what the caller reports).
    """
    from ckptfix.errors import CkptfixError

    try:
        rep = scan_checkpoint(path)
    except CkptfixError:
        return []
    return rep.dangerous + rep.unknown


@dataclass
class ScanReport:
    """What ``scan`` found: every global each pickle of the checkpoint references, classified."""

    path: str
    format: Format
    pickles: list[str]
    globals: dict[str, dict[str, Any]]  # name -> {"class": ..., "count": n}
    errors: list[str]
    notes: list[str] = field(default_factory=list)
    #: a folder's scan: one entry per file scanned (its path in the folder -> ``verdict``, ``dangerous``,
    #: ``unknown``, ``errors``); empty for a single checkpoint
    files: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def dangerous(self) -> list[str]:
        """The globals classified dangerous (they run code when unpickled)."""
        return [g for g, d in self.globals.items() if d["class"] == "dangerous"]

    @property
    def unknown(self) -> list[str]:
        """The globals outside torch's weights-only allowlist, and what the scan could not read."""
        return [g for g, d in self.globals.items() if d["class"] == "unknown"]

    @property
    def verdict(self) -> str:
        """``dangerous``, ``unknown``, ``malformed`` or ``safe``, the worst that applies."""
        if self.dangerous:
            return "dangerous"
        if self.unknown:
            return "unknown"
        if self.errors:
            return "malformed"
        return "safe"

    def to_dict(self) -> dict[str, Any]:
        """The ``scan --json`` document.

        Returns:
            ``schema`` (``ckptfix.scan/1``), the fields, the verdict and the dangerous/unknown lists.
        """
        return {
            "schema": SCAN_SCHEMA,
            "path": self.path,
            "format": self.format,
            "verdict": self.verdict,
            "pickles": self.pickles,
            "globals": self.globals,
            "dangerous": self.dangerous,
            "unknown": self.unknown,
            "errors": self.errors,
            "notes": self.notes,
            "files": self.files,
        }

    def file_entry(self) -> dict[str, Any]:
        """This report as one file's entry in a folder's ``files``."""
        return {
            "verdict": self.verdict,
            "format": self.format,
            "dangerous": self.dangerous,
            "unknown": self.unknown,
            "errors": self.errors,
        }


class _Acc:
    """Accumulates scan results over the pickles of one checkpoint."""

    def __init__(self, context: str | None) -> None:
        self.context = context
        self.globals: dict[str, dict[str, Any]] = {}
        self.pickles: list[str] = []
        self.errors: list[str] = []
        self.notes: list[str] = []
        #: a folder's entries left out of its scan: label -> the unknown global naming why
        self.skipped: dict[str, str] = {}

    def add_result(self, label: str, r: ScanResult) -> None:
        self.pickles.append(label)
        for (m, n), count in r.pairs.items():
            self._add(f"{m}.{n}", classify_pair(m, n, self.context), count)
        for what in r.unresolved:
            self._add(what, "unknown", 1)
        if r.error:
            self.errors.append(f"{label}: {r.error}")

    def add_sequence(self, label: str, parts: list[ScanResult], size: int) -> None:
        """The pickles of a bare pickle stream (``pickle.load`` called again reads each one after the first):
        every one counts, and a note says what follows the first ``STOP``."""
        for i, part in enumerate(parts):
            self.add_result(label if i == 0 else f"{label}[{i}]", part)
        if not parts:
            return
        first = parts[0].end
        if size > first and not parts[0].error:
            more = len(parts) - 1
            what = f"{more} more pickle(s), scanned" if more else "no pickle"
            if parts[-1].error and more:
                what += f"; the last of them stops at an error ({parts[-1].error})"
            self.notes.append(
                f"{label}: {size - first} byte(s) after the first pickle (end at byte {first}): {what}; "
                "pickle.load called again on the file reads them"
            )

    def unknown(self, label: str, why: str) -> None:
        """Something the scan cannot read: it counts as an unknown global (never safe)."""
        self._add(f"<{label}: {why}>", "unknown", 1)

    def left_out(self, label: str, why: str) -> None:
        """A folder's entry the scan did not read (a link out of it, past a bound, unresolvable): an unknown
        global, and the entry's own ``files`` verdict ``unknown`` (a folder's verdict covers every file)."""
        self.unknown(label, why)
        self.skipped[label] = f"<{label}: {why}>"

    def _add(self, key: str, cls: str, count: int) -> None:
        d = self.globals.setdefault(key, {"class": cls, "count": 0})
        d["class"] = worst(d["class"], cls)
        d["count"] += count

    def merge(self, prefix: str, other: "ScanReport") -> None:
        for g, d in other.globals.items():
            self._add(g, d["class"], d["count"])
        self.pickles += [f"{prefix}:{p}" for p in other.pickles]
        self.errors += [f"{prefix}:{e}" for e in other.errors]
        self.notes += other.notes


def _scan_member_bytes(zf: zipfile.ZipFile, info: zipfile.ZipInfo, label: str, acc: _Acc, limits: PickleLimits) -> None:
    if info.file_size > limits.max_bytes:
        acc.unknown(
            label,
            f"a {info.file_size >> 20} MiB pickle, over the {limits.max_bytes >> 20} MiB limit "
            "(set CKPTFIX_MAX_PICKLE_MB=N to scan it)",
        )
        return
    try:
        with zf.open(info) as fh:
            data = fh.read(limits.max_bytes + 1)
    except Exception as e:  # noqa: BLE001 - a damaged member is reported, never a crash
        acc.errors.append(f"{label}: unreadable ({type(e).__name__}: {e})")
        return
    _, parts = scan_pickle_sequence(data, limits=limits, max_pickles=1)
    acc.add_sequence(label, parts, len(data))


def _scan_zip(fileobj: Any, label: str, acc: _Acc, limits: PickleLimits) -> None:
    try:
        zf = zipfile.ZipFile(fileobj)
    except Exception as e:  # noqa: BLE001 - zipfile raises many types on damaged archives
        acc.errors.append(f"{label}: damaged zip ({type(e).__name__}: {e})")
        return
    from ckptfix.formats.zipfmt import check_inflation, check_names, torch_root

    with zf:
        try:
            infos = zf.infolist()
        except Exception as e:  # noqa: BLE001
            acc.errors.append(f"{label}: damaged zip directory ({e})")
            return
        # names torch and zipfile could resolve differently, and members that inflate past the budget:
        # refused as by every other command
        try:
            check_names(label, zf.namelist())
            torch_root(label, zf.namelist())
        except CorruptCheckpointError as e:  # refused by every loader; scan still reports every member's globals
            acc.errors.append(str(e))
        check_inflation(label, zf, records=False)
        names = collections.Counter(i.filename for i in infos)
        for dup in sorted(n for n, c in names.items() if c > 1):
            acc.errors.append(
                f"{label}: the archive holds {names[dup]} members named {dup!r} (readers disagree on "
                "which one counts); refused"
            )
        for info in infos:
            if info.filename.endswith(".pkl") and not info.filename.endswith(".debug_pkl"):
                _scan_member_bytes(zf, info, f"{label}:{info.filename}", acc, limits)


def scan_legacy(path: str, acc: _Acc, limits: PickleLimits) -> Format:
    """Every pickle torch.load would unpickle from a non-zip file; returns the format."""
    with source.open_file(path) as f:
        r, parts = scan_pickle_sequence(f, limits=limits)
    legacy = bool(parts) and not parts[0].value_unknown and parts[0].value == LEGACY_MAGIC_NUMBER
    base = os.path.basename(path)
    if not legacy:
        acc.add_sequence(base, parts, source.getsize(path))
        return Format.PICKLE
    names = ["magic number", "protocol version", "system info", "checkpoint object", "storage keys"]
    for i, part in enumerate(parts):
        acc.add_result(f"{base}[{names[i]}]", part)
    return Format.TORCH_LEGACY


def scan_sharded(path: str, acc: _Acc, limits: PickleLimits) -> Format:
    from ckptfix.formats.sharded import check_shard_kind, load_index

    idx = load_index(path)  # the one index loader: escaping shard names, bad weight maps, size limit
    for shard, sp in idx.shards.items():
        kind = sniff(sp)
        check_shard_kind(idx, shard, kind)
        acc.merge(shard, scan_checkpoint(Input(sp, kind), limits=limits))
    return Format.SHARDED


def scan_dcp(path: str, acc: _Acc, limits: PickleLimits) -> None:
    from ckptfix.files.containment import check_member

    meta = source.join(path, ".metadata")
    check_member(path, ".metadata", path)  # members linking out of the directory: refused, as for shards
    with source.open_file(meta) as f:
        acc.add_result(".metadata", scan_globals(f, limits=limits))
    spans = _remote_spans(path, acc) if source.is_url(path) else None
    for name in source.listdir(path):
        if name.endswith(".distcp") and source.isfile(source.join(path, name)):
            check_member(path, name, path)
            if spans is not None:
                _scan_distcp_spans(source.join(path, name), name, spans.get(name, []), acc, limits)
            else:
                _scan_distcp(source.join(path, name), name, acc, limits)


def _remote_spans(path: str, acc: _Acc) -> dict[str, list[tuple[int, int]]] | None:
    """For a DCP folder at a URL: where ``.metadata`` says each item lies, per data file (None: unreadable
    metadata; the data files are then searched whole, as local ones are)."""
    from ckptfix.formats.dcp.meta import BytesEntry, read_metadata

    try:
        meta = read_metadata(path)
    except CkptfixError:
        return None
    out: dict[str, list[tuple[int, int]]] = {}
    for e in meta.entries.values():
        locs = [e.location] if isinstance(e, BytesEntry) else list(getattr(e, "locations", []))
        for loc in locs:
            if loc is not None:
                out.setdefault(loc.relative_path, []).append((loc.offset, loc.length))
    return out


def _scan_distcp_spans(fpath: str, label: str, spans: list[tuple[int, int]], acc: _Acc, limits: PickleLimits) -> None:
    """:func:`_scan_distcp` for a remote data file: archives are looked for where ``.metadata`` puts the items
    (an end record at the end of each item), instead of searching every byte; the ends and starts of the items
    are fetched together first.  Bytes in no archive found are reported exactly as by the local search."""
    size = source.getsize(fpath)
    spans = sorted(set(spans))
    with source.open_source(fpath) as src:
        pre = getattr(src, "prefetch", None)
        if pre is not None:
            # an item's local header and data.pkl, its central directory and end record: 0.5-1 KiB each in a
            # torch.save archive (more is read on demand)
            k = 4 << 10
            pre([(o, min(n, k)) for o, n in spans] + [(max(o, o + n - k), min(n, k)) for o, n in spans])
    # unbuffered: a buffer would read 64 KiB past each small read, beyond what was fetched
    with source.open_file(fpath) as buffered:
        f = getattr(buffered, "raw", buffered)
        _scan_archives(f, _item_ends(f, spans, size), size, label, acc, limits)


def _item_ends(f: Any, spans: list[tuple[int, int]], size: int) -> Iterator[int]:
    """The end records at the ends of the items ``spans`` (ascending), read where ``.metadata`` puts them."""
    for off, length in spans:
        e = off + length - 22
        if length < 22 or off + length > size:
            continue
        f.seek(e)
        if f.read(4) == b"PK\x05\x06":
            yield e


def _scan_archives(f: Any, ends: Iterable[int], size: int, label: str, acc: _Acc, limits: PickleLimits) -> None:
    """Scan the torch archives whose end records are at ``ends`` (ascending) in a file of ``size`` bytes;
    bytes that belong to no archive make the verdict unknown (local files and remote ones alike)."""
    pos = 0
    for e in ends:
        if e < pos:
            continue
        bounds = _archive_bounds(f, e, size)
        if bounds is None or bounds[0] < pos:
            continue
        start, end = bounds
        f.seek(start)
        if f.read(4) not in (b"PK\x03\x04", b"PK\x01\x02", b"PK\x05\x06"):
            continue
        if start > pos:
            acc.unknown(label, f"bytes {pos}..{start} belong to no torch archive and were not scanned")
        _scan_zip(_Slice(f, start, end - start), f"{label}@{start}", acc, limits)
        pos = end
    if pos < size:
        acc.unknown(label, f"bytes {pos}..{size} belong to no torch archive and were not scanned")


class _Slice(io.RawIOBase):
    """A read-only window of a file: one archive inside a .distcp file."""

    def __init__(self, f: Any, start: int, length: int) -> None:
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
        k = max(0, min(len(b), self.length - self.pos))
        self.f.seek(self.start + self.pos)
        data = self.f.read(k)
        b[: len(data)] = data
        self.pos += len(data)
        return len(data)


def _find_all(f: Any, size: int, needle: bytes, start: int, chunk: int = 1 << 20):
    """Offsets of ``needle`` in the file from ``start`` on, read in chunks (bounded memory)."""
    pos = start
    keep = len(needle) - 1
    tail = b""
    while pos < size:
        f.seek(pos)
        block = f.read(min(chunk, size - pos))
        if not block:
            return
        data = tail + block
        base = pos - len(tail)
        i = data.find(needle)
        while i >= 0:
            yield base + i
            i = data.find(needle, i + 1)
        tail = data[-keep:] if keep else b""
        pos += len(block)


def _archive_bounds(f: Any, e: int, size: int) -> tuple[int, int] | None:
    """(start, end) of the zip archive whose end-of-central-directory record is at ``e``, or None."""
    f.seek(e)
    rec = f.read(22)
    if len(rec) < 22:
        return None
    cd_size, cd_off, clen = struct.unpack_from("<IIH", rec, 12)
    end = e + 22 + clen
    if end > size:
        return None
    if e >= 76:
        f.seek(e - 20)
        loc = f.read(20)
        if loc[:4] == b"PK\x06\x07":
            (z64_rel,) = struct.unpack_from("<Q", loc, 8)
            f.seek(e - 76)
            if f.read(4) == b"PK\x06\x06":
                start = e - 76 - z64_rel
                return (start, end) if start >= 0 else None
    start = e - cd_size - cd_off
    return (start, end) if start >= 0 else None


def _scan_distcp(fpath: str, label: str, acc: _Acc, limits: PickleLimits) -> None:
    """Scan the torch archives written back to back in a .distcp file (one per DCP item).

    Archives are found from their end records (the start follows from the central
    directory's offset), so nothing is unpickled; bytes that belong to no archive
    (tensors written raw, or anything else) cannot be told apart from a pickle that
    ``dcp.load`` would hand to ``torch.load``, and make the verdict unknown.
    """
    size = source.getsize(fpath)
    with source.open_file(fpath) as f:
        _scan_archives(f, _find_all(f, size, b"PK\x05\x06", 0), size, label, acc, limits)


def scan_checkpoint(path: str | os.PathLike | Input, *, limits: PickleLimits | None = None) -> ScanReport:
    """List every global the checkpoint's pickles reference and classify each, reading opcodes only.

    Every pickle ``torch.load`` (or ``dcp.load``) would unpickle is scanned: ``data.pkl`` (and
    every other ``.pkl`` member) of a zip, the five pickles of a legacy stream, a bare pickle,
    each shard of a sharded index, a DCP directory's ``.metadata`` and the pickles inside its
    ``.distcp`` files.  Nothing is unpickled.  What the scan cannot follow is listed as an
    unknown global (``<...>``), so the verdict is never "safe" for it.

    Args:
        path: a checkpoint file, sharded index (or its directory) or DCP directory; or its
            :class:`~ckptfix.formats.Input` (:func:`~ckptfix.formats.classify`: not sniffed again).
        limits: resource limits (default: from ``CKPTFIX_MAX_PICKLE_*``).

    Returns:
        A :class:`ScanReport`.

    Raises:
        CheckpointNotFoundError: missing path or shard.
        CorruptCheckpointError: a file that is no checkpoint at all.
        UnsupportedError: a pre-0.4 tar checkpoint (it runs pickles ckptfix cannot scan as one archive).
    """
    given, path = path, os.fspath(path)
    limits = limits or PickleLimits.from_env()
    if not source.is_url(path) and os.path.isdir(path):
        fw = resolve(path)
        if fw is not None:
            return _scan_folder(fw, limits)
    with source.session():  # a remote object is opened once (one pinned version) for the whole scan
        if source.isdir(path):
            from ckptfix.formats import classify_or_none

            inp = classify_or_none(given)
            if inp is not None and inp.format == Format.DCP:  # one checkpoint, one entry (as a DCP layout has)
                rep = _scan_one(inp, limits)
                rep.files = {".": rep.file_entry()}
                return rep
            if inp is not None or source.is_url(path):  # (a local folder of neither kind: classify says why)
                rep = _scan_plain(path, inp, limits)
                if rep.files or inp is not None:
                    return rep
        return _scan_one(classify(given), limits)


def _scan_one(inp: Input, limits: PickleLimits) -> ScanReport:
    path, kind = inp.path, inp.format
    acc = _Acc(_context(kind))
    fmt = dispatch(kind, "scan", path)(path, acc, limits) or kind
    _scan_other_readings(path, kind, acc, limits)
    globals_ = dict(sorted(acc.globals.items()))
    return ScanReport(path=path, format=fmt, pickles=acc.pickles, globals=globals_, errors=acc.errors, notes=acc.notes)


#: roles of framework files that hold no pickle (JSON, tokenizer files ...)
_NO_PICKLE_ROLES = ("trainer-state", "config", "gen-config", "tokenizer")

#: names a tokenizer (or anything) unpickles: a tokenizer-role file with one is scanned (TransfoXL's vocab.pkl)
_PICKLE_EXTS = (".pkl", ".pickle", ".pt", ".pth", ".bin", ".ckpt", ".npy", ".npz")

#: names never read as a pickle (text a loader parses, never unpickles)
_TEXT_EXTS = (".json", ".md", ".txt", ".py")


def bears_pickles(name: str, role: str | None) -> bool:
    """Whether a folder's file is one ``scan`` reads (the same rule for a local and a remote folder).

    Args:
        name: the file's name in the folder.
        role: its role (:func:`ckptfix.formats.roles.file_role`), None when it has none.

    Returns:
        False for the roles that hold no pickle (JSON state, configs, tokenizer files without a pickle's
        extension) and for text files; True for everything else (optimizer, scheduler, RNG states, training
        arguments, accelerate's ``random_states_N.pkl`` / ``custom_checkpoint_N.pkl``, ``.npy`` ...).
    """
    if role == "tokenizer":
        return name.endswith(_PICKLE_EXTS)
    return role not in _NO_PICKLE_ROLES


def _scan_folder(fw: Any, limits: PickleLimits) -> ScanReport:
    """Scan every pickle a framework folder holds: the weights and each other file torch.load would read."""
    from ckptfix.formats.layouts import outside
    from ckptfix.formats.roles import file_role

    acc = _Acc(None)
    weights = fw.weights
    if weights is not None and (real := outside(fw, weights)) is not None:
        acc.unknown(os.path.relpath(weights, fw.path), f"a link to {real}, outside the folder; not read")
        weights = None
    own: list[str] = []
    if fw.layout.consolidated and weights is not None and os.path.realpath(weights) == os.path.realpath(fw.path):
        # a consolidated layout (HF-writer ranks, ZeRO) whose weights are the folder itself: its files, each
        weights = None
        listed = {f.file for f in fw.files}
        own = [
            os.path.join(fw.path, n)
            for n in sorted(os.listdir(fw.path))
            if not n.startswith(".") and n not in listed and bears_pickles(n, file_role(n))
        ]
    named = [os.path.join(fw.path, f.file) for f in fw.files]
    maybe = {os.path.join(fw.path, f.file) for f in fw.files if not bears_pickles(f.file, f.role)}
    taken = {os.path.basename(t) for t in own + named} | ({os.path.basename(weights)} if weights else set())
    hidden = [os.path.join(fw.path, n) for n in _hidden(fw.path) if n not in taken]
    targets = ([weights] if weights else []) + own + named + hidden
    targets = _expand_dirs(targets, fw.path, acc)
    maybe |= set(hidden) | _under_hidden(targets, fw.path)
    what = f"{fw.layout.framework} folder ({fw.layout.name})"
    return _scan_targets(fw.path, weights, targets, acc, limits, what, maybe)


def _hidden(folder: str) -> list[str]:
    """A folder's hidden entries (``.optimizer.pt``, ``.cache/``, ``.git/``): torch.load reads them as well as any
    other file, so a scan looks at them too (as files named to hold no pickle: only a real one counts; a
    repository's objects, packs and hooks are none)."""
    return sorted(n for n in source.listdir(folder) if n.startswith(".") and n != ".metadata")


def _under_hidden(targets: list[str], root: str) -> set[str]:
    """The targets a hidden sub-folder's walk gave (scanned as "maybe" files: only a real pickle counts)."""
    return {t for t in targets if t != root and any(p.startswith(".") for p in _rel(t, root).split("/")[:-1])}


def scan_plain_folder(url: str, limits: PickleLimits | None = None) -> ScanReport | None:
    """A folder no framework layout claims, local or at a URL (``hf://``, ``s3://.../``): every pickle-bearing
    file in it (the same rule as :func:`_scan_folder`), not only the weights an index names; None for a DCP
    directory (its own scan covers every file of it).

    Args:
        url: the folder's path or URL.
        limits: resource limits (default: from ``CKPTFIX_MAX_PICKLE_*``).

    Returns:
        The folder's :class:`ScanReport` (one ``files`` entry per file), or None for a DCP directory.
    """
    from ckptfix.formats import classify_or_none

    inp = classify_or_none(url)
    if inp is not None and inp.format == Format.DCP:
        return None
    return _scan_plain(url, inp, limits or PickleLimits.from_env())


def _scan_plain(url: str, inp: Input | None, limits: PickleLimits) -> ScanReport:
    from ckptfix.formats.roles import file_role

    names, odd = source.listdir_all(url)
    skip: set[str] = set()
    weights = None
    if inp is not None and inp.format == Format.SHARDED:
        from ckptfix.formats.sharded import load_index

        idx = load_index(inp.path)
        weights = idx.path
        skip = set(idx.shards) | {source.basename(idx.path)}
    acc = _Acc(None)
    _left_unaddressable(acc, "", odd)
    rest = [n for n in names if n not in skip and n != ".metadata"]
    maybe = {source.join(url, n) for n in rest if n.startswith(".") or not bears_pickles(n, file_role(n))}
    targets = ([weights] if weights else []) + [source.join(url, n) for n in rest]
    targets = _expand_dirs(targets, url, acc)
    maybe |= _under_hidden(targets, url)
    return _scan_targets(url, weights, targets, acc, limits, "folder", maybe)


def _left_unaddressable(acc: "_Acc", folder: str, names: list[str]) -> None:
    """Objects a store lists under names no URL of the folder can address: not read, so the verdict is unknown
    (a recursive download writes them into its copy, where torch.load reads them)."""
    for n in names:
        acc.left_out(
            f"{folder}/{n}" if folder else n,
            "an object whose name no URL of this folder can address ('..', '#', '?', '\\' ...); not read: "
            "download the folder and scan the copy",
        )


def _rel(t: str, root: str) -> str:
    if t == root:
        return "."
    if source.is_url(root):
        return t[len(root.rstrip("/")) + 1 :]
    return os.path.relpath(t, root)


def _scan_targets(
    root: str,
    weights: str | None,
    targets: list[str],
    acc: _Acc,
    limits: PickleLimits,
    what: str,
    maybe: set[str] | None = None,
) -> ScanReport:
    """Scan each of a folder's ``targets``: every pickle counts, and each file gets its own entry (verdict).

    ``maybe``: files whose name says they hold no pickle (text, configs, tokenizer files, hidden files): they are
    reported only when they are one all the same (``pickle.load`` reads a protocol-0 pickle named
    ``tokenizer.json``), and skipped otherwise.
    """
    maybe = maybe or set()
    from ckptfix.errors import CheckpointNotFoundError, UnsupportedError

    fmt = Format.PICKLE
    scanned = 0
    files: dict[str, dict[str, Any]] = {}
    for t in targets:
        label = _rel(t, root)
        is_dir = source.isdir(t)
        if not is_dir and not source.isfile(t):
            if not source.is_url(t) and os.path.islink(t) and not os.path.exists(t):
                acc.notes.append(f"{label}: a dangling link (nothing to load); not read")
            elif source.is_url(t):  # listed, yet the store says no such object (a HEAD answering 404 ...)
                acc.left_out(label, "listed by the folder, but the store answers no such object for it; not read")
            else:  # a FIFO or a device: torch.load reads what it gives
                acc.left_out(label, "not a regular file (a FIFO or a device); not read")
            continue
        if t != weights and not is_dir and source.getsize(t) == 0:
            continue
        if t != weights and not is_dir and (t in maybe or t.endswith(_TEXT_EXTS)):
            sub = _pickle_anyway(t, limits)
            if sub is None and not _opens_like_zip(t):
                continue  # text, JSON, a tokenizer's vocabulary: nothing a loader unpickles
            # a zip under a text name: torch.load opens any file starting PK\x03\x04 as its archive, so it is
            # read as a checkpoint below (one that fails the zip checks is malformed, never left out)
        else:
            sub = None if is_dir else _numpy_file(t, limits)
        if sub is None:
            try:
                sub = _scan_one(classify(t), limits)
            except CkptfixError as e:
                bare = None if is_dir else _bare_pickle(t, limits)
                if bare is not None:  # a pickle of protocol 0/1 (no b"\x80" header): torch.load still unpickles it
                    sub = bare
                elif isinstance(e, UnsupportedError) or t == weights:
                    raise  # a member linking outside the folder, or the weights themselves: as if scanned alone
                elif isinstance(e, CheckpointNotFoundError) and is_dir or not is_dir and _text_file(t):
                    continue  # a sub-folder that is no checkpoint (logs ...), a text file (DeepSpeed's `latest`)
                else:
                    acc.errors.append(f"{label}: {e}")
                    files[label] = {
                        "verdict": "malformed",
                        "format": None,
                        "dangerous": [],
                        "unknown": [],
                        "errors": [str(e)],
                    }
                    continue
        if t == weights or weights is None and not files:
            fmt = sub.format
        files[label] = sub.file_entry()
        acc.merge(label, sub)
        if not is_dir or t == root:  # a file's labels already name it: no "f.pt:f.pt:data.pkl"
            n, base = len(sub.pickles), source.basename(t)
            relabel = [label + q[len(base) :] if q.startswith(base) and t != root else q for q in sub.pickles]
            acc.pickles[-n or len(acc.pickles) :] = relabel if n else []
            acc.errors = [e.split(":", 1)[1] if e.startswith(label + ":") else e for e in acc.errors]
        scanned += 1
    for label, why in acc.skipped.items():
        files[label] = {"verdict": "unknown", "format": None, "dangerous": [], "unknown": [why], "errors": []}
    left = f", {len(acc.skipped)} left out (unknown)" if acc.skipped else ""
    acc.notes.append(f"{what}: {scanned} checkpoint file(s) scanned{left}")
    globals_ = dict(sorted(acc.globals.items()))
    return ScanReport(
        path=root, format=fmt, pickles=acc.pickles, globals=globals_, errors=acc.errors, notes=acc.notes, files=files
    )


_NPY_MAGIC = b"\x93NUMPY"


def _opens_like_zip(path: str) -> bool:
    """Whether ``torch.load`` would take the file for its zip archive (its first bytes are a local header)."""
    with source.open_file(path) as f:
        return f.read(4) == b"PK\x03\x04"


def _numpy_file(path: str, limits: PickleLimits) -> ScanReport | None:
    """The scan of a numpy ``.npy`` (or ``.npz``) file: an object array is a pickle that ``np.load(...,
    allow_pickle=True)`` unpickles (every global it names counts); None for a file that is neither."""
    with source.open_file(path) as f:
        head = f.read(8)
    base = source.basename(path)
    acc = _Acc(None)
    if head.startswith(_NPY_MAGIC):
        with source.open_file(path) as f:
            _scan_npy(f, base, acc, limits)
    elif path.endswith(".npz") and head.startswith(b"PK"):
        try:
            with source.open_file(path) as f, zipfile.ZipFile(f) as zf:
                for info in zf.infolist():
                    if info.file_size > limits.max_bytes + (64 << 10):
                        acc.unknown(f"{base}:{info.filename}", "a member over the pickle limit; not scanned")
                        continue
                    with zf.open(info) as fh:
                        _scan_npy(
                            io.BytesIO(fh.read(limits.max_bytes + (64 << 10))), f"{base}:{info.filename}", acc, limits
                        )
        except Exception as e:  # noqa: BLE001 - a damaged archive is reported, never a crash
            acc.errors.append(f"{base}: damaged npz archive ({type(e).__name__}: {e})")
    else:
        return None
    return ScanReport(
        path=path,
        format=Format.PICKLE,
        pickles=acc.pickles,
        globals=dict(sorted(acc.globals.items())),
        errors=acc.errors,
        notes=acc.notes,
    )


def _scan_npy(f: Any, label: str, acc: _Acc, limits: PickleLimits) -> None:
    """One ``.npy`` stream: its header (a Python literal, read with ``ast.literal_eval``), then, for an object
    dtype, the pickle numpy unpickles (scanned: every pickle in the rest of the stream)."""
    import ast

    head = f.read(10)
    if not head.startswith(_NPY_MAGIC) or len(head) < 10:
        acc.unknown(label, "not a numpy .npy stream (np.load with allow_pickle=True unpickles such a file)")
        return
    major = head[6]
    if major == 1:
        (hlen,) = struct.unpack("<H", head[8:10])
    else:
        head += f.read(2)
        (hlen,) = struct.unpack("<I", head[8:12])
    if hlen > 1 << 20:
        acc.unknown(label, f"a {hlen}-byte .npy header (numpy reads at most 10 KB unless told otherwise)")
        return
    text = f.read(hlen)
    try:
        header = ast.literal_eval(text.decode("latin1"))
        descr = header["descr"]
    except Exception:  # noqa: BLE001 - numpy refuses it too; the verdict is never safe
        acc.unknown(label, "an unreadable .npy header")
        return
    if not _npy_has_objects(descr):
        return  # a plain array: no pickle
    rest = f.read(limits.max_bytes + 1)
    _, parts = scan_pickle_sequence(rest, limits=limits)
    acc.add_sequence(label, parts, len(rest))
    acc.notes.append(f"{label}: an object array: np.load(allow_pickle=True) unpickles it")


def _npy_has_objects(descr: Any) -> bool:
    """Whether a numpy ``descr`` has object fields (numpy pickles such arrays)."""
    if isinstance(descr, str):
        return "O" in descr
    if isinstance(descr, (list, tuple)):
        return any(_npy_has_objects(d) for d in descr)
    return True  # anything else numpy's header parser would reject: never called safe


def _pickle_anyway(path: str, limits: PickleLimits) -> ScanReport | None:
    """The scan of a file named as if it held no pickle, when it is one all the same (a checkpoint, a numpy
    object array, a bare pickle); None otherwise."""
    sub = _numpy_file(path, limits)
    if sub is not None:
        return sub
    try:
        return _scan_one(classify(path), limits)
    except CkptfixError:
        return _bare_pickle(path, limits)


def _bare_pickle(path: str, limits: PickleLimits) -> ScanReport | None:
    """The scan of a file that is a complete pickle sequence (or names any global), else None."""
    acc = _Acc(None)
    try:
        scan_legacy(path, acc, limits)
    except (CkptfixError, OSError, ValueError):
        return None
    if acc.errors and not any(not g.startswith("<") for g in acc.globals):
        return None
    return ScanReport(path=path, format=Format.PICKLE, pickles=acc.pickles, globals=acc.globals, errors=acc.errors)


def _text_file(path: str) -> bool:
    from ckptfix.formats import _looks_like_text

    with source.open_file(path) as f:
        return _looks_like_text(f.read(512))


#: the deepest sub-folder a folder's scan walks into (a folder's own files are depth 1); a folder deeper than that
#: is left out and makes the verdict unknown, naming it
MAX_FOLDER_DEPTH = 32

#: the most entries (files and sub-folders) a folder's scan walks; past that the rest is left out and the verdict
#: is unknown, naming where the walk stopped
MAX_FOLDER_ENTRIES = 100_000


def _expand_dirs(targets: list[str], root: str, acc: "_Acc") -> list[str]:
    """Sub-folders that are no checkpoint themselves (a DeepSpeed ``global_stepN/``) become the files in them, at
    any depth up to :data:`MAX_FOLDER_DEPTH`, at most :data:`MAX_FOLDER_ENTRIES` entries in all.

    What is not walked is left out (:meth:`_Acc.left_out`: the verdict is unknown, naming it), never dropped: a
    folder past the depth bound, the entries past the count bound, and a sub-folder that is a link resolving
    outside ``root`` (not the folder's own, and it may be ``/``).  A link to a folder already walked (inside
    ``root``) is not walked twice.  ``root`` may be a URL (a remote folder: no links).
    """
    out: list[str] = []
    remote = source.is_url(root)
    real_root = root if remote else os.path.realpath(root)
    seen = {real_root}
    entries = 0
    stack = [(t, 1) for t in reversed(targets)]
    while stack:
        t, depth = stack.pop()
        entries += 1
        if entries > MAX_FOLDER_ENTRIES:
            left = [t] + [s for s, _ in reversed(stack)]
            acc.left_out(
                _rel(t, root),
                f"the walk stopped at the scan's limit of {MAX_FOLDER_ENTRIES} entries; {len(left)} more entr(ies) "
                f"from here on were not scanned ({', '.join(_rel(x, root) for x in left[:3])}"
                + (" ..." if len(left) > 3 else "")
                + "): scan the sub-folders one by one",
            )
            break
        if t == root or not source.isdir(t):
            out.append(t)
            continue
        label = _rel(t, root)
        if not remote:
            real = os.path.realpath(t)
            if not (real + os.sep).startswith(real_root + os.sep):
                acc.notes.append(f"{label}: a link to a folder outside it ({real}); not followed")
                acc.left_out(label, f"a link to a folder outside the folder ({real}); not followed, not scanned")
                continue
            if real in seen:
                acc.notes.append(f"{label}: a link to a folder scanned already ({os.path.relpath(real, real_root)})")
                continue
            seen.add(real)
        names, odd = source.listdir_all(t)
        _left_unaddressable(acc, label, odd)
        if (
            ".metadata" in names
            and source.isfile(source.join(t, ".metadata"))
            or any(n.endswith(".index.json") for n in names)
        ):
            out.append(t)  # a DCP directory or a sharded folder: scanned as one checkpoint
        elif depth >= MAX_FOLDER_DEPTH:
            if names:
                acc.left_out(
                    label,
                    f"a folder whose {len(names)} entr(ies) lie {depth + 1} levels down, past the scan's limit of "
                    f"{MAX_FOLDER_DEPTH} levels; not scanned: scan that folder on its own",
                )
        else:
            stack += [(source.join(t, n), depth + 1) for n in reversed(names)]
    return out


def global_context(fmt: Format) -> str | None:
    """The container a global is judged in (DCP metadata and TorchScript allow their own classes).

    Args:
        fmt: the checkpoint's format.

    Returns:
        ``"dcp"``, ``"torchscript"`` or None (:func:`ckptfix.pickles.policy.classify_global`'s ``context``).
    """
    return {Format.DCP: "dcp", Format.TORCHSCRIPT: "torchscript"}.get(fmt)


_context = global_context


def scan_archive(path: str, acc: _Acc, limits: PickleLimits) -> None:
    with source.open_file(path) as f:
        _scan_zip(f, os.path.basename(path), acc, limits)


def scan_torchscript(path: str, acc: _Acc, limits: PickleLimits) -> None:
    """A TorchScript archive: its pickles, and its code, which ``torch.jit.load`` runs (``inspect`` says the
    same): never "safe"."""
    base = os.path.basename(path)
    with source.open_file(path) as f:
        _scan_zip(f, base, acc, limits)
    acc.unknown(
        base,
        "a TorchScript archive: torch.jit.load compiles and runs its code (torch.load hands the archive to it); "
        "load it only if you trust it",
    )


def scan_safetensors(path: str, acc: _Acc, limits: PickleLimits) -> None:
    read_checkpoint(path, Format.SAFETENSORS)  # validates the JSON header; no pickle inside


def scan_tar(path: str, acc: _Acc, limits: PickleLimits) -> None:
    """The pickles torch's tar loader runs first: ``storages`` and ``tensors`` (their opening pickle) and
    ``pickle`` (the object); the per-storage records that follow are not walked, so never "safe"."""
    import tarfile

    from ckptfix.formats.sniffing import _Capped

    base = os.path.basename(path)
    acc.unknown(
        base,
        "a pre-0.4 tar checkpoint: torch.load unpickles one record per storage and tensor; ckptfix scans "
        "only the first pickle of each member",
    )
    try:
        with source.open_file(path) as f, tarfile.open(fileobj=_Capped(f), mode="r:") as tar:
            for name in ("storages", "tensors", "pickle"):  # the order torch reads them in
                try:
                    info = tar.getmember(name)  # the last member of that name, as tar.extract takes it
                except KeyError:
                    continue
                if info.size > limits.max_bytes:
                    acc.unknown(f"{base}:{name}", f"a {info.size >> 20} MiB member, over the pickle limit")
                    continue
                fh = tar.extractfile(info)
                if fh is None:
                    continue
                acc.add_result(f"{base}:{name}", scan_globals(fh.read(limits.max_bytes), limits=limits))
    except Exception as e:  # noqa: BLE001 - a damaged archive is reported, never a crash
        acc.errors.append(f"{base}: damaged tar archive ({type(e).__name__}: {e})")


def scan_package(path: str, acc: _Acc, limits: PickleLimits) -> None:
    """Every pickle of a torch.package archive; its packaged Python code is never "safe"."""
    base = os.path.basename(path)
    with source.open_file(path) as f:
        _scan_zip(f, base, acc, limits)
    try:
        with source.open_file(path) as f, zipfile.ZipFile(f) as zf:
            code = [n for n in zf.namelist() if n.endswith(".py")]
    except Exception:  # noqa: BLE001 - already reported by the scan above
        code = []
    acc.notes.append(
        f"{base}: a torch.package archive (a packaged model with its code): load it with "
        "torch.package.PackageImporter only if you trust it"
    )
    if code:
        acc.unknown(
            base,
            f"{len(code)} packaged Python module(s) ({', '.join(code[:3])}{' ...' if len(code) > 3 else ''}) "
            "that PackageImporter runs when a pickle imports them",
        )
    # PackageImporter resolves a pickle's globals in the package first: a global whose module is packaged
    # (even one named like collections or torch._utils) imports, so runs, that packaged code
    packaged = set()
    for n in code:
        mod = n.split("/", 1)[1] if "/" in n else n
        mod = mod[: -len(".py")].removesuffix("/__init__").replace("/", ".")
        packaged.add(mod)
    for g, d in list(acc.globals.items()):
        mod = g.rsplit(".", 1)[0]
        if any(mod == p or mod.startswith(p + ".") for p in packaged):
            d["class"] = "dangerous"


def _scan_other_readings(path: str, kind: Format, acc: _Acc, limits: PickleLimits) -> None:
    """Scan the ways other readers could read the same bytes (a polyglot): the worst counts.

    A tar or safetensors file whose bytes also start a pickle is scanned as that pickle too; a pickle
    with a zip archive appended, as that archive.  Only the globals each reading would import count
    (a reading that fails part way is no finding by itself).
    """
    from ckptfix.formats import sniffing

    if not source.isfile(path):
        return
    base = os.path.basename(path)
    # (a file opening with PK\x03\x04 fails as a pickle at its first opcode, PERSID, before importing anything)
    if kind in (Format.TORCH_TAR, Format.SAFETENSORS) and sniffing.starts_like_pickle(path):
        with source.open_file(path) as f:
            _, parts = scan_pickle_sequence(f, limits=limits)
        if len(parts) == 1 and parts[0].error and not parts[0].pairs and not parts[0].unresolved:
            parts = []  # pickle.load fails at once, importing nothing (a header length that reads as PROTO n)
        for i, r in enumerate(parts):
            label = f"{base} read as a pickle" + (f"[{i}]" if i else "")
            acc.add_result(label, ScanResult(pairs=r.pairs, unresolved=r.unresolved))
        if parts:
            acc.notes.append(
                f"{base}: the bytes are also a pickle (a polyglot): torch.load reads it as {kind}, "
                "pickle.load would unpickle it; both readings were scanned"
            )
    if kind in (Format.TORCH_ZIP, Format.TORCHSCRIPT, Format.TORCH_PACKAGE):
        try:
            tar = sniffing.tar_opens(path)
        except CkptfixError as e:
            acc.unknown(base, f"read as a tar archive: {e}")
            tar = False
        if tar:  # torch reads the zip; torch before 1.6 (and tarfile) the tar
            scan_tar(path, acc, limits)
            acc.notes.append(f"{base}: the bytes are also a tar archive (a polyglot); both readings were scanned")
    if kind in (Format.PICKLE, Format.TORCH_LEGACY, Format.SAFETENSORS) and sniffing.zip_appended(path):
        sub = _Acc(acc.context)
        with source.open_file(path) as f:
            _scan_zip(f, f"{base} read as a zip", sub, limits)
        for g, d in sub.globals.items():
            acc._add(g, d["class"], d["count"])
        acc.pickles += sub.pickles
        acc.notes.append(
            f"{base}: a zip archive is appended (a polyglot): torch.load reads the start, zip readers "
            "the archive; both were scanned"
        )
