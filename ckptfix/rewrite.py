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

import functools
import json
import os
import struct
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from ckptfix.atomic import atomic_output, make_backup, same_file
from ckptfix.errors import OutputError, UnsupportedError
from ckptfix.formats import CheckpointFile, find_state_dict, read_checkpoint
from ckptfix.parallel import run_tasks
from ckptfix.pickles import TensorRecord, dumps
from ckptfix.prefixes import _rekey_metadata
from ckptfix.progress import Progress, reporting

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
        target = _check_device(spec.strip(), spec)
        return lambda loc: target
    table = {}
    for part in spec.split(","):
        if not part.strip():
            continue
        a, eq, b = part.partition("=")
        if not eq or not a.strip():
            raise UnsupportedError(
                f"--map-location {spec!r}: {part.strip()!r} is not FROM=TO; write it like "
                "'cpu' or 'cuda:7=cuda:0,cuda:1=cpu'"
            )
        table[a.strip()] = _check_device(b.strip(), spec)
    return lambda loc: table.get(loc, loc)


#: device types torch.load can restore a storage to (its location tags)
_DEVICE_TYPES = (
    "cpu",
    "cuda",
    "mps",
    "meta",
    "xpu",
    "hpu",
    "mtia",
    "xla",
    "maia",
    "ipu",
    "privateuseone",
    "npu",
    "mlu",
    "musa",
)  # the last: common out-of-tree (privateuse1) backends


def _check_device(dev: str, spec: str) -> str:
    """``dev`` if torch.load can restore a storage tagged with it, else an error (an unloadable file otherwise)."""
    kind, _, index = dev.partition(":")
    if kind not in _DEVICE_TYPES or (index and not index.isdigit()) or dev.endswith(":"):
        raise UnsupportedError(
            f"--map-location {spec!r}: {dev!r} is not a device torch.load knows (cpu, cuda, "
            "cuda:N, mps, xpu:N ...); write it like 'cpu' or 'cuda:7=cuda:0,cuda:1=cpu'"
        )
    return dev


def _replace_at(obj: Any, path: tuple[str, ...], new: Any) -> Any:
    if not path:
        return new
    obj[path[0]] = _replace_at(obj[path[0]], path[1:], new) if len(path) > 1 else new
    return obj


def rewrite_checkpoint(
    src: str,
    transform: Transform,
    *,
    output: str | None = None,
    in_place: bool = False,
    backup: bool = True,
    force: bool = False,
    key: str | None = None,
    map_location: str | None = None,
    fsync: bool | None = None,
    suffix: str = "fixed",
    progress: Progress | None = None,
    jobs: int = 1,
) -> RewriteReport:
    """Apply ``transform`` to the state dict of ``src`` and write the result atomically.

    Args:
        src: checkpoint file (torch zip, legacy, Lightning ``.ckpt`` or safetensors), or a sharded
            ``*.index.json`` (or its directory) whose shards are any of those.
        transform: state dict -> (renamed state dict, report); must raise to refuse (collisions).
        output: where to write; default ``<stem>.<suffix><ext>`` next to ``src``.  For a sharded
            input, a directory (default ``<dir>.<suffix>`` beside the shards' directory) that gets
            the rewritten shards and index under their own names.
        in_place: replace ``src`` itself (temp file + fsync + rename), keeping ``src.bak`` unless
            ``backup=False``.  Not for sharded inputs (several files cannot be replaced atomically).
        force: overwrite an existing ``output``.
        key: where the state dict sits (found automatically otherwise).
        map_location: rewrite storage location tags (``"cpu"`` or ``"cuda:7=cuda:0,..."``).
        fsync: flush to disk before the rename (default: on for ``in_place``).
        progress: ``progress(done_bytes, total_bytes)`` as tensor data is copied (total: the input's size).
        jobs: shards of a sharded index rewritten at a time (``0``: one per CPU); same output for any number.

    Returns:
        RewriteReport (``output`` is None when nothing needed to change).

    Raises:
        CheckpointNotFoundError, CorruptCheckpointError: the input is missing or unreadable.
        KeyConflictError: the transform refused (a collision, an ambiguous rename).
        NoTensorsError: the file holds no state dict.
        OutputError: the output exists (without ``force``), is the input, or cannot be written.
        UnsupportedError: TorchScript, or ``in_place`` on a sharded index.
        VerificationError: the written file did not read back (nothing was replaced).
    """
    with reporting(progress, _input_bytes(src)):
        return _rewrite_checkpoint(
            src,
            transform,
            output=output,
            in_place=in_place,
            backup=backup,
            force=force,
            key=key,
            map_location=map_location,
            fsync=fsync,
            suffix=suffix,
            jobs=jobs,
        )


