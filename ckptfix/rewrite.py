"""Rename a checkpoint's state-dict keys on disk without decoding a tensor.

The key renames come from :mod:`ckptfix.prefixes`; this module applies them to
the file:

* torch zip (``.pt``/``.pth``/Lightning ``.ckpt``): only ``data.pkl`` is rewritten,
  every tensor record is copied through unchanged (``copy_file_range``), 64-byte
  aligned, so ``torch.load(mmap=True)`` still works.  torch is never imported.
* legacy (pre-1.6) stream: written as a zip archive (said in the report), tensor
  bytes copied from their byte ranges.
* safetensors: the JSON header is rewritten, the data section copied.

Everything outside the state dict (epoch, optimizer and scaler state,
hyper-parameters), storage sharing, dtypes and location tags are preserved;
``map_location`` rewrites the tags.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from ckptfix.atomic import atomic_output, make_backup
from ckptfix.errors import OutputError, UnsupportedError
from ckptfix.formats import CheckpointFile, find_state_dict, read_checkpoint
from ckptfix.pickles import dumps

#: a transform: state dict -> (new state dict, report object with to_dict()/summary())
Transform = Callable[[Mapping[str, Any]], "tuple[Mapping[str, Any], Any]"]

WRITABLE = ("torch-zip", "torch-legacy", "safetensors")


@dataclass
class RewriteReport:
    source: str
    output: str | None
    format_in: str
    format_out: str | None
    key_path: list[str]
    changed: bool
    renamed: int
    detail: dict[str, Any]
    backup: str | None = None
    notes: list[str] = field(default_factory=list)
    relocated: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def default_output(src: str, suffix: str, fmt_out: str) -> str:
    base, ext = os.path.splitext(src)
    if fmt_out == "safetensors":
        ext = ".safetensors"
    return f"{base}.{suffix}{ext or '.pt'}"


def parse_map_location(spec: str | None) -> Callable[[str], str] | None:
    """``"cpu"`` -> every tag becomes cpu; ``"cuda:7=cuda:0,cuda:1=cpu"`` -> those tags only."""
    if not spec:
        return None
    if "=" not in spec:
        return lambda loc: spec
    table = {}
    for part in spec.split(","):
        a, _, b = part.partition("=")
        table[a.strip()] = b.strip()
    return lambda loc: table.get(loc, loc)


def _replace_at(obj: Any, path: tuple[str, ...], new: Any) -> Any:
    if not path:
        return new
    obj[path[0]] = _replace_at(obj[path[0]], path[1:], new) if len(path) > 1 else new
    return obj


def rewrite_checkpoint(src: str, transform: Transform, *, output: str | None = None, in_place: bool = False,
                       backup: bool = True, force: bool = False, key: str | None = None,
                       map_location: str | None = None, fsync: bool | None = None,
                       suffix: str = "fixed") -> RewriteReport:
    """Apply ``transform`` to the state dict of ``src`` and write the result atomically.

    Args:
        src: checkpoint file (torch zip, legacy, Lightning ``.ckpt`` or safetensors).
        transform: state dict -> (renamed state dict, report); must raise to refuse (collisions).
        output: where to write; default ``<stem>.<suffix><ext>`` next to ``src``.
        in_place: replace ``src`` itself (temp file + fsync + rename), keeping ``src.bak`` unless
            ``backup=False``.
        force: overwrite an existing ``output``.
        key: where the state dict sits (found automatically otherwise).
        map_location: rewrite storage location tags (``"cpu"`` or ``"cuda:7=cuda:0,..."``).
        fsync: flush to disk before the rename (default: on for ``in_place``).

    Returns:
        RewriteReport (``output`` is None when nothing needed to change).
    """
    cf = read_checkpoint(src)
    if cf.format not in WRITABLE:
        raise UnsupportedError(f"{src}: {cf.format} checkpoints cannot be rewritten here; convert it first "
                               "(ckptfix convert) or load it with load_anywhere and save a new file")
    key_path, sd = find_state_dict(cf.obj, key)
    new_sd, detail = transform(sd)
    renamed = sum(1 for a, b in zip(sd.keys(), new_sd.keys()) if a != b)
    relocate = parse_map_location(map_location)
    relocated: dict[str, str] = {}
    if relocate is not None:
        if cf.format == "safetensors":
            raise UnsupportedError("safetensors files carry no device tags; --map-location does not apply")
        for st in cf.storages.values():
            new = relocate(st.location)
            if new != st.location:
                relocated[st.location] = new
                st.location = new
    fmt_out = "torch-zip" if cf.format in ("torch-zip", "torch-legacy") else "safetensors"
    rep = RewriteReport(source=src, output=None, format_in=cf.format, format_out=fmt_out, key_path=list(key_path),
                        changed=bool(renamed or relocated), renamed=renamed,
                        detail=detail.to_dict() if hasattr(detail, "to_dict") else dict(detail or {}),
                        relocated=relocated)
    if not rep.changed:
        rep.notes.append("nothing to change; no file written")
        return rep
    if cf.format == "torch-legacy":
        rep.notes.append("the legacy (pre-1.6) input was written in the zip format torch uses since 1.6")
    cf.obj = _replace_at(cf.obj, tuple(key_path), new_sd)
    if in_place:
        dst = src
        fsync = True if fsync is None else fsync
    else:
        dst = output or default_output(src, suffix, fmt_out)
        if os.path.abspath(dst) == os.path.abspath(src):
            raise OutputError(f"{dst}: the output is the input; use --in-place to replace it")
        if os.path.exists(dst) and not force:
            raise OutputError(f"{dst} already exists; pass --force to overwrite it or -o to choose another path")
    with atomic_output(dst, fsync=bool(fsync)) as f:
        if cf.format == "safetensors":
            _write_safetensors(cf, new_sd, f)
        else:
            _write_zip(cf, f)
        if in_place and backup:
            f.flush()
            rep.backup = make_backup(src)
    rep.output = dst
    return rep


def _write_zip(cf: CheckpointFile, f: Any) -> None:
    from ckptfix.formats.zipfmt import AlignedZipWriter, rewrite_zip

    if cf.format == "torch-zip":
        rewrite_zip(cf, dumps(cf.obj), f)
        return
    # legacy -> zip: storage records named by their keys, bytes copied from the stream
    for st in cf.storages.values():
        if st.view_metadata is not None:
            raise UnsupportedError(f"{cf.path}: legacy storage views cannot be rewritten; load the file with "
                                   "load_anywhere and torch.save it again")
        st._legacy = False
    data_pkl = dumps(cf.obj)
    w = AlignedZipWriter(f)
    w.add_bytes("archive/data.pkl", data_pkl)
    w.add_bytes("archive/byteorder", b"little")
    fd = os.open(cf.path, os.O_RDONLY)
    try:
        for key in cf.extra["storage_keys"]:
            st = cf.storages[str(key)]
            w.add_copy(f"archive/data/{key}", fd, st.file_offset, st.nbytes)  # CRC computed on the way
        w.add_bytes("archive/version", b"3\n")
        w.close()
    finally:
        os.close(fd)


def _write_safetensors(cf: CheckpointFile, new_sd: Mapping[str, Any], f: Any) -> None:
    from ckptfix.formats.safetensors_fmt import DTYPE_TO_ST
    from ckptfix.formats.zipfmt import FOLIO, copy_range

    start = cf.extra["data_start"]
    header: dict[str, Any] = {}
    meta = dict(cf.extra.get("metadata") or {})
    old_names = {id(v): k for k, v in cf.obj.items()}
    rename = {old_names[id(v)]: k for k, v in new_sd.items() if id(v) in old_names}
    aliases = meta.get("ckptfix.aliases")
    if aliases:
        try:
            amap = json.loads(aliases)
            meta["ckptfix.aliases"] = json.dumps({rename.get(a, a): rename.get(b, b) for a, b in amap.items()})
        except ValueError:
            pass
    if meta:
        header["__metadata__"] = meta
    for name, t in new_sd.items():
        st = t.storage
        header[name] = {"dtype": DTYPE_TO_ST[t.dtype], "shape": list(t.shape),
                        "data_offsets": [st.file_offset - start, st.file_offset - start + st.nbytes]}
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * ((-len(raw)) % 8)
    if start % 8 == 0:  # trailing spaces (valid JSON) keep the data's offset modulo FOLIO: a copy as fast as cp
        raw += b" " * ((start - 8 - len(raw)) % FOLIO)
    f.write(struct.pack("<Q", len(raw)) + raw)
    f.flush()
    size = cf.file_size - start
    fd = os.open(cf.path, os.O_RDONLY)
    try:
        copy_range(fd, start, f.fileno(), 8 + len(raw), size)
    finally:
        os.close(fd)
    f.seek(8 + len(raw) + size)
