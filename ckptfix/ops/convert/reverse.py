"""safetensors -> torch: a ``.safetensors`` file (or sharded index) written back as a ``.pth`` checkpoint.

Tensors stored once come back shared (:func:`ckptfix.formats.stmeta.restore`); with ``restore_wrapper``
the checkpoint around the state dict comes back too (:func:`rebuild_checkpoint`).  Needs torch.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any, Mapping

from ckptfix._torch import require_torch
from ckptfix.errors import (
    CheckpointNotFoundError,
    CkptfixError,
    CorruptCheckpointError,
    OutputError,
    UnsupportedError,
    VerificationError,
)
from ckptfix.files import pins
from ckptfix.files.atomic import fsync_dir
from ckptfix.files.outputs import OutputOptions
from ckptfix.formats import Format, Input, classify, stmeta
from ckptfix.formats.sharded import load_index
from ckptfix.formats.statedict import at_path
from ckptfix.ops.convert.extras import is_optimizer_key
from ckptfix.ops.convert.options import ConvertKeywords, ConvertOptions, options_of, refuse_inapplicable
from ckptfix.ops.convert.paths import check_outputs, default_output, temp_for
from ckptfix.ops.convert.report import ConvertReport
from ckptfix.ops.convert.torchao import rebuild, same_tensor, torchao_entries

if TYPE_CHECKING:
    from typing_extensions import Unpack


def rebuild_checkpoint(
    state_dict: Mapping[str, Any], metadata: Mapping[str, str] | None
) -> tuple[Any, tuple[str, ...]]:
    """The checkpoint a ckptfix-written safetensors file came from, as far as its metadata holds it.

    The ``ckptfix.extra`` entries (epoch, step, hyper-parameters, ...) are put back around the state
    dict, which goes where ``ckptfix.key_path`` says it was; optimizer tensors written with
    ``include_optimizer`` go back into the optimizer state (with its integer parameter ids).  What
    could not be represented as JSON when converting (placeholders of classes become plain dicts,
    excluded optimizer state) is not there.

    Args:
        state_dict: the tensors, aliases restored (:func:`ckptfix.formats.stmeta.restore`).
        metadata: the file's ``__metadata__``.

    Returns:
        ``(checkpoint, key_path)``.
    """
    meta = dict(metadata or {})
    sd = dict(state_dict)
    key_path = stmeta.key_path(meta)
    extra = stmeta.extra(meta)

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

    opt = {k: decode(extra.pop(k)) for k in [k for k in extra if is_optimizer_key(k)]}
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


def _read_safetensors_sd(inp: Input) -> tuple[dict[str, Any], dict[str, str], str]:
    """(state dict, metadata, format) of a .safetensors file or a sharded safetensors index, via safetensors."""
    from safetensors import safe_open

    src, kind = inp.path, inp.format
    if kind == Format.SAFETENSORS:
        files = [src]
    elif kind == Format.SHARDED:
        files = list(load_index(src).shards.values())
        if not all(s.endswith(".safetensors") for s in files):
            raise UnsupportedError(f"{src}: the shards are not safetensors; convert the index to safetensors instead")
    else:
        raise UnsupportedError(f"{src}: not a safetensors file or index (it is {kind})")
    sd: dict[str, Any] = {}
    meta: dict[str, str] = {}
    for path in files:
        try:
            with safe_open(pins.path_for(path), framework="pt") as f:
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


def _name_metadata_left_out(meta: Mapping[str, str], report: ConvertReport) -> None:
    """A torch file has no place for a safetensors file's own ``__metadata__`` entries: named in ``excluded``."""
    left = sorted(k for k in meta if k != "format" and not k.startswith(stmeta.PREFIX))
    if left:
        shown = ", ".join(left[:5]) + (f", ... ({len(left)} in all)" if len(left) > 5 else "")
        report.excluded.append("__metadata__")
        report.excluded_detail["__metadata__"] = (
            f"{len(left)} safetensors metadata entr{'y' if len(left) == 1 else 'ies'} ({shown}): a torch file "
            "has no place for them; they stay in the input"
        )