def _input_bytes(src: str) -> int:
    if os.path.isdir(src):
        return sum(e.stat().st_size for e in os.scandir(src) if e.is_file())
    if src.endswith(".json"):
        return sum(e.stat().st_size for e in os.scandir(os.path.dirname(os.path.abspath(src))) if e.is_file())
    try:
        return os.path.getsize(src)
    except OSError:
        return 0


def _rewrite_checkpoint(
    src: str,
    transform: Transform,
    *,
    output: str | None,
    in_place: bool,
    backup: bool,
    force: bool,
    key: str | None,
    map_location: str | None,
    fsync: bool | None,
    suffix: str,
    jobs: int = 1,
) -> RewriteReport:
    from ckptfix.formats import sniff

    if sniff(src) == "dcp":  # .metadata rewritten, data files hard-linked: ckptfix.dcp.rewrite
        from ckptfix.dcp.rewrite import rewrite_dcp

        return rewrite_dcp(
            src,
            transform,
            output=output,
            in_place=in_place,
            backup=backup,
            force=force,
            key=key,
            map_location=map_location,
            fsync=fsync,
            suffix=suffix,
        )
    cf = read_checkpoint(src)
    if cf.format == "sharded":
        return _rewrite_sharded(
            cf,
            transform,
            output=output,
            in_place=in_place,
            force=force,
            key=key,
            map_location=map_location,
            fsync=bool(fsync),
            suffix=suffix,
            jobs=jobs,
        )
    _check_writable(cf)
    if key is None and cf.format != "safetensors":
        from ckptfix.convert import _require_tensors

        _require_tensors(cf, src, "rename")
    from ckptfix.convert import locate_state_dict

    key_path, sd, holder = locate_state_dict(cf.obj, key)
    if holder != "mapping":
        what = "a whole pickled nn.Module" if holder == "module" else "a list of tensors"
        raise UnsupportedError(
            f"{src}: {what}, not a state dict, so there are no keys to rename in the file; "
            "convert it (ckptfix convert, which names its tensors as state_dict() does) or "
            "load_anywhere it and save the state dict"
        )
    _check_str_keys(src, sd)
    if cf.format == "safetensors":  # the names ckptfix convert stored once (aliases) are keys too
        sd = _logical_state_dict(sd, cf.extra.get("metadata"))
    new_sd, detail = transform(sd)
    rename = dict(zip(sd.keys(), new_sd.keys(), strict=False))
    renamed = sum(1 for a, b in zip(sd.keys(), new_sd.keys(), strict=False) if a != b)
    relocated = _relocate(cf, map_location)
    fmt_out = _format_out(cf)
    rep = RewriteReport(
        source=src,
        output=None,
        format_in=cf.format,
        format_out=fmt_out,
        key_path=list(key_path),
        changed=bool(renamed or relocated),
        renamed=renamed,
        detail=_detail(detail),
        relocated=relocated,
    )
    if not rep.changed:
        rep.notes.append("nothing to change; no file written")
        return rep
    if cf.format == "torch-legacy":
        rep.notes.append("the legacy (pre-1.6) input was written in the zip format torch uses since 1.6")
    dst, fsync_out = prepare_output(
        src, output, in_place=in_place, force=force, suffix=suffix, fmt_out=fmt_out, notes=rep.notes, fsync=fsync
    )
    rep.backup = _write_file(
        cf,
        key_path,
        new_sd,
        dst,
        fsync=fsync_out,
        backup_of=dst if in_place and backup else None,
        rename=rename,
        what=src if in_place else dst,
    )
    rep.output = src if in_place else dst
    return rep


