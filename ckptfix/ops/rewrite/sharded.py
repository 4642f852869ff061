"""Renaming across every shard of a sharded index: new shards and index, same file names, in a new directory."""

from __future__ import annotations

import functools
import json
import os
from typing import Any, Mapping

from ckptfix.display import already_exists, output_is_input, shown_path
from ckptfix.errors import OutputError, UnsupportedError
from ckptfix.files.atomic import atomic_output, output_error
from ckptfix.files.outputs import OutputOptions, refuse_misnamed
from ckptfix.files.parallel import run_tasks
from ckptfix.formats import CheckpointFile, Format, SafetensorsDetails, ShardedDetails, find_state_dict, stmeta
from ckptfix.ops.prefixes import rekey_metadata
from ckptfix.ops.rewrite.location import kept_device_note, relocate
from ckptfix.ops.rewrite.report import RewriteReport, Transform, detail
from ckptfix.ops.rewrite.writers import check_str_keys, check_writable, format_out, write_file


def rewrite_sharded(
    cf: CheckpointFile,
    transform: Transform,
    outputs: OutputOptions,
) -> RewriteReport:
    """Rename across every shard of an index, writing the shards and the index (last) to a new directory.

    Args:
        cf: the index read from disk (``extra["shards"]`` holds each shard).
        transform: state dict -> (renamed state dict, report); must rename one to one.
        outputs: ``output`` (the new directory; default ``<dir>.<suffix>`` beside the shards' directory),
            ``in_place`` (refused: several files cannot be replaced atomically), ``force`` (write into a
            directory that already holds files of these names), ``key`` (refused: the weight map is the
            state dict), ``map_location`` (re-tag the shards' storages), ``fsync`` (flush every file),
            ``suffix``, ``jobs`` (shards written at a time; ``0``: one per CPU; the same files for any number).

    Returns:
        RewriteReport (``output``: the new index; None when nothing needed to change).

    Raises:
        UnsupportedError: ``in_place``, ``key``, a shard that cannot be written, or a rename that is
            not one to one.
        OutputError: the output directory is the input's, not a directory, or holds the files.
        KeyConflictError, VerificationError: as for one file; nothing is left behind.
    """
    ipath = cf.path
    output, in_place, force, key, map_location = (
        outputs.output, outputs.in_place, outputs.force, outputs.key, outputs.map_location
    )  # fmt: skip
    fsync, suffix, jobs = bool(outputs.fsync), outputs.suffix or "fixed", outputs.jobs
    if in_place:
        raise UnsupportedError(
            f"{ipath}: a sharded checkpoint is several files and cannot be replaced atomically "
            "in place; write it to a new directory with -o DIR, check it, then swap the directories"
        )
    if key is not None:
        raise UnsupportedError(f"{ipath}: --key does not apply to a sharded index (its weight map is the state dict)")
    refuse_misnamed(
        output,
        "directory",
        "a sharded checkpoint is rewritten into a directory (its shards and index under their "
        "own names): pass -o DIR, a name without a checkpoint extension",
    )
    details = cf.details_as(ShardedDetails)
    shards: dict[str, CheckpointFile] = details.shards
    _check_shards(ipath, shards)
    sd = cf.obj
    check_str_keys(ipath, sd)
    st_meta = next(
        (scf.details.metadata for scf in shards.values() if isinstance(scf.details, SafetensorsDetails)), None
    )
    sd = stmeta.logical_state_dict(sd, st_meta)  # with the names ckptfix convert stored once (aliases)
    new_sd, report = transform(sd)
    if len(new_sd) != len(sd) or any(sd[a] is not new_sd[b] for a, b in zip(sd, new_sd, strict=False)):
        raise UnsupportedError(
            f"{ipath}: this rename does not map the sharded keys one to one; "
            "convert the index to a single file first (ckptfix convert)"
        )
    rename = dict(zip(sd, new_sd, strict=False))
    renamed = sum(1 for a, b in rename.items() if a != b)
    relocated: dict[str, str] = {}
    for scf in shards.values():
        relocated.update(relocate(scf, map_location))
    formats = {format_out(scf) for scf in shards.values()}
    rep = RewriteReport(
        source=ipath,
        output=None,
        format_in="sharded",
        format_out="sharded " + "/".join(sorted(formats)),
        key_path=[],
        changed=bool(renamed or relocated),
        renamed=renamed,
        detail=detail(report),
        relocated=relocated,
    )
    if not rep.changed and (output is None or in_place):
        rep.notes.append("nothing to change; no file written")
        return rep
    if not rep.changed:  # -o OUT: a pipeline reads OUT, so it is written (an unchanged copy), as by every command
        rep.notes.append("nothing to change; the output is an unchanged copy")
    if kept := kept_device_note(shards.values()):
        rep.notes.append(kept)
    out_dir = _output_dir(ipath, shards, output, suffix, force)
    created = not os.path.isdir(out_dir)
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        raise output_error(e, out_dir) from None
    written: list[str] = []
    try:
        _write_shards(shards, rename, out_dir, fsync, written, rep.notes, jobs)
        doc = dict(details.index.doc)
        doc["weight_map"] = {rename.get(k, k): v for k, v in doc["weight_map"].items()}
        if isinstance(doc.get("metadata"), dict):  # ckptfix convert copies its metadata here too
            doc["metadata"] = stmeta.rename(dict(doc["metadata"]), rename, cf.obj)
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
    rep.notes.append(f"wrote {len(shards)} shard(s) and the index to {shown_path(out_dir)}")
    return rep