def convert_from_safetensors(
    src: str | os.PathLike,
    dst: str | os.PathLike | None = None,
    *,
    outputs: OutputOptions | None = None,
    options: ConvertOptions | None = None,
    **keywords: Unpack[ConvertKeywords],
) -> ConvertReport:
    """Write a ``.safetensors`` file (or sharded index) as one torch zip checkpoint, aliases restored.

    The output is the state dict; with ``restore_wrapper`` it is the checkpoint dict the file was
    converted from (see :func:`rebuild_checkpoint`), the state dict at its original key.

    Args:
        src: a ``.safetensors`` file, or a sharded index (or its folder) of safetensors shards.
        dst: the output (default: ``<stem>.pth`` next to ``src``); overrides ``outputs.output``.
        outputs, options, keywords: :class:`~ckptfix.files.outputs.OutputOptions` and
            :class:`~ckptfix.ops.convert.options.ConvertOptions`, or their fields as keywords; the ones that apply:
        verify: load the written file back (``weights_only=True``) and compare every tensor and alias.
        force: overwrite an existing output.
        fsync: flush the file and its directory before returning.
        restore_wrapper: write the whole checkpoint the file came from, not just the state dict.
        progress: ``progress(done_bytes, total_bytes)``.

    Returns:
        A :class:`ConvertReport` (``direction`` ``"to-torch"``).

    Raises:
        TorchMissingError: torch is not installed.
        OutputError: the output exists (without ``force``), is the input, or cannot be written.
        UnsupportedError: not a safetensors input, or ``restore_wrapper`` without ckptfix metadata.
        CorruptCheckpointError, CheckpointNotFoundError: an invalid file or a missing shard.
        VerificationError: the written file does not load back identical; it was removed.
    """
    o, c = options_of(dst, outputs, options, keywords)
    refuse_inapplicable("pt", o, c)
    verify, force, fsync, progress, restore_wrapper = o.verify, o.force, bool(o.fsync), o.progress, c.restore_wrapper
    torch = require_torch("converting safetensors back to .pth")

    t0 = time.perf_counter()
    given, src = src, os.fspath(src)
    dst = o.output if o.output is not None else default_output(src, ".pth")
    report = ConvertReport(source=src, outputs=[dst], direction="to-torch")
    check_outputs([dst], src, force)
    sd, meta, kind = _read_safetensors_sd(classify(given))  # the router's Input, or the one sniff here
    # zero-size tensors read from safetensors share one null data pointer: torch.save takes them for views of one
    # storage and refuses two dtypes of it; each gets its own (empty) storage
    sd = {k: torch.empty(v.shape, dtype=v.dtype) if v.numel() == 0 else v for k, v in sd.items()}
    report.source_format = kind
    out = stmeta.restore(sd, meta)
    report.aliases = stmeta.aliases(meta, sd)
    report.views = {k: v["base"] for k, v in stmeta.views(meta).items() if isinstance(v.get("base"), str)}
    consumed: list[str] = []
    if torchao_entries(meta) is not None:  # torchao's layout: its tensor subclasses rebuilt, as torchao loads them
        out, consumed = rebuild(out, meta, src)
        report.subclasses = {n: type(v).__name__ for n, v in out.items() if hasattr(v, "tensor_data_names")}
    report.tensors = len(out)
    _name_metadata_left_out({k: v for k, v in meta.items() if k not in consumed}, report)
    total = sum(t.numel() * t.element_size() for t in sd.values())
    report.bytes = total
    to_save: Any = out
    if restore_wrapper:
        if stmeta.KEY_PATH not in meta:
            raise UnsupportedError(
                f"{src}: no ckptfix.key_path metadata (not written by ckptfix convert), so "
                "there is no wrapper to restore; convert without --restore-wrapper"
            )
        to_save, kp = rebuild_checkpoint(out, meta)
        report.key_path = kp
        out = at_path(to_save, kp)
        report.tensors = len(out)
    tmp = temp_for(dst)
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
            _verify_torch_output(tmp, dst, out, report)
            if progress:
                progress(total * 2, total * 2)
        pins.check_unchanged()
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


def _verify_torch_output(tmp: str, dst: str, out: Mapping[str, Any], report: ConvertReport) -> None:
    """Load the written file back (weights only) and compare keys, every tensor's bytes, and aliases."""
    import torch

    back = at_path(torch.load(tmp, map_location="cpu", weights_only=True, mmap=True), report.key_path)
    if list(back) != list(out):
        raise VerificationError(f"{dst}: the written checkpoint holds other keys than the source")
    for k, t in out.items():
        b = back[k]
        if hasattr(t, "tensor_data_names"):  # a torchao tensor: its class, inner tensors and attributes
            if not same_tensor(b, t):
                raise VerificationError(f"{dst}: tensor {k!r} differs from the source; the output was removed")
            continue
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


def is_safetensors_input(src: str | os.PathLike | Input) -> bool:
    """Is ``src`` a ``.safetensors`` file or an index whose shards are safetensors?

    Args:
        src: any path, or its :class:`~ckptfix.formats.Input` (not sniffed again).

    Returns:
        True for safetensors inputs; False for anything else, unreadable paths included.
    """
    try:
        inp = classify(src)
    except CkptfixError:
        return False
    src, kind = inp.path, inp.format
    if kind == Format.SAFETENSORS:
        return True
    if kind == Format.SHARDED:
        try:
            return all(s.endswith(".safetensors") for s in load_index(src).shards)
        except (OSError, CkptfixError):
            return False
    return False
