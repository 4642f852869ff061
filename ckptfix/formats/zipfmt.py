"""The torch zip container (``torch.save`` since 1.6, and ``torch.jit.save``) without torch.

Reading: the central directory gives every member; each tensor storage is
``<root>/data/<key>``, stored uncompressed, so its bytes are a plain byte
range of the file.  ``<root>/data.pkl`` is read with the restricted reader.

Writing: :class:`AlignedZipWriter` writes a torch-loadable archive whose
records start on 64-byte boundaries (what torch's ``mmap=True`` loader needs),
copying unchanged records straight from the source file with
``os.copy_file_range`` and reusing their CRCs, so no tensor byte passes
through Python.
"""

from __future__ import annotations

import os
import re
import struct
import zipfile
import zlib
from typing import Any, BinaryIO

from ckptfix.errors import CorruptCheckpointError, ResourceLimitError, UnsupportedError
from ckptfix.files import pagecache, pins, source
from ckptfix.files.fileio import FOLIO, ZIP_ERRORS, copy_range
from ckptfix.formats.base import CheckpointFile, Format, Member, TorchScriptDetails, ZipDetails, env_mib
from ckptfix.pickles import RecordingUnpickler, StorageRecord, Stub, TensorRecord, global_name
from ckptfix.pickles.jitenum import tuple_enum_reduces
from ckptfix.pickles.opcodes import DEFAULT_MAX_PICKLE_MB

ALIGN = 64

#: environment variable (MiB) that lifts the cap on the pickle and other small records of an archive
MAX_PICKLE_ENV = "CKPTFIX_MAX_PICKLE_MB"


def max_pickle_bytes() -> int:
    """The most bytes ckptfix inflates from one archive's pickles and text records (``CKPTFIX_MAX_PICKLE_MB``).

    Returns:
        The limit in bytes (the environment variable, in MiB, or 256 MiB).

    Raises:
        ResourceLimitError: the environment variable is not a positive number.
    """
    return env_mib(MAX_PICKLE_ENV, DEFAULT_MAX_PICKLE_MB)


#: ``_STORED``
_STORED = 0


def _open_zip(path: str) -> zipfile.ZipFile:
    """``zipfile.ZipFile(path)``, its errors as ckptfix's."""
    try:
        return zipfile.ZipFile(source.open_file(path) if source.is_url(path) else pins.path_for(path))
    except zipfile.BadZipFile as e:
        raise CorruptCheckpointError(
            f"{path}: damaged zip archive ({e}); the file is truncated or corrupt — re-copy or re-save it"
        ) from None
    except ZIP_ERRORS as e:
        raise CorruptCheckpointError(
            f"{path}: unreadable zip archive ({type(e).__name__}: {e}); the file is corrupt"
        ) from None


def zip_kind(path: str) -> Format:
    """Tell a ``torch.save`` archive from a ``torch.jit.save`` one by its member names.

    Args:
        path: a zip file.

    Returns:
        :attr:`Format.TORCHSCRIPT` (a ``code/`` folder or ``constants.pkl``), :attr:`Format.TORCH_PACKAGE`
        (``.data/version`` and ``.data/extern_modules``: a ``torch.package`` archive) or :attr:`Format.TORCH_ZIP`.

    Raises:
        CorruptCheckpointError: a damaged archive, ambiguous member names, or no ``data.pkl``.
    """
    with _open_zip(path) as zf:
        try:
            names = zf.namelist()
            first = min((i.header_offset for i in zf.infolist()), default=0)
        except ZIP_ERRORS as e:
            raise CorruptCheckpointError(f"{path}: damaged zip directory ({e})") from None
    if first != 0:  # zipfile skips data put before an archive; torch's reader (miniz) does not
        raise CorruptCheckpointError(
            f"{path}: {first} bytes of other data come before the zip archive (an archive inside another "
            "file, or two joined): zipfile and torch's reader would read different archives; refused as corrupt "
            "or crafted — re-save it with torch.save"
        )
    check_names(path, names)
    root = names[0].split("/", 1)[0] + "/" if names and "/" in names[0] else ""
    if root + "constants.pkl" not in names and {root + ".data/version", root + ".data/extern_modules"} <= set(names):
        return Format.TORCH_PACKAGE  # torch.package.PackageExporter (torch.load finds no data.pkl in it)
    if any(n.endswith("/constants.pkl") or "/code/" in n for n in names):
        return Format.TORCHSCRIPT
    if any(n == "data.pkl" or n.endswith("/data.pkl") for n in names):
        return Format.TORCH_ZIP
    if root + "archive_format" in names and any(n.startswith(root + "models/") for n in names):
        raise UnsupportedError(  # torch.export.save's PT2 archive (graph JSON, raw weight files), not torch.save's
            f"{path}: a torch.export program (a .pt2 archive: graph, weights and constants); load it "
            "with torch.export.load(path) and take .state_dict of the ExportedProgram (then ckptfix convert that)"
        )
    raise CorruptCheckpointError(f"{path}: a zip archive without data.pkl — not a torch checkpoint")