def prepare_output(
    src: str,
    output: str | None,
    *,
    in_place: bool,
    force: bool,
    suffix: str,
    fmt_out: str,
    notes: list[str],
    fsync: bool | None = None,
) -> tuple[str, bool]:
    """(the path to write, whether to fsync) for a rewrite of ``src``; refuses outputs that would lose data.

    With ``in_place`` the file a symlink points to is the target (the link stays a link) and fsync is
    on by default; a hard-linked input gets a note (its other names keep the old contents).

    Args:
        src, output, in_place, force: as the rewrite commands take them.
        suffix, fmt_out: for the default name ``<stem>.<suffix><ext>``.
        notes: the report's notes, appended to.
        fsync: explicit choice (default: on for ``in_place``).

    Returns:
        ``(path, fsync)``.

    Raises:
        OutputError: the output is the input (without ``in_place``), a directory, or exists without ``force``.
    """
    if in_place:
        dst = os.path.realpath(src)
        links = os.stat(dst).st_nlink
        if links > 1:
            notes.append(
                f"{src} had {links} hard links; the other names still hold the old contents "
                "(an atomic replace gives this name a new file)"
            )
        return dst, True if fsync is None else bool(fsync)
    dst = output or default_output(src, suffix, fmt_out)
    if same_file(dst, src):
        raise OutputError(f"{dst}: the output is the input; use --in-place to replace it")
    if os.path.isdir(dst) or dst.endswith(("/", os.sep)):
        what = "is a directory" if os.path.isdir(dst) else "names a directory (it ends with a slash)"
        raise OutputError(
            f"{dst} {what}; pass a file name with -o (e.g. "
            f"{os.path.join(dst, os.path.basename(default_output(src, suffix, fmt_out)))})"
        )
    if os.path.exists(dst) and not force:
        raise OutputError(f"{dst} already exists; pass --force to overwrite it or -o to choose another path")
    return dst, bool(fsync)


def write_atomic(
    dst: str,
    write: Callable[[Any], None],
    check: Callable[[str], None] | None,
    *,
    fsync: bool,
    backup_of: str | None = None,
) -> str | None:
    """Write ``dst`` through a temp file: ``write(f)``, then ``check(temp_path)``, then the backup, then the rename.

    Args:
        dst: the final path.
        write: writes the content to the open temp file.
        check: verifies the written temp file (raises to stop the rename), or None.
        fsync: flush file and directory around the rename.
        backup_of: keep this file as ``<path>.bak`` just before it is replaced (``--in-place``).

    Returns:
        The backup path, or None.

    Raises:
        Whatever ``write`` or ``check`` raise (nothing is renamed and no backup made); OutputError.
    """
    made: list[str] = []

    def before_replace(tmp: str) -> None:
        if check is not None:
            check(tmp)
        if backup_of is not None:
            made.append(make_backup(backup_of))

    with atomic_output(dst, fsync=fsync, before_replace=before_replace) as f:
        write(f)
    return made[0] if made else None


def _aliases_of(meta: Mapping[str, Any] | None, stored: Mapping[str, Any]) -> dict[str, str]:
    """{alias: stored name} that a safetensors file's metadata records (ckptfix's or Hugging Face's style)."""
    meta = meta or {}
    if "ckptfix.aliases" in meta:
        try:
            amap = json.loads(meta["ckptfix.aliases"])
        except (TypeError, ValueError):
            return {}
    else:
        amap = {k: v for k, v in meta.items() if k != "format" and not k.startswith("ckptfix.")}
    if not isinstance(amap, dict):
        return {}
    return {
        a: b for a, b in amap.items() if isinstance(a, str) and isinstance(b, str) and a not in stored and b in stored
    }


def _logical_state_dict(stored: Mapping[str, Any], meta: Mapping[str, Any] | None) -> Mapping[str, Any]:
    """The stored tensors plus the aliases the metadata records (the alias's value is its target), in the
    original order when ``ckptfix.order`` gives it; ``stored`` itself when there are no aliases."""
    aliases = _aliases_of(meta, stored)
    if not aliases:
        return stored
    try:
        order = json.loads((meta or {}).get("ckptfix.order") or "[]")
    except (TypeError, ValueError):
        order = []
    out: dict[str, Any] = {}
    for n in [*(order if isinstance(order, list) else []), *stored, *aliases]:
        if isinstance(n, str) and n not in out:
            if n in stored:
                out[n] = stored[n]
            elif n in aliases:
                out[n] = stored[aliases[n]]
    return out


