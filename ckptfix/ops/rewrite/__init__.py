"""Rename a checkpoint's state-dict keys on disk without decoding a tensor.

The key renames come from :mod:`ckptfix.ops.prefixes`; this module applies them to
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

Modules: :mod:`~ckptfix.ops.rewrite.writers` (writing a file back), :mod:`~ckptfix.ops.rewrite.verify`
(reading it back before the rename), :mod:`~ckptfix.ops.rewrite.output` (paths, atomic write),
:mod:`~ckptfix.ops.rewrite.sharded` (an index and its shards), :mod:`~ckptfix.ops.rewrite.location`
(``--map-location``), :mod:`~ckptfix.ops.rewrite.report`; DCP directories: :mod:`ckptfix.ops.rewrite.dcp`.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import ckptfix.formats.layouts  # noqa: F401  (registers checkpoint-N/ sub-folders for sniff's folder message)
from ckptfix.errors import NoTensorsError, UnsupportedError
from ckptfix.files import pins
from ckptfix.files.outputs import OutputKeywords, OutputOptions
from ckptfix.files.progress import reporting
from ckptfix.files.source import in_session
from ckptfix.formats import CheckpointFile, Format, Input, SafetensorsDetails, classify, read_checkpoint, stmeta
from ckptfix.formats.registry import dispatch
from ckptfix.formats.statedict import locate_state_dict, require_tensors
from ckptfix.ops.rewrite.dcp import rewrite_dcp
from ckptfix.ops.rewrite.location import kept_device_note, parse_map_location, relocate
from ckptfix.ops.rewrite.output import default_output, prepare_output, write_atomic
from ckptfix.ops.rewrite.remote import is_remote, rewrite_remote
from ckptfix.ops.rewrite.report import RewriteReport, Transform, detail
from ckptfix.ops.rewrite.sharded import rewrite_sharded
from ckptfix.ops.rewrite.verify import check_written, pickle_globals
from ckptfix.ops.rewrite.writers import (
    WRITABLE,
    check_str_keys,
    check_writable,
    format_out,
    write_checkpoint_zip,
    write_file,
)

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = [
    "rewrite_checkpoint",
    "REWRITE_USES",
    "RewriteReport",
    "Transform",
    "WRITABLE",
    "parse_map_location",
    "default_output",
    "prepare_output",
    "write_atomic",
    "write_checkpoint_zip",
    "check_written",
    "pickle_globals",
]


#: the :class:`~ckptfix.files.outputs.OutputOptions` fields a rewrite uses (it always reads its output back)
REWRITE_USES = frozenset(
    ("output", "in_place", "backup", "force", "fsync", "suffix", "jobs", "progress", "key", "map_location", "link")
)

#: a format's ``rewrite`` entry in the format registry (:func:`rewrite_checkpoint` routes through it):
#: ``(input, transform, outputs) -> report``
Rewrite = Callable[[Input, Transform, OutputOptions], RewriteReport]


@in_session
def rewrite_checkpoint(
    src: str | Input,
    transform: Transform,
    *,
    outputs: OutputOptions | None = None,
    **keywords: Unpack[OutputKeywords],
) -> RewriteReport:
    """Apply ``transform`` to the state dict of ``src`` and write the result atomically.

    Args:
        src: checkpoint file (torch zip, legacy, Lightning ``.ckpt`` or safetensors), or a sharded
            ``*.index.json`` (or its directory) whose shards are any of those; or its
            :class:`~ckptfix.formats.Input` (:func:`~ckptfix.formats.classify`: not sniffed again).
        transform: state dict -> (renamed state dict, report); must raise to refuse (collisions).
        outputs: where and how to write (:class:`~ckptfix.files.outputs.OutputOptions`), or its fields as
            ``keywords``; a rewrite uses:

            * ``output``: where to write; default ``<stem>.<suffix><ext>`` next to ``src``.  For a sharded
              input, a directory (default ``<dir>.<suffix>`` beside the shards' directory) that gets
              the rewritten shards and index under their own names.
            * ``in_place``: replace ``src`` itself (temp file + fsync + rename), keeping ``src.bak`` unless
              ``backup=False``.  Not for sharded inputs (several files cannot be replaced atomically).
            * ``force``: overwrite an existing ``output``.
            * ``key``: where the state dict sits (found automatically otherwise).
            * ``map_location``: rewrite storage location tags (``"cpu"`` or ``"cuda:7=cuda:0,..."``).
            * ``fsync``: flush to disk before the rename (default: on for ``in_place``).
            * ``suffix``: the default output's word (default ``"fixed"``).
            * ``progress``: ``progress(done_bytes, total_bytes)`` as tensor data is copied (total: the input's size).
            * ``jobs``: shards of a sharded index rewritten at a time (``0``: one per CPU); same output for any number.
            * ``link``: a DCP directory's output hard-links the input's data files instead of copying them
              (they are then shared: a later save into the output changes the input); refused for other inputs.

    Returns:
        RewriteReport (``output`` is None when nothing needed to change).

    Raises:
        CheckpointNotFoundError, CorruptCheckpointError: the input is missing or unreadable.
        KeyConflictError: the transform refused (a collision, an ambiguous rename).
        NoTensorsError: the file holds no state dict.
        OutputError: the output exists (without ``force``), is the input, or cannot be written.
        UnsupportedError: TorchScript, or ``in_place`` on a sharded index.
        OptionNotApplicableError: ``verify=False`` (a rewrite always reads its output back).
        VerificationError: the written file did not read back (nothing was replaced).
    """
    o = OutputOptions.build(outputs, keywords).named("fixed")
    o.refuse(REWRITE_USES, "renaming keys (a rewrite always reads its output back before the rename)")
    if is_remote(src, o.output):  # a URL in or out: staged locally (ckptfix.ops.rewrite.remote)
        return rewrite_remote(os.fspath(src), o, lambda s, oo: rewrite_checkpoint(s, transform, outputs=oo))
    given, src = src, os.fspath(src)
    with reporting(o.progress, _input_bytes(src)):
        inp = classify(given)  # the one sniff: the reads below take its format
        try:
            rewrite: Rewrite = dispatch(inp.format, "rewrite", src)  # the format registry's entry, or its refusal
        except UnsupportedError:  # refused, but a damaged file is reported as damaged (exit 4): read it first
            _refuse_link(inp, o)
            read_checkpoint(inp)
            raise
        return rewrite(inp, transform, o)


def rewrite_directory(inp: Input, transform: Transform, outputs: OutputOptions) -> RewriteReport:
    """The ``rewrite`` of a DCP directory: ``.metadata`` rewritten, data copied (:mod:`ckptfix.ops.rewrite.dcp`)."""
    return rewrite_dcp(inp.path, transform, outputs)


def rewrite_index(inp: Input, transform: Transform, outputs: OutputOptions) -> RewriteReport:
    """The ``rewrite`` of a sharded index: every shard and the index (:mod:`ckptfix.ops.rewrite.sharded`)."""
    _refuse_link(inp, outputs)
    return rewrite_sharded(read_checkpoint(inp), transform, outputs)


def rewrite_file(inp: Input, transform: Transform, outputs: OutputOptions) -> RewriteReport:
    """The ``rewrite`` of one torch zip, legacy or safetensors file (:data:`~ckptfix.ops.rewrite.writers.WRITABLE`)."""
    _refuse_link(inp, outputs)
    return _rewrite_file(read_checkpoint(inp), transform, outputs)


def _refuse_link(inp: Input, outputs: OutputOptions) -> None:
    if outputs.link:
        raise UnsupportedError(
            f"{inp}: --link applies to DCP directories only (a rename of any other checkpoint writes new files)"
        )


def _input_bytes(src: str) -> int:
    if os.path.isdir(src):
        return sum(e.stat().st_size for e in os.scandir(src) if e.is_file())
    if src.endswith(".json"):
        return sum(e.stat().st_size for e in os.scandir(os.path.dirname(os.path.abspath(src))) if e.is_file())
    try:
        return pins.fstat(src).st_size
    except OSError:
        return 0


def _rewrite_file(cf: CheckpointFile, transform: Transform, outputs: OutputOptions) -> RewriteReport:
    """One torch zip, legacy or safetensors file: its state dict renamed, everything else kept."""
    src = cf.path
    output, in_place, backup, key, map_location = (
        outputs.output, outputs.in_place, outputs.backup, outputs.key, outputs.map_location
    )  # fmt: skip
    check_writable(cf)
    if key is None and cf.format != Format.SAFETENSORS:
        require_tensors(cf, src, "rename")
    key_path, sd, holder = locate_state_dict(cf.obj, key)
    if holder in ("tensor", "sequence"):
        what = "one bare tensor (torch.save(tensor))" if holder == "tensor" else "a list/tuple of tensors"
        raise NoTensorsError(
            f"{src}: {what}, not a state dict: its tensors have no names, so there are no keys to "
            "rename; ckptfix convert names them ("
            + ('"tensor"' if holder == "tensor" else '"0", "1", ...')
            + ") and load_anywhere reads them"
        )
    if holder != "mapping":
        what = "a whole pickled nn.Module"
        raise UnsupportedError(
            f"{src}: {what}, not a state dict, so there are no keys to rename in the file; "
            "convert it (ckptfix convert, which names its tensors as state_dict() does) or "
            "load_anywhere it and save the state dict"
        )
    check_str_keys(src, sd)
    from ckptfix.pickles.placeholders import check_not_partitioned

    check_not_partitioned(src, cf.obj, sd, "renaming its keys")
    if cf.format == Format.SAFETENSORS:  # the names ckptfix convert stored once (aliases) are keys too
        sd = stmeta.logical_state_dict(sd, cf.details_as(SafetensorsDetails).metadata)
    new_sd, report = transform(sd)
    rename = dict(zip(sd.keys(), new_sd.keys(), strict=False))
    renamed = sum(1 for a, b in zip(sd.keys(), new_sd.keys(), strict=False) if a != b)
    relocated = relocate(cf, map_location)
    fmt_out = format_out(cf)
    rep = RewriteReport(
        source=src,
        output=None,
        format_in=cf.format,
        format_out=fmt_out,
        key_path=list(key_path),
        changed=bool(renamed or relocated),
        renamed=renamed,
        detail=detail(report),
        relocated=relocated,
    )
    if rep.changed and (other := _other_state_dicts(cf.obj, key_path)):
        rep.notes.append(_other_note(key_path, len(sd), other))
    if not rep.changed and (output is None or in_place):
        rep.notes.append("nothing to change; no file written")
        return rep
    if not rep.changed:  # -o OUT: a pipeline reads OUT, so it is written (an unchanged copy), as by every command
        rep.notes.append("nothing to change; the output is an unchanged copy")
    if cf.format == Format.TORCH_LEGACY:
        rep.notes.append("the legacy (pre-1.6) input was written in the zip format torch uses since 1.6")
    if kept := kept_device_note([cf]):
        rep.notes.append(kept)
    dst, fsync_out = prepare_output(src, outputs, fmt_out=fmt_out, notes=rep.notes)
    rep.backup = write_file(
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


def _other_state_dicts(obj: Any, key_path: Sequence[str]) -> dict[str, int]:
    """``{name: tensors}`` of the checkpoint's other top-level state dicts (timm's ``state_dict_ema`` beside
    ``state_dict``), which a rename of the one at ``key_path`` leaves as they were."""
    from ckptfix.formats.statedict import is_tensor_dict

    if not isinstance(obj, Mapping) or len(key_path) != 1:
        return {}
    return {str(k): len(v) for k, v in obj.items() if isinstance(k, str) and k != key_path[0] and is_tensor_dict(v)}


def _other_note(key_path: Sequence[str], n: int, other: Mapping[str, int]) -> str:
    """Which state dict was renamed, and the others left as they were (with the --key that renames each)."""
    names = ", ".join(f"{k} ({v} tensors)" for k, v in other.items())
    ema = [k for k in other if "ema" in k.lower()]
    hint = f"; a loader that prefers EMA weights (timm's load_checkpoint, use_ema=True) takes {ema[0]}" if ema else ""
    first = next(iter(other))
    return (
        f"renamed the state dict at {'/'.join(key_path)!r} ({n} tensors); left as they were: {names}{hint}; "
        f"--key {first} renames that one instead"
    )