def check_names(path: str, names: list[str]) -> None:
    """Refuse member names that two zip readers could resolve to different records.

    torch's reader (miniz) looks names up case-insensitively and, for a name listed twice, may
    return either entry, while :mod:`zipfile` returns the last one: the scanner and the loader would
    then read different pickles.  Names that differ only in case, repeated names, absolute names and
    names with ``..`` or backslashes are all refused.

    Args:
        path: the archive (for the message).
        names: its member names, in archive order.

    Raises:
        CorruptCheckpointError: a name is repeated or ambiguous.
    """
    seen: dict[str, str] = {}
    for n in names:
        folded = n.casefold()
        if folded in seen:
            what = "twice" if seen[folded] == n else f"twice, as {seen[folded]!r} and {n!r} (torch ignores case)"
            raise CorruptCheckpointError(
                f"{path}: the archive lists member {n!r} {what}; torch and other readers "
                "would read different data, so the file is refused as corrupt or "
                "crafted — re-save it with torch.save"
            )
        seen[folded] = n
        if n.startswith("/") or "\\" in n or "\x00" in n or ".." in n.split("/"):
            raise CorruptCheckpointError(
                f"{path}: the archive has a member named {n!r} (absolute, '..', "
                "backslash or NUL); not a torch checkpoint — refused"
            )


def members(path: str, zf: zipfile.ZipFile) -> dict[str, Member]:
    """Every member of the archive with the absolute offset of its data, checked against the local headers.

    Args:
        path: the archive file.
        zf: the same archive, open.

    Returns:
        Member name -> :class:`Member`, in archive order.

    Raises:
        CorruptCheckpointError: repeated or ambiguous names (see :func:`check_names`), a local header
            that does not match the central directory, or an entry past the end of the file.
    """
    out: dict[str, Member] = {}
    size = source.getsize(path)
    infos = zf.infolist()
    check_names(path, [i.filename for i in infos])
    check_inflation(path, zf)
    skip_records = source.is_url(path) and source.is_metadata_only(path)  # inspect of a URL: offsets unused
    root = root_of([i.filename for i in infos])
    heads = _local_headers(path, infos, size, skip_records, root)
    for info in infos:
        hdr = heads.get(info.header_offset, b"")
        if not hdr and skip_records and _is_record(info.filename, root):
            out[info.filename] = Member(  # not read (inspect of a URL): no offset, never used there
                info.filename, -1, info.file_size, info.CRC, info.compress_type != _STORED
            )
            continue
        if len(hdr) < 30 or hdr[:4] != b"PK\x03\x04":
            raise CorruptCheckpointError(f"{path}: damaged zip entry {info.filename!r}; the file is corrupt")
        nlen, elen = struct.unpack("<HH", hdr[26:30])
        raw_name = hdr[30 : 30 + nlen]
        want = info.orig_filename.encode("utf-8" if info.flag_bits & 0x800 else "cp437", "replace")
        if raw_name != want:
            raise CorruptCheckpointError(
                f"{path}: zip entry {info.filename!r} is named {raw_name!r} in its "
                "local header; the names disagree, so readers would differ — the file "
                "is corrupt or crafted"
            )
        off = info.header_offset + 30 + nlen + elen
        if off + info.compress_size > size:
            raise CorruptCheckpointError(
                f"{path}: entry {info.filename!r} runs past the end of the file (truncated download or copy?)"
            )
        out[info.filename] = Member(info.filename, off, info.file_size, info.CRC, info.compress_type != _STORED)
    return out