def _rename_metadata(meta: dict[str, Any], rename: Mapping[str, str], stored: Mapping[str, Any]) -> dict[str, Any]:
    """``meta`` with the tensor names it holds (ckptfix aliases, order, views; Hugging Face aliases) renamed."""
    if not rename or all(a == b for a, b in rename.items()):
        return meta

    def r(n: Any) -> Any:
        return rename.get(n, n) if isinstance(n, str) else n

    def load(k: str) -> Any:
        try:
            return json.loads(meta[k])
        except (TypeError, ValueError):
            return None

    if "ckptfix.aliases" in meta:
        amap = load("ckptfix.aliases")
        if isinstance(amap, dict):
            meta["ckptfix.aliases"] = json.dumps({r(a): r(b) for a, b in amap.items()}, ensure_ascii=False)
    else:
        hf = _aliases_of(meta, stored)
        meta = {(r(k) if k in hf else k): (r(v) if k in hf else v) for k, v in meta.items()}
    if "ckptfix.order" in meta:
        order = load("ckptfix.order")
        if isinstance(order, list):
            meta["ckptfix.order"] = json.dumps([r(n) for n in order], ensure_ascii=False)
    if "ckptfix.views" in meta:
        views = load("ckptfix.views")
        if isinstance(views, dict):
            meta["ckptfix.views"] = json.dumps(
                {r(n): ({**v, "base": r(v.get("base"))} if isinstance(v, dict) else v) for n, v in views.items()},
                ensure_ascii=False,
            )
    return meta


def _check_str_keys(src: str, sd: Mapping[Any, Any]) -> None:
    bad = next((k for k in sd.keys() if not isinstance(k, str)), None)
    if bad is not None:
        raise UnsupportedError(
            f"{src}: the state dict has a key that is not a string ({bad!r}, a "
            f"{type(bad).__name__}), so its keys cannot be renamed; pass --key to pick "
            "another mapping, or rename it in Python"
        )


def _rename_module_probe(probe: str, modules: Mapping[str, str]) -> str:
    path, _, leaf = probe.rpartition(".")
    new = modules.get(path, path)
    return f"{new}.{leaf}" if new else leaf


def _check_writable(cf: CheckpointFile, what: str = "") -> None:
    if cf.format not in WRITABLE:
        raise UnsupportedError(
            f"{what or cf.path}: {cf.format} checkpoints cannot be rewritten here; convert it "
            "first (ckptfix convert) or load it with load_anywhere and save a new file"
        )


def _format_out(cf: CheckpointFile) -> str:
    return "torch-zip" if cf.format in ("torch-zip", "torch-legacy") else "safetensors"


def _detail(detail: Any) -> dict[str, Any]:
    return detail.to_dict() if hasattr(detail, "to_dict") else dict(detail or {})


def _relocate(cf: CheckpointFile, map_location: str | None) -> dict[str, str]:
    """Re-tag ``cf``'s storages (in memory) as ``map_location`` says; returns {old tag: new tag}."""
    relocate = parse_map_location(map_location)
    relocated: dict[str, str] = {}
    if relocate is None:
        return relocated
    if cf.format == "safetensors":
        raise UnsupportedError("safetensors files carry no device tags; --map-location does not apply")
    for st in cf.storages.values():
        new = relocate(st.location)
        if new != st.location:
            relocated[st.location] = new
            st.location = new
    return relocated


