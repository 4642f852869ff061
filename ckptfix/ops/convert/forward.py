"""Checkpoint -> safetensors, without loading the checkpoint.

The fast path never imports torch: :func:`ckptfix.formats.read_checkpoint` gives every tensor as a
:class:`~ckptfix.pickles.TensorRecord` whose bytes are a byte range of the source file (zip
member, legacy stream, safetensors or ``.bin`` shard), so a contiguous tensor is copied straight
from the source into the output with ``copy_file_range``; a strided view is gathered from just
its span of bytes.  Inputs whose tensors torch code builds go through
:func:`ckptfix.ops.load.load_checkpoint`; DCP directories are streamed from their chunks by
:mod:`ckptfix.ops.convert.dcp_in`.  The metadata written is described in :mod:`ckptfix.formats.stmeta`.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from ckptfix.errors import NoTensorsError, UnsupportedError
from ckptfix.files.outputs import OutputOptions
from ckptfix.formats import (
    CheckpointFile,
    Format,
    Input,
    SafetensorsDetails,
    ShardedDetails,
    classify,
    read_checkpoint,
    stmeta,
)
from ckptfix.formats.registry import dispatch
from ckptfix.formats.safetensors_fmt import DTYPE_TO_ST
from ckptfix.formats.statedict import at_path, flatten_state_dict, locate_state_dict, require_tensors
from ckptfix.ops.convert.extras import split_checkpoint
from ckptfix.ops.convert.options import ConvertKeywords, ConvertOptions, options_of, refuse_inapplicable
from ckptfix.ops.convert.paths import check_outputs, default_st_output
from ckptfix.ops.convert.plan import check_expansion, output_names, plan_records, plan_tensors, tied_names
from ckptfix.ops.convert.report import ConvertReport
from ckptfix.ops.convert.write import write_outputs
from ckptfix.pickles import TensorRecord, is_tensor_like
from ckptfix.pickles.placeholders import check_not_partitioned
from ckptfix.pickles.subclass import flatten_named, torchao_entries
from ckptfix.text import parse_size

if TYPE_CHECKING:
    from typing_extensions import Unpack


def convert_to_safetensors(
    src: str | os.PathLike,
    dst: str | os.PathLike | None = None,
    *,
    outputs: OutputOptions | None = None,
    options: ConvertOptions | None = None,
    optimizer_files: Sequence[str] = (),
    extra_metadata: Mapping[str, Any] | None = None,
    **keywords: Unpack[ConvertKeywords],
) -> ConvertReport:
    """Write ``src``'s state dict as safetensors at ``dst`` (default: ``src`` with a ``.safetensors`` suffix).

    The options are :class:`~ckptfix.files.outputs.OutputOptions` (``outputs``) and
    :class:`~ckptfix.ops.convert.options.ConvertOptions` (``options``), or any of their fields as keywords
    (``convert_to_safetensors(src, dst, key="model", force=True)``); the ones that apply here:

    Args:
        src: the checkpoint: a torch zip or legacy file, safetensors, TorchScript, a sharded index
            (or its folder) or a DCP directory.
        dst: the output (default: next to ``src``, see below); overrides ``outputs.output``.
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
        drop: names or dotted paths (``fnmatch`` patterns; a pattern also matches everything under
            it) of tensors to leave out.  Any other tensor of the input the output would not hold (a
            quantized model's packed params, tensors in a list outside the state dict, an EMA copy ...)
            is refused before anything is written; the report lists what was dropped.  An explicit
            ``key`` converts that entry only: tensors elsewhere are dropped as asked (and listed).
        jobs: write (and verify) tensors in this many threads (``0``: one per CPU); the output is the
            same bytes whatever the number.  Memory: ``jobs`` x the 8 MiB copy buffer (x4 for DCP chunks).
        optimizer_files: optimizer states saved beside the weights (a Trainer's ``optimizer.pt``,
            accelerate's ``optimizer.bin``): with ``include_optimizer``, their tensors are written as
            ``<file stem>.<path>`` (``optimizer.state.0.exp_avg``), the rest kept in the metadata.
        extra_metadata: plain data kept in the metadata beside the checkpoint's own entries (a Lightning
            ``meta.pt``); the checkpoint's entries win.

    An optimizer state on its own (``optimizer.pt``) is written only with ``include_optimizer`` (its
    tensors as ``optimizer.<path>``); without it :class:`~ckptfix.errors.NoModelWeightsError`.

    The default output of a Hugging Face ``pytorch_model.bin`` (or its sharded index) is
    ``model.safetensors`` in the same folder (``model-0000k-of-0000N.safetensors`` and
    ``model.safetensors.index.json`` when sharded), where ``from_pretrained`` looks.

    Returns:
        A :class:`ConvertReport`.

    Raises:
        OutputError: the output exists (without ``force``), is the input, or cannot be written.
        UnsupportedError: a tensor whose dtype/kind safetensors cannot hold (named in the message).
        OptionNotApplicableError: an option of another direction (``restore_wrapper``, ``shards``, ``tag`` ...).
        VerificationError: the written file does not read back identical; nothing is left behind.
        ResourceLimitError: the output would be over 4x the input + 64 MiB (without ``allow_expand``).
    """
    t0 = time.perf_counter()
    o, c = options_of(dst, outputs, options, keywords)
    refuse_inapplicable("safetensors", o, c)
    given, src = src, os.fspath(src)
    dst = o.output if o.output is not None else default_st_output(src)
    shard_limit = parse_size(c.max_shard_size) if c.max_shard_size else None
    if not c.max_shard_size:
        check_outputs([dst], src, o.force)  # fail before any reading
    inp = classify(given)  # the router's Input, or the one sniff here: the reads below take its format
    streamed = dispatch(inp.format, "convert", src)  # the format registry's entry, or its refusal
    if streamed is not convert_to_safetensors:  # a format with its own converter (DCP: streamed from its chunks)
        done: ConvertReport = streamed(src, dst, o, c, extra_metadata=extra_metadata)
        return done
    report = ConvertReport(source=src, outputs=[dst])
    source = _read_source(inp, o.key, c.allow_globals, c.trust, report)
    unwritten: list[tuple[str, Any]] = []
    if source.kind == "optimizer":  # an optimizer.pt on its own: its tensors are all there is
        from ckptfix.ops.convert.extras import optimizer_extras

        extra, opt_named = optimizer_extras(src, source.obj, c.include_optimizer, report, "optimizer")
        source.named = []
    else:
        extra, opt_named = split_checkpoint(
            source.obj,
            source.key_path,
            source.state_dict,
            c.include_optimizer,
            report,
            node=source.holder,
            unwritten=unwritten,
        )
    if c.include_optimizer and optimizer_files:
        from ckptfix.ops.convert.extras import optimizer_extras

        for of in optimizer_files:
            stem = os.path.splitext(os.path.basename(of))[0]
            ocf = read_checkpoint(of)
            oextra, onamed = optimizer_extras(of, ocf.obj, True, report, stem)
            extra.update(oextra)
            opt_named = list(opt_named) + onamed
    if extra_metadata:
        extra = {**extra_metadata, **extra}
    from ckptfix.formats.hfarch import own_prefixes

    kept = drop_named(source.named, c.drop, report)
    refuse_unwritten(src, unwritten, c.drop, report, source.key_path, c.strict and o.key is None, source.obj)
    strip = c.strip_prefix
    if strip is True and source.kind in ("module", "modules"):
        strip, report.kept_names = _module_strip(source)
    named, order = output_names(kept, opt_named, strip, report, own=own_prefixes(src))
    if not named:
        raise NoTensorsError(
            f"{src}: the state dict holds no tensors, so there is nothing to convert; "
            "`ckptfix inspect` shows what the file holds"
        )
    named, torchao_meta, report.subclasses = flatten_named(named)  # torchao's tensors: their parts, as torchao writes
    tied = tied_names(named, order, c.keep, src, bool(c.strip_prefix))
    views: dict[str, dict[str, Any]] = {}
    if source.use_torch:
        items = plan_tensors(named, report, tied)
    else:
        items, views = plan_records(named, report, tied)
        check_expansion(items, source.file_size, c.allow_expand)
    if report.aliases:
        report.tied_rule = "--keep" if tied.used_keep else tied.source
    retied = _hf_retied(src, named, report) if c.ckptfix_metadata and not source.key_path else []
    metadata = {"format": "pt"}
    if c.ckptfix_metadata:
        metadata = stmeta.encode(
            source_format=source.format,
            key_path=source.key_path,
            order=[n for n, _ in named] + retied,
            aliases=report.aliases,
            views=views,
            extra=extra,
            skipped=report.skipped,
        )
    renamed = {old: new for (old, _), (new, _) in zip(kept, named, strict=False) if old != new}
    metadata = carry_metadata(metadata, source.metadata, renamed)
    if torchao_meta or torchao_entries(metadata):  # torchao's tensors, read from a pickle or already flat
        # transformers' torchao loader json-parses every dotted metadata key and takes each value for a dict:
        # ckptfix's JSON lists would break from_pretrained (tensor_names holds the order)
        metadata = {k: v for k, v in metadata.items() if k not in (stmeta.ORDER, stmeta.KEY_PATH)}
        metadata.update(torchao_meta)
    write_outputs(
        dst,
        items,
        metadata,
        max_shard_size=shard_limit,
        verify=o.verify,
        fsync=bool(o.fsync),
        force=o.force,
        src=src,
        progress=o.progress,
        report=report,
        jobs=o.jobs,
    )
    report.seconds = time.perf_counter() - t0
    return report


def _dropped(name: str, patterns: Sequence[str]) -> bool:
    """``name`` matches a ``--drop`` pattern (``fnmatch``), or sits under one (``pattern.``...)."""
    import fnmatch

    return any(name == p or name.startswith(p + ".") or fnmatch.fnmatchcase(name, p) for p in patterns)


def drop_named(named: list[tuple[str, Any]], patterns: Sequence[str], report: ConvertReport) -> list[tuple[str, Any]]:
    """The state dict's tensors less those ``patterns`` name (recorded in ``report.dropped``)."""
    if not patterns:
        return named
    kept = []
    for n, v in named:
        if _dropped(n, patterns):
            report.dropped.append(n)
        else:
            kept.append((n, v))
    return kept


def refuse_unwritten(
    src: str,
    unwritten: list[tuple[str, Any]],
    patterns: Sequence[str],
    report: ConvertReport,
    key_path: Sequence[str] = (),
    strict: bool = False,
    obj: Any = None,
) -> None:
    """Settle the tensors of the input the output has no place for (issue 34 A).

    Loss *inside* the state dict (tensors in a non-tensor value of it: quantized packed params ...) is
    refused unless ``--drop`` names it.  Tensors *outside* the state dict (an EMA copy, a callback's
    ``kth_value``, metric buffers in the hyper-parameters) are left out and named in ``report.excluded``
    (with their count in ``report.excluded_tensors``); ``strict`` refuses them as well, as loss.

    Args:
        src: the input (for the message).
        unwritten: ``(dotted path, tensor)`` pairs.
        patterns: the ``--drop`` patterns: what they name is dropped on request (``report.dropped``).
        report: gets ``dropped``, ``excluded``, ``excluded_tensors``, ``excluded_detail``.
        key_path: where the state dict sits (empty: the state dict is the whole file).
        strict: refuse tensors outside the state dict too (``--strict``).
        obj: the whole checkpoint (to say which excluded entry ``--key`` converts).

    Raises:
        UnsupportedError: tensors the output would not hold, not named by ``--drop``.
    """
    inside_prefix = ".".join(key_path) + "." if key_path else ""
    left = []
    for path, t in unwritten:
        if _dropped(path, patterns):
            report.dropped.append(path)
        elif strict or not key_path or path.startswith(inside_prefix):
            left.append((path, t))
        else:
            entry = _entry_of(path, key_path)
            if entry not in report.excluded:
                report.excluded.append(entry)
            report.excluded_tensors[entry] = report.excluded_tensors.get(entry, 0) + 1
    for entry, n in report.excluded_tensors.items():
        what = f"{n} tensor{'s' if n != 1 else ''}"
        if _is_state_dict_entry(obj, entry):
            weights = "the EMA weights" if "ema" in entry.lower() else "them"
            what += f": --key {entry.replace('.', '/')} converts {weights}"
        report.excluded_detail[entry] = what
    if not left:
        return
    quantized = [p for p, t in left if getattr(t, "kind", None) == "quantized" or getattr(t, "is_quantized", False)]
    names = ", ".join(p for p, _ in left[:3]) + (f" and {len(left) - 3} more" if len(left) > 3 else "")
    if quantized:
        why = (
            "they are quantized (e.g. torch.ao.quantization.quantize_dynamic's packed qint8 weights and "
            "their biases), which safetensors has no dtype for; convert the float model before "
            "quantizing, or keep the .pt"
        )
        hint = "*_packed_params*"
    elif strict and key_path and not any(p.startswith(inside_prefix) for p, _ in left):
        why = "they sit outside the state dict, and --strict keeps every tensor or refuses"
        hint = left[0][0].split(".")[0] + "*"
    else:
        why = "they sit in non-tensor values of the state dict, which safetensors cannot hold"
        hint = left[0][0].split(".")[0] + "*"
    raise UnsupportedError(
        f"{src}: {len(left)} tensor(s) of the input would be missing from the output: {names}; {why}. "
        f"Nothing was written. Pass --drop '{hint}' to leave them out on purpose, or --key to convert the "
        "entry that holds them"
    )


def _entry_of(path: str, key_path: Sequence[str]) -> str:
    """The entry of the checkpoint that holds ``path``: its first segment off the state dict's path."""
    segs = path.split(".")
    i = 0
    while i < len(key_path) - 1 and i < len(segs) - 1 and segs[i] == key_path[i]:
        i += 1
    return ".".join(segs[: i + 1])


def _is_state_dict_entry(obj: Any, entry: str) -> bool:
    """Is ``obj``'s entry at dotted ``entry`` a mapping of names to tensors (what ``--key`` converts)?"""
    node = obj
    for seg in entry.split("."):
        if not isinstance(node, Mapping) or seg not in node:
            return False
        node = node[seg]
    if not isinstance(node, Mapping) or not node:
        return False
    vals = list(node.values())
    return sum(1 for v in vals if is_tensor_like(v)) * 2 >= len(vals)


@dataclass
class _Source:
    """What a conversion reads: the state dict's tensors and the checkpoint around them."""

    format: str
    file_size: int
    obj: Any  # the whole checkpoint
    key_path: tuple[str, ...]
    state_dict: Mapping[str, Any]
    named: list[tuple[str, Any]]
    use_torch: bool
    holder: Any  # what holds the state dict in ``obj`` (None: the state dict itself)
    kind: str = "mapping"  # as locate_state_dict says: mapping, module, sequence, optimizer
    metadata: dict[str, str] | None = None  # a safetensors input's own __metadata__ (every shard's, for an index)


def _refuse_one_rank(src: str, sd: Mapping[str, Any]) -> None:
    """One rank's file of DTensor shards (an FSDP per-rank state dict) alone: the other ranks hold the rest."""
    from ckptfix.errors import PartitionedCheckpointError
    from ckptfix.formats.dtensor_ranks import one_rank_message

    msg = one_rank_message(src, sd)
    if msg is not None:
        raise PartitionedCheckpointError(msg)


def _read_source(
    inp: Input, key: str | None, allow_globals: Sequence[str], trust: bool, report: ConvertReport
) -> _Source:
    """Read ``inp`` torch-free; through torch only when some tensor's bytes are not a byte range of the file."""
    src = inp.path
    cf = read_checkpoint(inp)
    report.source_format = cf.format
    report.stubbed_globals = sorted(g for g in cf.stubbed if not g.endswith("Storage"))
    obj = cf.obj
    key_path: tuple[str, ...]
    sd: Mapping[str, Any]
    kind = "mapping"
    if cf.format == Format.TORCHSCRIPT and cf.state_root and key is None:
        key_path, sd = (), cf.state_root
        obj = sd
    else:
        if key is None:
            require_tensors(cf, src, "convert")
        key_path, sd, kind = locate_state_dict(cf.obj, key)
        if kind in ("tensor", "sequence"):
            report.unnamed = (
                'one bare tensor (torch.save(tensor)), named "tensor"'
                if kind == "tensor"
                else 'a list/tuple of tensors, each named by its position ("0", "1", "1.2" ...)'
            )
    check_not_partitioned(src, cf.obj, sd, "convert")
    _refuse_one_rank(src, sd)
    report.key_path = key_path = tuple(key_path)
    named = [(str(k), v) for k, v in sd.items() if is_tensor_like(v)]
    odd = [k for k, v in sd.items() if not isinstance(k, str) and is_tensor_like(v)]
    if odd and not report.unnamed:
        kinds = sorted({type(k).__name__ for k in odd})
        report.unnamed = (
            f"{len(odd)} tensor key(s) that are not strings ({odd[0]!r}{', ...' if len(odd) > 1 else ''}: "
            f"{'/'.join(kinds)}), each named by its str() ({str(odd[0])!r}): a loader of the output gets string keys"
        )
    use_torch = any(_needs_torch(v) for _, v in named)
    from ckptfix.formats.zipfmt import big_endian_parts

    big = big_endian_parts(cf)
    if big and named:  # big-endian storages: torch.load swaps them to this machine's order (copied raw they'd be
        # garbage in a little-endian safetensors file); without torch, refused (exit 8)
        from ckptfix._torch import require_torch
        from ckptfix.errors import TorchMissingError

        try:
            require_torch("convert of a big-endian checkpoint")
        except TorchMissingError:
            raise UnsupportedError(
                f"{big[0]}: its storages are big-endian (byteorder 'big', saved on s390x or another big-endian "
                "machine); ckptfix does not swap bytes without torch: pip install torch (convert then reads it "
                "with torch.load, which swaps them)"
            ) from None
        use_torch = True
    if use_torch:
        from ckptfix.ops.load import load_checkpoint

        lc = load_checkpoint(inp, "cpu", key=key, allow_globals=tuple(allow_globals), trust=trust)
        report.used_torch = True
        report.key_path = key_path = tuple(lc.key_path)
        sd = lc.state_dict
        obj = lc.checkpoint if lc.checkpoint is not None else sd
        named = flatten_state_dict(sd)
    holder = at_path(obj, key_path) if key_path and not use_torch else None
    return _Source(cf.format, cf.file_size, obj, key_path, sd, named, use_torch, holder, kind, _input_metadata(cf))


#: pickled wrapper modules -> the attribute holding the wrapped model (its prefix is the one to strip)
_WRAPPERS = {
    "torch.nn.parallel.data_parallel.DataParallel": "module.",
    "torch.nn.parallel.distributed.DistributedDataParallel": "module.",
    "torch.distributed.fsdp.fully_sharded_data_parallel.FullyShardedDataParallel": "_fsdp_wrapped_module.",
    "torch._dynamo.eval_frame.OptimizedModule": "_orig_mod.",
}


def _module_strip(source: _Source) -> tuple[bool | str, str]:
    """``(strip_prefix, note)`` for ``--strip-prefix`` of a whole pickled module: its wrapper's attribute for a
    pickled wrapper, else nothing, with the note saying why.

    ``torch.save(model)`` of a ``DetectionModel`` names its tensors ``model.0.conv.weight``: ``model.`` is its own
    attribute, and stripping it makes a file that no longer loads into the class.  Only a pickled DataParallel,
    DDP, FSDP or ``torch.compile`` wrapper has a wrapper's prefix to strip.
    """
    from ckptfix.formats.statedict import at_path
    from ckptfix.pickles import global_name

    mod = at_path(source.obj, source.key_path) if source.key_path else source.obj
    cls = global_name(type(mod))
    if cls in _WRAPPERS:
        return _WRAPPERS[cls], ""
    short = cls.rsplit(".", 1)[-1]
    return False, f"the names are a pickled {short}'s own state_dict() names (not a wrapper's): nothing stripped"


def _hf_retied(src: str, named: list[tuple[str, Any]], report: ConvertReport) -> list[str]:
    """The tied names a Hugging Face model's file stores once (``save_pretrained`` leaves GPT-2's ``lm_head.weight``
    out), recorded as aliases of what they are tied to, so the output's loaders give what ``model.state_dict()``
    gives; the names, for the recorded order (after the stored ones, as the model's own state dict has them)."""
    from ckptfix.formats.hfarch import missing_ties

    names = {n for n, _ in named}
    missing, why = missing_ties(src, names)
    missing = {a: t for a, t in missing.items() if a not in report.aliases}
    if not missing:
        return []
    report.aliases.update(missing)
    report.tied_rule = report.tied_rule or why
    return list(missing)


def _input_metadata(cf: CheckpointFile) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors file, or of every safetensors shard of an index (merged)."""
    if isinstance(cf.details, SafetensorsDetails):
        return dict(cf.details.metadata)
    merged: dict[str, str] = {}
    if isinstance(cf.details, ShardedDetails):
        for shard in cf.details.shards.values():
            if isinstance(shard.details, SafetensorsDetails):
                merged.update(shard.details.metadata)
    return merged


def carry_metadata(
    written: dict[str, str], given: Mapping[str, str] | None, renamed: Mapping[str, str]
) -> dict[str, str]:
    """``written`` (ckptfix's own entries) with every entry of the input's ``__metadata__`` kept: metadata is
    data (torchao's per-tensor ``{"_type": "Int8Tensor", ...}``, a user's notes).  An entry named after a tensor
    follows the tensor's new name; ``format`` and ckptfix's own entries are written anew.
    """
    out = dict(written)
    for k, v in (given or {}).items():
        if k == "format" or k.startswith(stmeta.PREFIX):
            continue
        out.setdefault(renamed.get(k, k), v)
    return out


def _needs_torch(v: Any) -> bool:
    """A dense tensor safetensors can hold whose bytes are not a byte range of the file (built by torch code)."""
    return (
        isinstance(v, TensorRecord)
        and v.kind == "dense"
        and v.dtype in DTYPE_TO_ST
        and (v.storage is None or v.storage.file_offset is None)
    )