def _local_headers(
    path: str, infos: list[zipfile.ZipInfo], size: int, skip_records: bool, root: str
) -> dict[int, bytes]:
    """Each member's local header (30 bytes and up to twice its name's length) by header offset, the tensor
    records' left out with ``skip_records``.  A URL's: :meth:`~ckptfix.files.source.Source.read_ranges` (neighbours
    share a request, requests run in parallel); a local file's: :func:`~ckptfix.files.pagecache.read_scattered` (spread
    over the file, pages a cold read brings in would break the readahead of the copy that follows)."""
    ranges = sorted(
        {
            (i.header_offset, min(30 + len(i.orig_filename.encode("utf-8")) * 2, size - i.header_offset))
            for i in infos
            if not (skip_records and _is_record(i.filename, root)) and i.header_offset < size
        }
    )
    if source.is_url(path):
        with source.open_source(path) as src:
            # exact: the records' bytes between the headers are fetched by the copy; fetched here too, a zip of
            # many sub-MiB tensors would cost twice its size
            return dict(src.read_ranges(ranges, jobs=16, exact=True))
    fd = pins.open_fd(path)
    try:
        return pagecache.read_scattered(fd, ranges)
    finally:
        os.close(fd)


def _is_record(name: str, root: str) -> bool:
    """A tensor record of a torch archive (``<root>data/<key>``): the archive folder or a code package may
    itself be named ``data`` (``data/code/__torch__/data/nets.py`` is TorchScript code, not a record)."""
    head = root + "data/"
    return name.startswith(head) and "/" not in name[len(head) :] and not name.endswith(".pkl")


def root_of(names: list[str], leaf: str = "data.pkl") -> str:
    """The archive folder holding ``leaf``: a top-level folder first, else any, else ``""``.

    Args:
        names: the archive's member names.
        leaf: the record to look for.

    Returns:
        The folder with its trailing ``/``, or ``""`` (at the top, or absent).
    """
    for n in names:
        if n == leaf:
            return ""
        if n.endswith("/" + leaf) and n.count("/") == 1:
            return n[: -len(leaf)]
    for n in names:
        if n.endswith("/" + leaf):
            return n[: -len(leaf)]
    return ""


def torch_root(path: str, names: list[str]) -> str:
    """The archive folder torch's reader uses (the first entry's folder), checked to hold data.pkl.

    Args:
        path: the archive (for the message).
        names: its member names, in archive order.

    Returns:
        The folder with its trailing ``/`` (``""`` at the top, or when there is no data.pkl at all).

    Raises:
        CorruptCheckpointError: torch would read another data.pkl than the one ckptfix finds.
    """
    root = root_of(names)
    if root + "data.pkl" not in names:
        return root  # no data.pkl at all: the caller says so
    if "/" in names[0]:
        first = names[0].split("/", 1)[0] + "/"
        if first != root:
            raise CorruptCheckpointError(
                f"{path}: the archive's first entry is in {first!r} but data.pkl is in "
                f"{root or './'!r}; torch would read another record than ckptfix — the "
                "file is corrupt or crafted"
            )
    if root and (stray := next((n for n in names if not n.startswith(root)), None)) is not None:
        # torch's reader refuses it ("file in archive is not in a subdirectory"): a second archive inside
        raise CorruptCheckpointError(
            f"{path}: the entry {stray!r} is outside the archive folder {root!r}; torch refuses such a file "
            "(a second archive hidden in the zip?) — the file is corrupt or crafted"
        )
    return root


def check_inflation(path: str, zf: zipfile.ZipFile, *, records: bool = True) -> None:
    """Refuse an archive whose compressed members declare more than ``CKPTFIX_MAX_PICKLE_MB`` in all.

    torch.save stores every record uncompressed; compressed members are small text or pickles at
    most, so a large declared size is a zip bomb, refused before anything is inflated.  With
    ``records`` a compressed tensor record (``<root>/data/<key>``) is refused as unsupported;
    without, such records are left out (a scan never reads them).

    Args:
        path: the archive (for the message).
        zf: the archive, open.
        records: refuse compressed tensor records too.

    Raises:
        ResourceLimitError: naming the largest compressed member and the variable that lifts the limit.
        UnsupportedError: a compressed tensor record (with ``records``).
    """
    infos = zf.infolist()
    root = root_of([i.filename for i in infos])
    packed = [i for i in infos if i.compress_type != _STORED]
    rec = [i for i in packed if _is_record(i.filename, root)]
    if rec and records:
        raise UnsupportedError(
            f"{path}: tensor record {rec[0].filename!r} is compressed (the archive was re-zipped "
            "with compression; torch.save stores records uncompressed, which ckptfix needs to read "
            "tensors in place); re-zip it uncompressed (zip -0) or load it with torch.load and "
            "torch.save it again"
        )
    packed = [i for i in packed if i not in rec]
    if packed and sum(i.file_size for i in packed) > max_pickle_bytes():
        big = max(packed, key=lambda i: i.file_size)
        raise _too_big(path, big.filename, big.file_size)