def _write_file(
    cf: CheckpointFile,
    key_path: Any,
    new_sd: Mapping[str, Any],
    dst: str,
    *,
    fsync: bool,
    backup_of: str | None = None,
    rename: Mapping[str, str] | None = None,
    what: str | None = None,
) -> str | None:
    """Write ``cf`` with ``new_sd`` in place of its state dict to ``dst`` atomically; returns the backup path.

    ``rename`` (old name -> new name) also covers names a safetensors file does not store as tensors
    (ckptfix aliases): its metadata follows it.  The written file is read back
    (:func:`check_written`) before it is renamed into place.
    """
    old_sd = cf.obj
    cf.obj = _replace_at(cf.obj, tuple(key_path), new_sd)

    def write(f: Any) -> None:
        if cf.format == "safetensors":
            _write_safetensors(cf, old_sd, new_sd, f, rename or {})
        else:
            write_checkpoint_zip(cf, cf.obj, f)

    def check(tmp: str) -> None:
        check_written(tmp, cf, expect_obj=cf.obj, what=what or dst)

    return write_atomic(dst, write, check, fsync=fsync, backup_of=backup_of)


def _rewrite_sharded(
    cf: CheckpointFile,
    transform: Transform,
    *,
    output: str | None,
    in_place: bool,
    force: bool,
    key: str | None,
    map_location: str | None,
    fsync: bool,
    suffix: str,
    jobs: int = 1,
) -> RewriteReport:
    """Rename across every shard of an index: new shards and index, same file names, in a new directory.

    The shards are written ``jobs`` at a time; the index last, once every shard is in place.
    """
    ipath = cf.path
    if in_place:
        raise UnsupportedError(
            f"{ipath}: a sharded checkpoint is several files and cannot be replaced atomically "
            "in place; write it to a new directory with -o DIR, check it, then swap the directories"
        )
    if key is not None:
        raise UnsupportedError(f"{ipath}: --key does not apply to a sharded index (its weight map is the state dict)")
    shards: dict[str, CheckpointFile] = cf.extra["shards"]
    for name, scf in shards.items():
        _check_writable(scf, f"{ipath}: shard {name}")
    for name in shards:
        if os.path.isabs(name) or os.path.normpath(name) != os.path.basename(name) or name in (".", ".."):
            raise UnsupportedError(
                f"{ipath}: shard {name!r} is not a plain file name next to the index; "
                "ckptfix writes sharded outputs only as files beside their index"
            )
    sd = cf.obj
    _check_str_keys(ipath, sd)
    st_meta = next((scf.extra.get("metadata") for scf in shards.values() if scf.format == "safetensors"), None)
    sd = _logical_state_dict(sd, st_meta)  # with the names ckptfix convert stored once (aliases)
    new_sd, detail = transform(sd)
    if len(new_sd) != len(sd) or any(sd[a] is not new_sd[b] for a, b in zip(sd, new_sd, strict=False)):
        raise UnsupportedError(
            f"{ipath}: this rename does not map the sharded keys one to one; "
            "convert the index to a single file first (ckptfix convert)"
        )
    rename = dict(zip(sd, new_sd, strict=False))
    renamed = sum(1 for a, b in rename.items() if a != b)
    modules: dict[str, str] = {}  # module path -> new module path, ancestors too ("module" -> "")
    for a, b in rename.items():
        pa, pb = a.split("."), b.split(".")
        while len(pa) > 1 and len(pb) >= 1 and pa[-1] == pb[-1]:
            pa, pb = pa[:-1], pb[:-1]
            modules.setdefault(".".join(pa), ".".join(pb))
    relocated: dict[str, str] = {}
    for scf in shards.values():
        relocated.update(_relocate(scf, map_location))
    formats = {_format_out(scf) for scf in shards.values()}
    rep = RewriteReport(
        source=ipath,
        output=None,
        format_in="sharded",
        format_out="sharded " + "/".join(sorted(formats)),
        key_path=[],
        changed=bool(renamed or relocated),
        renamed=renamed,
        detail=_detail(detail),
        relocated=relocated,
    )
    if not rep.changed:
        rep.notes.append("nothing to change; no file written")
        return rep
    src_dir = os.path.dirname(os.path.abspath(ipath))
    out_dir = os.path.abspath(output) if output else f"{src_dir}.{suffix}"
    if out_dir == src_dir:
        raise OutputError(f"{out_dir}: the output directory is the input's; choose a new one with -o DIR")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise OutputError(f"{out_dir} exists and is not a directory; for a sharded index -o names a directory")
    names = [os.path.basename(ipath), *shards]
    clash = [n for n in names if os.path.exists(os.path.join(out_dir, n))]
    if clash and not force:
        raise OutputError(
            f"{os.path.join(out_dir, clash[0])} already exists; pass --force to overwrite or -o to "
            "choose another directory"
        )
    created = not os.path.isdir(out_dir)
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        raise OutputError(f"cannot create {out_dir}: {e.strerror}; choose another directory with -o") from None
    written: list[str] = []

    def one_shard(name: str, scf: CheckpointFile) -> None:
        key_path, ssd = find_state_dict(scf.obj)
        new_ssd = type(ssd)() if isinstance(ssd, dict) else {}
        for k, v in ssd.items():
            new_ssd[rename.get(k, k)] = v
        meta = getattr(ssd, "_metadata", None)
        if isinstance(meta, dict):  # module paths follow their tensors' renames
            new_ssd._metadata = _rekey_metadata(meta, lambda probe: _rename_module_probe(probe, modules))  # type: ignore
        dst = os.path.join(out_dir, name)
        _write_file(scf, key_path, new_ssd, dst, fsync=fsync, rename=rename, what=os.path.join(out_dir, name))
        written.append(dst)

    try:
        run_tasks([functools.partial(one_shard, name, scf) for name, scf in shards.items()], jobs)
        for name, scf in shards.items():
            if scf.format == "torch-legacy":
                rep.notes.append(f"legacy shard {name} was written in the zip format")
        doc = dict(cf.extra["index"])
        doc["weight_map"] = {rename.get(k, k): v for k, v in doc["weight_map"].items()}
        if isinstance(doc.get("metadata"), dict):  # ckptfix convert copies its metadata here too
            doc["metadata"] = _rename_metadata(dict(doc["metadata"]), rename, cf.obj)
        dst = os.path.join(out_dir, os.path.basename(ipath))
        with atomic_output(dst, fsync=fsync) as f:  # the index last: the directory is complete once it exists
            f.write(json.dumps(doc, indent=2).encode("utf-8") + b"\n")
        written.append(dst)
    except BaseException:
        for p in written:
            try:
                os.unlink(p)
            except OSError:
                pass
        if created:
            try:
                os.rmdir(out_dir)
            except OSError:
                pass
        raise
    rep.output = dst
    rep.notes.append(f"wrote {len(shards)} shard(s) and the index to {out_dir}")
    return rep