def _check_shards(ipath: str, shards: Mapping[str, CheckpointFile]) -> None:
    """Every shard is a writable format and a plain file name beside the index."""
    for name, scf in shards.items():
        check_writable(scf, f"{ipath}: shard {name}")
    for name in shards:
        if os.path.isabs(name) or os.path.normpath(name) != os.path.basename(name) or name in (".", ".."):
            raise UnsupportedError(
                f"{ipath}: shard {name!r} is not a plain file name next to the index; "
                "ckptfix writes sharded outputs only as files beside their index"
            )


def _output_dir(ipath: str, shards: Mapping[str, Any], output: str | None, suffix: str, force: bool) -> str:
    """The directory to write to, refused when it is the input's or would lose files."""
    src_dir = os.path.dirname(os.path.abspath(ipath))
    out_dir = os.path.abspath(output) if output else f"{src_dir}.{suffix}"
    if out_dir == src_dir:
        raise OutputError(output_is_input(out_dir))
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise OutputError(f"{out_dir} exists and is not a directory; for a sharded index -o names a directory")
    names = [os.path.basename(ipath), *shards]
    clash = [n for n in names if os.path.exists(os.path.join(out_dir, n))]
    if clash and not force:
        raise OutputError(already_exists(os.path.join(out_dir, clash[0]), directory=True))
    return out_dir


def _module_renames(rename: Mapping[str, str]) -> dict[str, str]:
    """module path -> new module path, ancestors too (``"module"`` -> ``""``), from the key renames."""
    modules: dict[str, str] = {}
    for a, b in rename.items():
        pa, pb = a.split("."), b.split(".")
        while len(pa) > 1 and len(pb) >= 1 and pa[-1] == pb[-1]:
            pa, pb = pa[:-1], pb[:-1]
            modules.setdefault(".".join(pa), ".".join(pb))
    return modules


def _rename_module_probe(probe: str, modules: Mapping[str, str]) -> str:
    path, _, leaf = probe.rpartition(".")
    new = modules.get(path, path)
    return f"{new}.{leaf}" if new else leaf


def _write_shards(
    shards: Mapping[str, CheckpointFile],
    rename: Mapping[str, str],
    out_dir: str,
    fsync: bool,
    written: list[str],
    notes: list[str],
    jobs: int = 1,
) -> None:
    """Each shard under its own name in ``out_dir``, keys renamed, ``jobs`` at a time (``written`` gets each path)."""
    modules = _module_renames(rename)

    def one_shard(name: str, scf: CheckpointFile) -> None:
        key_path, ssd = find_state_dict(scf.obj)
        new_ssd: Any = type(ssd)() if isinstance(ssd, dict) else {}
        for k, v in ssd.items():
            new_ssd[rename.get(k, k)] = v
        meta = getattr(ssd, "_metadata", None)
        if isinstance(meta, dict):  # module paths follow their tensors' renames
            new_ssd._metadata = rekey_metadata(meta, lambda probe: _rename_module_probe(probe, modules))
        dst = os.path.join(out_dir, name)
        write_file(scf, key_path, new_ssd, dst, fsync=fsync, rename=rename, what=dst)
        written.append(dst)

    run_tasks([functools.partial(one_shard, name, scf) for name, scf in shards.items()], jobs)
    for name, scf in shards.items():
        if scf.format == Format.TORCH_LEGACY:
            notes.append(f"legacy shard {name} was written in the zip format")