def read_member(path: str, zf: zipfile.ZipFile, name: str, budget: list[int]) -> bytes:
    """One (small) member's bytes, inflated at most ``budget[0]`` bytes, which is decreased.

    The declared size is checked before anything is inflated, and inflation goes in bounded steps
    (``ZipFile.read`` can inflate GiB in one call before truncating to the declared size).

    Args:
        path: the archive (for the message).
        zf: the archive, open.
        name: the member.
        budget: a one-element list, the bytes left to inflate; decreased by what was read.

    Returns:
        The member's bytes.

    Raises:
        ResourceLimitError: the member (with what was read before) exceeds ``CKPTFIX_MAX_PICKLE_MB``.
        CorruptCheckpointError: the member is damaged.
    """
    info = zf.getinfo(name)
    if info.file_size > budget[0]:
        raise _too_big(path, name, info.file_size)
    parts: list[bytes] = []
    got = 0
    try:
        with zf.open(info) as fp:
            while True:
                chunk = fp.read(1 << 20)
                if not chunk:
                    break
                got += len(chunk)
                if got > budget[0]:
                    raise _too_big(path, name, got)
                parts.append(chunk)
    except ResourceLimitError:
        raise
    except ZIP_ERRORS + (UnicodeDecodeError, RuntimeError) as e:
        raise CorruptCheckpointError(
            f"{path}: record {name!r} is damaged ({type(e).__name__}: {e}); the file is corrupt — re-copy or re-save it"
        ) from None
    budget[0] -= got
    return b"".join(parts)


def _too_big(path: str, name: str, n: int) -> ResourceLimitError:
    limit = max_pickle_bytes() >> 20
    return ResourceLimitError(
        f"{path}: record {name!r} inflates to {n} bytes or more, over the {limit} MiB limit for "
        f"pickles and small records (a zip bomb?); if you trust the file, raise it with "
        f"{MAX_PICKLE_ENV}=<MiB>"
    )


def read_zip(path: str, kind: Format = Format.TORCH_ZIP) -> CheckpointFile:
    """Read a torch zip archive: ``data.pkl`` with the restricted reader, every storage's byte range.

    Args:
        path: the archive.
        kind: :attr:`Format.TORCH_ZIP`, or :attr:`Format.TORCHSCRIPT` to also derive the state dict
            from the archive's ``code/`` (see :func:`torchscript_state_dict`).

    Returns:
        A :class:`CheckpointFile` with :class:`ZipDetails` (:class:`TorchScriptDetails` for TorchScript).

    Raises:
        CorruptCheckpointError: a damaged archive, missing or truncated storages, ambiguous names.
        UnsupportedError: a compressed tensor record.
        ResourceLimitError: records that inflate past ``CKPTFIX_MAX_PICKLE_MB``.
    """
    try:
        return _read_zip(path, kind)
    except (CorruptCheckpointError, UnsupportedError, ResourceLimitError):
        raise
    except ZIP_ERRORS as e:
        raise CorruptCheckpointError(
            f"{path}: damaged zip archive ({type(e).__name__}: {e}); the file is corrupt — re-copy or re-save it"
        ) from None