def write_checkpoint_zip(
    cf: CheckpointFile,
    obj: Any,
    f: Any,
    *,
    new_storages: Mapping[str, bytes] | None = None,
) -> None:
    """Write ``cf`` as a torch zip archive whose data.pkl pickles ``obj``, every storage record copied by range.

    A legacy input becomes a zip archive.  torch is never imported.

    Args:
        cf: the checkpoint read from disk (its storages give the byte ranges).
        obj: the object graph to pickle as data.pkl (records and placeholders).
        f: the open output file.
        new_storages: storage key -> bytes, added as new records (``sanitize`` turns numpy arrays into
            tensors this way).

    Raises:
        UnsupportedError: legacy storage views; OutputError: the disk is full.
    """
    from ckptfix.formats.zipfmt import AlignedZipWriter, rewrite_zip

    new_storages = dict(new_storages or {})
    if cf.format == "torch-zip" and not new_storages:
        rewrite_zip(cf, dumps(obj), f)
        return
    w = AlignedZipWriter(f)
    fd = os.open(cf.path, os.O_RDONLY)
    try:
        if cf.format == "torch-zip":
            from ckptfix.formats.zipfmt import _read_member

            data_pkl = dumps(obj)
            root = cf.extra["root"]
            for name, m in cf.extra["members"].items():
                if name == root + "data.pkl":
                    w.add_bytes(name, data_pkl)
                elif m.compressed:
                    w.add_bytes(name, _read_member(cf.path, name))
                else:
                    w.add_copy(name, fd, m.data_offset, m.size, m.crc)
        else:  # legacy -> zip: storage records named by their keys, bytes copied from the stream
            root = "archive/"
            for st in cf.storages.values():
                if st.view_metadata is not None:
                    raise UnsupportedError(
                        f"{cf.path}: legacy storage views cannot be rewritten; load the file "
                        "with load_anywhere and torch.save it again"
                    )
                st._legacy = False
            data_pkl = dumps(obj)
            w.add_bytes(root + "data.pkl", data_pkl)
            w.add_bytes(root + "byteorder", b"little")
            for key in cf.extra["storage_keys"]:
                st = cf.storages[str(key)]
                w.add_copy(f"{root}data/{key}", fd, st.file_offset, st.nbytes)  # CRC computed on the way
        for key, data in new_storages.items():
            w.add_bytes(f"{root}data/{key}", data)
        if cf.format != "torch-zip":
            w.add_bytes(root + "version", b"3\n")
        w.close()
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- verification before the rename