def _read_zip(path: str, kind: Format) -> CheckpointFile:
    with _open_zip(path) as zf:
        mem = members(path, zf)
        names = list(mem)
        root = torch_root(path, names)
        pkl_name = root + "data.pkl"
        if pkl_name not in mem:
            raise CorruptCheckpointError(f"{path}: no data.pkl in the archive; not a torch checkpoint")
        budget = [max_pickle_bytes()]
        data_pkl = read_member(path, zf, pkl_name, budget)
        byteorder = "little"
        if root + "byteorder" in mem:
            byteorder = read_member(path, zf, root + "byteorder", budget).decode("ascii", "replace")
            if byteorder not in ("little", "big"):  # exactly these bytes, as torch.load checks
                raise CorruptCheckpointError(
                    f"{path}: the archive's byteorder record says {byteorder[:20]!r} (torch writes 'little' or "
                    "'big'); the file is corrupt"
                )
        code_files = {
            n: read_member(path, zf, n, budget).decode("utf-8", "replace")
            for n in names
            if kind == Format.TORCHSCRIPT and n.startswith(root + "code/") and n.endswith(".py")
        }
    up = RecordingUnpickler.for_bytes(data_pkl)
    try:
        try:
            obj = up.load()
        except TypeError as e:
            # a TorchScript Enum value (GLOBAL, value, REDUCE: no argument tuple): read as a one-tuple
            fixed = tuple_enum_reduces(data_pkl) if kind == Format.TORCHSCRIPT and "must be a tuple" in str(e) else None
            if fixed is None:
                raise
            up = RecordingUnpickler.for_bytes(fixed)
            obj = up.load()
    except (CorruptCheckpointError, UnsupportedError, ResourceLimitError):
        raise
    except Exception as e:  # noqa: BLE001 - any other failure of the unpickler is corruption
        raise CorruptCheckpointError(
            f"{path}: data.pkl cannot be read ({type(e).__name__}: {e}); the checkpoint is corrupt"
        ) from None
    for key, rec in up.storages.items():
        _place_storage(path, key, rec, mem.get(f"{root}data/{key}"))
    notes = [f"byte order is {byteorder}"] if byteorder != "little" else []
    details: ZipDetails = ZipDetails(root=root, members=mem, data_pkl=data_pkl, byteorder=byteorder)
    if kind == Format.TORCHSCRIPT:
        ts_sd = None
        try:
            ts_sd = torchscript_state_dict(obj, code_files, root)
        except Exception as e:  # noqa: BLE001 - an archive torch.jit.save did not write: noted, still inspected
            notes.append(f"could not derive the TorchScript state_dict: {e}")
        details = TorchScriptDetails(root=root, members=mem, data_pkl=data_pkl, byteorder=byteorder, state_dict=ts_sd)
    return CheckpointFile(
        path=path,
        format=kind,
        obj=obj,
        storages=up.storages,
        globals_seen=dict(up.globals_seen),
        stubbed=set(up.stubbed),
        file_size=source.getsize(path),
        details=details,
        notes=notes,
    )


def big_endian_parts(cf: CheckpointFile) -> list[str]:
    """The files of ``cf`` (itself, or the shards of a sharded index) whose storages are big-endian.

    ``torch.save`` on a big-endian machine (s390x) writes a ``byteorder`` record ``big`` and every storage in
    that order; ``torch.load`` swaps the bytes on a little-endian one.  A torch-free reader that copies storage
    bytes must swap them too, or refuse (it never writes them as they are).

    Args:
        cf: a checkpoint read by :func:`ckptfix.formats.read_checkpoint`.

    Returns:
        The paths of its big-endian parts (empty for a little-endian checkpoint or another format).
    """
    from ckptfix.formats.base import ShardedDetails, ZipDetails

    d = cf.details
    if isinstance(d, ZipDetails):
        return [cf.path] if d.byteorder == "big" else []
    if isinstance(d, ShardedDetails):
        return [p for shard in d.shards.values() for p in big_endian_parts(shard)]
    return []


def _place_storage(path: str, key: str, rec: StorageRecord, m: Member | None) -> None:
    """Give storage ``key`` its byte range in the archive, checked against what its pickle declares."""
    if m is None:
        raise CorruptCheckpointError(f"{path}: storage {key!r} is referenced but missing from the archive")
    if m.compressed:
        raise UnsupportedError(
            f"{path}: storage {key!r} is a compressed zip record (the archive was re-zipped "
            "with compression; torch.save stores records uncompressed, which ckptfix needs "
            "to read tensors in place); re-zip it uncompressed (zip -0) or load it with "
            "torch.load and torch.save it again"
        )
    es = rec.element_size
    numel = rec.numel
    if numel is not None and (not isinstance(numel, int) or isinstance(numel, bool) or numel < 0):
        raise CorruptCheckpointError(
            f"{path}: storage {key!r} declares a size of {numel!r} elements; the checkpoint is corrupt"
        )
    need = numel * es if numel is not None else m.size
    if m.size < need:
        raise CorruptCheckpointError(
            f"{path}: storage {key!r} holds {m.size} bytes but its pickle declares "
            f"{numel} x {es} = {need}; the record is truncated or the checkpoint "
            "corrupt (torch.load refuses it too)"
        )
    if need % es:
        raise CorruptCheckpointError(
            f"{path}: storage {key!r} holds {m.size} bytes, not a whole number of "
            f"{rec.dtype} elements ({es} bytes each); the checkpoint is corrupt"
        )
    rec.file_offset, rec.nbytes, rec.source = m.data_offset, need, path
    rec.crc = m.crc if need == m.size else None  # the member's CRC covers exactly the storage's bytes


# --------------------------------------------------------------------------- TorchScript

#: the patterns of TorchScript code (compiled when an archive has code: a torch zip's start-up has none)
_CLASS_RE = r"class[ \t]+(\w+)[ \t]*\("
_LIST_START_RE = r"[ \t]+(__parameters__|__buffers__)[ \t]*=[ \t]*\["
_QUOTED_RE = r'"([^"\n]*)"'


def _script_members(code_files: dict[str, str], root: str) -> dict[str, tuple[list[str], list[str]]]:
    """qualified class name -> (parameter names, buffer names), from the archive's code/ files.

    One pass over the lines of each file (linear time whatever the input: an unclosed
    ``__parameters__ = [`` list runs to the end of its class once, it is never re-scanned).
    """
    class_re, list_start_re, quoted_re = re.compile(_CLASS_RE), re.compile(_LIST_START_RE), re.compile(_QUOTED_RE)
    out: dict[str, tuple[list[str], list[str]]] = {}
    for name, text in code_files.items():
        mod = name[len(root) + len("code/") : -3].replace("/", ".")
        current: tuple[list[str], list[str]] | None = None
        collecting: list[str] | None = None
        for line in text.split("\n"):
            if line and not line[:1].isspace():
                collecting = None  # a list never runs past its class
                m = class_re.match(line)
                if m:
                    current = out[f"{mod}.{m.group(1)}"] = ([], [])
                continue
            if current is None:
                continue
            rest = line
            if collecting is None:
                m = list_start_re.match(line)
                if not m:
                    continue
                collecting = current[0] if m.group(1) == "__parameters__" else current[1]
                rest = line[m.end() :]
            end = rest.find("]")
            collecting.extend(quoted_re.findall(rest if end < 0 else rest[:end]))
            if end >= 0:
                collecting = None
    return out


def torchscript_state_dict(obj: Any, code_files: dict[str, str], root: str) -> dict[str, Any]:
    """What ``torch.jit.load(f).state_dict()`` returns, as records, without running TorchScript.

    Each scripted module's ``__parameters__`` and ``__buffers__`` lists (in its class's ``code/``
    source) name the attributes of its pickled state that are parameters and buffers.

    Args:
        obj: the unpickled ``data.pkl`` (the top module, a placeholder).
        code_files: member name -> source of every ``<root>code/**.py`` member.
        root: the archive folder.

    Returns:
        Dotted name -> tensor record, in module order.
    """
    table = _script_members(code_files, root)
    out: dict[str, Any] = {}

    def visit(node: Any, prefix: str) -> None:
        if not isinstance(node, Stub):
            return
        cls = type(node)
        qual = global_name(cls)
        state = node.state if isinstance(node.state, dict) else {}
        params, bufs = table.get(qual, ([], []))
        for attr in list(params) + list(bufs):
            v = state.get(attr)
            if isinstance(v, TensorRecord):
                out[prefix + attr] = v
        for attr, v in state.items():
            if isinstance(v, Stub) and v.module.startswith("__torch__"):
                visit(v, f"{prefix}{attr}.")

    visit(obj, "")
    return out


# --------------------------------------------------------------------------- writing


def _dos_time() -> tuple[int, int]:
    return 0, (1980 - 1980) << 9 | 1 << 5 | 1  # 1980-01-01 00:00, deterministic