def pickle_globals(data: bytes) -> list[str]:
    """The globals a pickle names, resolved as Python's unpickler resolves them for the pickle's protocol.

    A protocol < 3 pickle's ``__builtin__ long`` is ``builtins.int`` (``_compat_pickle``); a
    ``builtins long`` stays ``builtins.long`` -- which does not exist.  Reads opcodes only.

    Args:
        data: one pickle.

    Returns:
        ``module.name`` of every global, in order, repeats included.

    Raises:
        ValueError (from pickletools) on a malformed stream.
    """
    import _compat_pickle
    import pickletools

    proto = 0
    strings: list[str] = []
    memo: dict[int, Any] = {}
    n_memo = 0
    last: Any = None
    out: list[str] = []

    def resolve(mod: str, name: str) -> str:
        if proto < 3:
            if (mod, name) in _compat_pickle.NAME_MAPPING:
                mod, name = _compat_pickle.NAME_MAPPING[(mod, name)]
            elif mod in _compat_pickle.IMPORT_MAPPING:
                mod = _compat_pickle.IMPORT_MAPPING[mod]
        return f"{mod}.{name}"

    for op, arg, _ in pickletools.genops(data):
        name = op.name
        prev, last = last, None
        if name == "PROTO":
            proto = int(arg)
        elif name in (
            "SHORT_BINUNICODE",
            "BINUNICODE",
            "BINUNICODE8",
            "UNICODE",
            "SHORT_BINSTRING",
            "BINSTRING",
            "STRING",
        ):
            last = arg.decode("latin-1") if isinstance(arg, bytes) else str(arg)
            strings.append(last)
        elif name in ("GLOBAL", "INST"):
            mod, _, nm = str(arg).partition(" ")
            out.append(resolve(mod, nm))
        elif name == "STACK_GLOBAL":
            out.append(f"{strings[-2]}.{strings[-1]}" if len(strings) >= 2 else "<unresolved STACK_GLOBAL>")
        elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
            memo[int(arg)] = prev
            last = prev
        elif name == "MEMOIZE":
            memo[n_memo] = prev
            n_memo += 1
            last = prev
        elif name in ("GET", "BINGET", "LONG_BINGET"):
            v = memo.get(int(arg))
            if isinstance(v, str):
                strings.append(v)
                last = v
        elif name in ("EXT1", "EXT2", "EXT4"):
            out.append(f"<extension {arg}>")
    return out


def _resolves(name: str) -> bool:
    """False for a ``builtins`` name that does not exist (``builtins.long``); other modules are not imported."""
    import builtins

    module, _, attr = name.rpartition(".")
    return module != "builtins" or hasattr(builtins, attr)