class AlignedZipWriter:
    """A minimal zip writer for torch archives: stored entries, data 64-byte aligned, zip64 when needed."""

    def __init__(self, fp: BinaryIO):
        self.fp = fp
        self.entries: list[tuple[bytes, int, int, int]] = []  # name, crc, size, header offset
        self.pos = fp.tell()

    def _local_header(self, name: bytes, crc: int, size: int) -> bytes:
        zip64 = size >= 0xFFFFFFFF
        extra = struct.pack("<HHQQ", 1, 16, size, size) if zip64 else b""
        base = 30 + len(name) + len(extra)
        pad = (-(self.pos + base + 4)) % ALIGN  # 4 = the padding field's own header
        extra += struct.pack("<HH", 0x4246, pad) + b"Z" * pad  # "FB" padding, as torch writes
        s32 = 0xFFFFFFFF if zip64 else size
        t, d = _dos_time()
        return (
            struct.pack(
                "<IHHHHHIIIHH", 0x04034B50, 45 if zip64 else 20, 0, 0, t, d, crc, s32, s32, len(name), len(extra)
            )
            + name
            + extra
        )

    def _start(self, name: str, crc: int, size: int) -> None:
        bname = name.encode("utf-8")
        hdr = self._local_header(bname, crc, size)
        self.entries.append((bname, crc, size, self.pos))
        self.fp.write(hdr)
        self.pos += len(hdr)

    def add_bytes(self, name: str, data: bytes) -> None:
        """Add a stored member holding ``data``.

        Args:
            name: the member name.
            data: its bytes.
        """
        self._start(name, zlib.crc32(data) & 0xFFFFFFFF, len(data))
        self.fp.write(data)
        self.pos += len(data)

    def add_copy(self, name: str, src_fd: int, offset: int, size: int, crc: int | None = None) -> None:
        """Copy ``size`` bytes at ``offset`` of ``src_fd`` into the archive without holding them in Python.

        Args:
            name: the member name.
            src_fd: the source file descriptor.
            offset: where the bytes start in the source.
            size: how many bytes.
            crc: their CRC-32 when known (a copied record's); None computes it while copying and
                patches it into the local header.

        Raises:
            OutputError: the output device is full.
            CorruptCheckpointError: the source ends early.
        """
        start = self.pos
        self._start(name, crc or 0, size)
        self.fp.flush()
        got = copy_range(src_fd, offset, self.fp.fileno(), self.pos, size, crc=crc is None)
        if crc is None:
            os.pwrite(self.fp.fileno(), struct.pack("<I", got), start + 14)  # the local header's CRC field
            self.entries[-1] = self.entries[-1][:1] + (got,) + self.entries[-1][2:]
        self.pos += size
        self.fp.seek(self.pos)

    def close(self) -> None:
        """Write the central directory (zip64 records when needed) and flush; the file stays open."""
        cd_start = self.pos
        out = bytearray()
        for name, crc, size, off in self.entries:
            need64 = size >= 0xFFFFFFFF or off >= 0xFFFFFFFF
            extra = b""
            if need64:
                vals = []
                if size >= 0xFFFFFFFF:
                    vals += [size, size]
                if off >= 0xFFFFFFFF:
                    vals.append(off)
                extra = struct.pack("<HH", 1, 8 * len(vals)) + struct.pack(f"<{len(vals)}Q", *vals)
            s32 = 0xFFFFFFFF if size >= 0xFFFFFFFF else size
            o32 = 0xFFFFFFFF if off >= 0xFFFFFFFF else off
            t, d = _dos_time()
            out += (
                struct.pack(
                    "<IHHHHHHIIIHHHHHII",
                    0x02014B50,
                    45 if need64 else 20,
                    45 if need64 else 20,
                    0,
                    0,
                    t,
                    d,
                    crc,
                    s32,
                    s32,
                    len(name),
                    len(extra),
                    0,
                    0,
                    0,
                    0,
                    o32,
                )
                + name
                + extra
            )
        self.fp.write(out)
        cd_size = len(out)
        end = cd_start + cd_size
        n = len(self.entries)
        if n >= 0xFFFF or cd_start >= 0xFFFFFFFF or cd_size >= 0xFFFFFFFF:
            self.fp.write(struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, n, n, cd_size, cd_start))
            self.fp.write(struct.pack("<IIQI", 0x07064B50, 0, end, 1))
            self.fp.write(
                struct.pack(
                    "<IHHHHIIH",
                    0x06054B50,
                    0,
                    0,
                    min(n, 0xFFFF),
                    min(n, 0xFFFF),
                    min(cd_size, 0xFFFFFFFF),
                    min(cd_start, 0xFFFFFFFF),
                    0,
                )
            )
        else:
            self.fp.write(struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, n, n, cd_size, cd_start, 0))
        self.fp.flush()


def rewrite_zip(cf: CheckpointFile, data_pkl: bytes, fp: BinaryIO) -> None:
    """Write ``cf``'s archive to ``fp`` with a new data.pkl, every other record copied unchanged and aligned.

    When data.pkl is the archive's first entry (torch always writes it first), the new data.pkl is
    padded so that the rest of the archive keeps its offsets modulo 64 KiB (so modulo 64, the
    alignment torch's mmap loader needs) and is copied in one
    ``copy_file_range`` call; the central directory is rewritten with the shifted offsets.

    Args:
        cf: the archive read (a torch zip with :class:`ZipDetails`).
        data_pkl: the new ``data.pkl``.
        fp: the output, open for writing at its start.

    Raises:
        OutputError: the output device is full.
        CorruptCheckpointError: the source archive is damaged or ends early.
        TypeError: ``cf`` is not a zip archive.
    """
    zd = cf.details_as(ZipDetails)
    mem, root = zd.members, zd.root
    pkl_name = root + "data.pkl"
    order = sorted(mem.values(), key=lambda m: m.data_offset)
    rest = [m for m in order if m.name != pkl_name]
    w = AlignedZipWriter(fp)
    fd = pins.open_fd(cf.path)
    try:
        # the fast path copies the records' region verbatim, so their data must already be 64-byte aligned
        # (an archive re-zipped by another tool is not): otherwise each record is re-laid-out aligned
        if (
            order
            and order[0].name == pkl_name
            and rest
            and not any(m.compressed for m in rest)
            and all(m.data_offset % ALIGN == 0 for m in rest)
        ):
            headers = _header_offsets(cf.path)
            region_start = min(headers[m.name] for m in rest)
            region_end = max(m.data_offset + m.size for m in rest)
            bname = pkl_name.encode("utf-8")
            base = 30 + len(bname) + 4
            # keep the region's offsets modulo FOLIO (a multiple of ALIGN) when the padding field can
            # hold it: the kernel then copies whole folios, as fast as cp (see copy_range)
            pad = (region_start - (w.pos + base + len(data_pkl))) % FOLIO
            if pad > 0xFFFF - 4:
                pad %= ALIGN
            extra = struct.pack("<HH", 0x4246, pad) + b"Z" * pad
            t, d = _dos_time()
            crc = zlib.crc32(data_pkl) & 0xFFFFFFFF
            hdr = (
                struct.pack(
                    "<IHHHHHIIIHH",
                    0x04034B50,
                    20,
                    0,
                    0,
                    t,
                    d,
                    crc,
                    len(data_pkl),
                    len(data_pkl),
                    len(bname),
                    len(extra),
                )
                + bname
                + extra
            )
            w.entries.append((bname, crc, len(data_pkl), w.pos))
            fp.write(hdr + data_pkl)
            w.pos += len(hdr) + len(data_pkl)
            shift = w.pos - region_start
            fp.flush()
            copy_range(fd, region_start, fp.fileno(), w.pos, region_end - region_start)
            w.pos += region_end - region_start
            fp.seek(w.pos)
            for m in rest:
                w.entries.append((m.name.encode("utf-8"), m.crc, m.size, headers[m.name] + shift))
        else:
            for name, m in mem.items():
                if name == pkl_name:
                    w.add_bytes(name, data_pkl)
                elif m.compressed:
                    w.add_bytes(name, _read_member(cf.path, name))
                else:
                    w.add_copy(name, fd, m.data_offset, m.size, m.crc)
        w.close()
    finally:
        os.close(fd)


def _header_offsets(path: str) -> dict[str, int]:
    try:
        with zipfile.ZipFile(pins.path_for(path)) as zf:
            return {i.filename: i.header_offset for i in zf.infolist()}
    except ZIP_ERRORS + (UnicodeDecodeError,) as e:
        raise CorruptCheckpointError(
            f"{path}: damaged zip archive ({type(e).__name__}: {e}); the file is corrupt — re-copy or re-save it"
        ) from None


def _read_member(path: str, name: str) -> bytes:
    try:
        with zipfile.ZipFile(pins.path_for(path)) as zf:
            return zf.read(name)
    except ZIP_ERRORS + (UnicodeDecodeError,) as e:
        raise CorruptCheckpointError(
            f"{path}: record {name!r} cannot be read ({type(e).__name__}: {e}); the file "
            "is corrupt — re-copy or re-save it"
        ) from None