def check_written(
    path: str,
    source: CheckpointFile,
    *,
    expect_obj: Any,
    what: str,
    weights_only: bool = False,
    new_storages: Mapping[str, bytes] | None = None,
) -> set[str]:
    """Read a rewritten file back (torch-free) before it replaces anything; raise if torch could not load it.

    Checks: the file reads back with ckptfix's restricted reader; every global its pickle names
    resolves (as Python resolves it for the pickle's protocol) and is a global the input named
    (after the same normalisation) or one torch's weights-only loader allows -- with
    ``weights_only``, only the latter; every tensor of ``expect_obj`` reads back with the same dtype,
    shape, stride, offset and storage, and every storage record has the size of the one it was
    copied from (or of its ``new_storages`` bytes) and lies inside the file.  Returns the globals
    outside the weights-only allowlist that the output names.

    Raises:
        VerificationError: naming what is wrong (``what`` is the path the user asked for).
    """
    import zipfile

    from ckptfix.errors import CkptfixError, VerificationError
    from ckptfix.formats import iter_tensors, read_checkpoint
    from ckptfix.pickles import classify_global
    from ckptfix.sanitize import normalise_global

    def fail(why: str) -> VerificationError:
        return VerificationError(f"{what}: the rewritten file {why}; nothing was replaced")

    try:
        out = read_checkpoint(path)
    except CkptfixError as e:
        raise fail(f"does not read back ({e})") from None
    if out.format == "safetensors":
        if len(out.obj) != sum(1 for _ in source.obj):
            pass  # aliases stored once may differ in count; the header was written from the source's records
        return set()
    with zipfile.ZipFile(path) as zf:
        pkl = next((n for n in zf.namelist() if n.endswith("/data.pkl") or n == "data.pkl"), None)
        if pkl is None:
            raise fail("has no data.pkl")
        names = pickle_globals(zf.read(pkl))
    inputs = {normalise_global(g) for g in source.globals_seen}
    unsafe: set[str] = set()
    for g in dict.fromkeys(names):
        if not _resolves(g):
            raise fail(
                f"would name the global {g}, which does not exist in Python 3 (torch.load would raise AttributeError)"
            )
        safe = classify_global(g) == "safe"
        if not safe:
            unsafe.add(g)
        if weights_only and not safe:
            raise fail(f"still names {g}, outside torch's weights-only allowlist")
        if not safe and g not in inputs:
            raise fail(f"names the global {g}, which the input did not name")
    new_storages = new_storages or {}
    size = os.path.getsize(path)
    for key, st in out.storages.items():
        want = (
            len(new_storages[key])
            if key in new_storages
            else (source.storages[key].nbytes if key in source.storages else None)
        )
        if want is None:
            raise fail(f"holds a storage {key!r} that the input does not")
        if st.nbytes != want or st.file_offset is None or st.file_offset + (st.nbytes or 0) > size:
            raise fail(f"storage {key!r} reads back as {st.nbytes} bytes, expected {want}")
    exp = list(iter_tensors(expect_obj, depth=64))
    got = list(iter_tensors(out.obj, depth=64))
    if len(exp) != len(got):
        raise fail(f"holds {len(got)} tensors, expected {len(exp)}")
    for (pa, a), (pb, b) in zip(exp, got, strict=False):
        if not isinstance(a, TensorRecord) or not isinstance(b, TensorRecord):
            continue
        if (
            pa != pb
            or a.dtype != b.dtype
            or tuple(a.shape) != tuple(b.shape)
            or a.offset != b.offset
            or (a.numel and tuple(a.stride) != tuple(b.stride))
            or (a.storage.key if a.storage else None) != (b.storage.key if b.storage else None)
        ):
            raise fail(f"tensor {pa or '/'} reads back as {pb}: {b!r}, expected {a!r}")
    return unsafe


def _write_safetensors(
    cf: CheckpointFile, old_sd: Mapping[str, Any], new_sd: Mapping[str, Any], f: Any, rename: Mapping[str, str]
) -> None:
    """The stored tensors of ``old_sd`` under their new names (``new_sd`` order), data copied, metadata renamed."""
    from ckptfix.formats.safetensors_fmt import DTYPE_TO_ST
    from ckptfix.formats.zipfmt import FOLIO, copy_range

    if "__metadata__" in new_sd:
        from ckptfix.errors import KeyConflictError

        raise KeyConflictError(
            f"{cf.path}: the rename gives a tensor the name '__metadata__', which safetensors "
            "reserves for its metadata; rename it differently"
        )
    start = cf.extra["data_start"]
    header: dict[str, Any] = {}
    meta = _rename_metadata(dict(cf.extra.get("metadata") or {}), rename, old_sd)
    if meta:
        header["__metadata__"] = meta
    old_of = {b: a for a, b in rename.items()}
    for name in new_sd:
        old = old_of.get(name, name)
        if old not in old_sd:  # an alias: stored once under its target's name
            continue
        t = old_sd[old]
        st = t.storage
        header[name] = {
            "dtype": DTYPE_TO_ST[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [st.file_offset - start, st.file_offset - start + st.nbytes],
        }
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
