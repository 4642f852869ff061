"""Convert checkpoints to safetensors and back, without loading them.

One concern per module:

* :mod:`~ckptfix.ops.convert.forward`: checkpoint -> safetensors (:func:`convert_to_safetensors`);
* :mod:`~ckptfix.ops.convert.reverse`: safetensors -> torch (:func:`convert_from_safetensors`);
* :mod:`~ckptfix.ops.convert.plan`: which tensors are written, under which names, tied tensors once;
* :mod:`~ckptfix.ops.convert.extras`: the non-tensor part of a checkpoint as JSON metadata;
* :mod:`~ckptfix.ops.convert.items`: where each tensor's bytes come from (byte ranges, strided views);
* :mod:`~ckptfix.ops.convert.header`, :mod:`~ckptfix.ops.convert.write`, :mod:`~ckptfix.ops.convert.paths`:
  the safetensors layout, writing with inline verification, output names;
* :mod:`~ckptfix.ops.convert.report`: :class:`ConvertReport`;
* :mod:`~ckptfix.ops.convert.options`: :class:`ConvertOptions`, and which direction each option applies to;
* :mod:`~ckptfix.ops.convert.dcp_in`: a DCP directory -> safetensors, streamed from its chunks;
* :mod:`~ckptfix.ops.convert.dcp_out`: safetensors -> a DCP directory (through torch's writer);
* :mod:`~ckptfix.ops.convert.hfstorage`: a ``HuggingFaceStorageWriter`` folder -> one safetensors file.

The ``ckptfix.*`` metadata format is :mod:`ckptfix.formats.stmeta`; finding the state dict in a checkpoint
is :mod:`ckptfix.formats.statedict`.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import TYPE_CHECKING, Any

from ckptfix.errors import OptionNotApplicableError, UnsupportedError
from ckptfix.files.atomic import same_file
from ckptfix.files.outputs import OutputOptions, refuse_misnamed
from ckptfix.files.source import in_session
from ckptfix.formats import Format, Input, classify_or_none
from ckptfix.formats.statedict import contains_tensors, locate_state_dict, module_state_dict
from ckptfix.formats.stmeta import restore as restore_aliases
from ckptfix.ops.convert import forward
from ckptfix.ops.convert.header import safetensors_header
from ckptfix.ops.convert.options import ConvertKeywords, ConvertOptions, keywords_of, options_of, refuse_inapplicable
from ckptfix.ops.convert.report import ConvertReport
from ckptfix.text import parse_size

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from ckptfix.formats.deepspeed import find_zero_checkpoint as find_zero_checkpoint
    from ckptfix.formats.hfstorage import find_hf_storage as find_hf_storage
    from ckptfix.ops.convert.dcp_out import convert_to_dcp as convert_to_dcp
    from ckptfix.ops.convert.hfstorage import convert_hf_storage as convert_hf_storage
    from ckptfix.ops.convert.reverse import convert_from_safetensors as convert_from_safetensors
    from ckptfix.ops.convert.reverse import is_safetensors_input as is_safetensors_input
    from ckptfix.ops.convert.reverse import rebuild_checkpoint as rebuild_checkpoint
    from ckptfix.ops.convert.zero import convert_zero as convert_zero

#: the entry points of the other directions and folder kinds, imported on first use (the start-up of
#: ``convert FILE.pth``, which needs none of them: DCP, ZeRO and HuggingFaceStorageWriter readers and writers,
#: and the way back to torch)
_LAZY = {
    "convert_from_safetensors": "ckptfix.ops.convert.reverse",
    "is_safetensors_input": "ckptfix.ops.convert.reverse",
    "rebuild_checkpoint": "ckptfix.ops.convert.reverse",
    "convert_to_dcp": "ckptfix.ops.convert.dcp_out",
    "convert_hf_storage": "ckptfix.ops.convert.hfstorage",
    "convert_zero": "ckptfix.ops.convert.zero",
    "find_zero_checkpoint": "ckptfix.formats.deepspeed",
    "find_hf_storage": "ckptfix.formats.hfstorage",
}


def __getattr__(name: str) -> Any:
    """The names in :data:`_LAZY`, imported on first use."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ckptfix.ops.convert' has no attribute {name!r}")


__all__ = [
    "convert_to_safetensors",
    "convert_from_safetensors",
    "convert",
    "ConvertOptions",
    "OutputOptions",
    "restore_aliases",
    "rebuild_checkpoint",
    "parse_size",
    "ConvertReport",
    "safetensors_header",
    "is_safetensors_input",
    "contains_tensors",
    "locate_state_dict",
    "module_state_dict",
]


@functools.wraps(forward.convert_to_safetensors)
def convert_to_safetensors(src: str | os.PathLike, dst: str | os.PathLike | None = None, **kw: Any) -> ConvertReport:
    # a framework's folder (Trainer, accelerate, Lightning ...) goes to its handler, which converts its weights
    if not kw.get("optimizer_files") and kw.get("extra_metadata") is None and os.path.isdir(os.fspath(src)):
        from ckptfix.ops.convert.folders import convert_folder, resolve

        fw = resolve(os.fspath(src))
        if fw is not None:
            rest = {k: v for k, v in kw.items() if k not in ("outputs", "options", "optimizer_files", "extra_metadata")}
            o, c = options_of(dst, kw.get("outputs"), kw.get("options"), rest)
            refuse_inapplicable("safetensors", o, c)
            return convert_folder(fw, o.output, **{**keywords_of(o, c), "to": "safetensors"})
    return forward.convert_to_safetensors(src, dst, **kw)


@in_session
def convert(
    src: str | os.PathLike | Input,
    dst: str | os.PathLike | None = None,
    *,
    outputs: OutputOptions | None = None,
    options: ConvertOptions | None = None,
    **keywords: Unpack[ConvertKeywords],
) -> ConvertReport:
    """Convert in the direction ``to`` or the paths say: a thin router over the typed entry points.

    A DeepSpeed ZeRO folder -> :func:`~ckptfix.ops.convert.zero.convert_zero`; torch's HuggingFaceStorageWriter
    folder -> :func:`~ckptfix.ops.convert.hfstorage.convert_hf_storage`; another framework's folder -> its
    handler (:mod:`ckptfix.ops.frameworks`); a ``dst`` ending in ``.dcp`` (or ``to="dcp"``) ->
    :func:`~ckptfix.ops.convert.dcp_out.convert_to_dcp`; safetensors in and a non-safetensors ``dst`` (or
    none, or ``to="pt"``) -> :func:`convert_from_safetensors`; anything else -> :func:`convert_to_safetensors`.

    The input is classified once, here (:func:`~ckptfix.formats.classify`): the direction is decided from
    its format and the entry point gets the :class:`~ckptfix.formats.Input`, so nothing below sniffs it again.

    Args:
        src: the input checkpoint (or its :class:`~ckptfix.formats.Input`).
        dst: the output (default: next to ``src``); overrides ``outputs.output``.
        outputs: where and how to write (:class:`~ckptfix.files.outputs.OutputOptions`: ``force``, ``fsync``,
            ``verify``, ``jobs``, ``progress``, ``key``).
        options: the conversion's options (:class:`~ckptfix.ops.convert.options.ConvertOptions`).
        **keywords: any field of either object instead (``convert(src, dst, force=True, shards=4)``):
            ``verify, force, fsync, progress, jobs``: every direction (``jobs``: tensors, or DCP writer
            threads, at a time; ``0``: one per CPU; same output for any number); ``key, strip_prefix,
            max_shard_size, include_optimizer, allow_globals, trust, ckptfix_metadata, keep, allow_expand,
            drop``: as for :func:`convert_to_safetensors`; ``restore_wrapper``: as for
            :func:`convert_from_safetensors`; ``to``: ``"safetensors"``, ``"pt"`` or ``"dcp"`` (None:
            from the paths); ``shards``: DCP output written as this many ranks would; ``tag``, ``dtype``:
            a DeepSpeed ZeRO folder's tag (``global_step14``) instead of ``latest``'s, and
            ``bf16``/``fp16``/``fp32`` for the floating tensors written.

    A folder a training framework wrote (:mod:`ckptfix.ops.frameworks`) converts its model weights
    (``include_optimizer`` adds its optimizer files' tensors as ``optimizer.<path>``); a DeepSpeed
    ZeRO folder and torch's HuggingFaceStorageWriter output are consolidated (:mod:`ckptfix.formats.deepspeed`,
    :mod:`ckptfix.ops.convert.hfstorage`).

    Returns:
        A :class:`ConvertReport`.

    Raises:
        NoModelWeightsError: a framework folder without model weights.
        OptionNotApplicableError: an option the direction taken does not use (exit 32; nothing is read
            or written).  Otherwise as the entry point the input goes to.
    """
    o, c = options_of(dst, outputs, options, keywords)
    s = os.fspath(src)
    if o.output is not None and _is_url(o.output):  # an object store: converted and verified locally, then uploaded
        from ckptfix.ops.convert.remote_out import convert_to_url

        return convert_to_url(
            lambda local: convert(src, outputs=dataclasses.replace(o, output=local, force=True), options=c),
            o.output,
            force=o.force,
            to=c.to,
        )
    if _is_url(s):  # a URL: to safetensors only; the default output is in the current directory
        o = dataclasses.replace(o, output=_remote_input(s, o.output, c.to))
    if not os.path.isdir(s):
        if os.path.basename(s).startswith("shard-"):  # (only shard-*-model-*.safetensors can be refused)
            from ckptfix.formats.hfstorage import refuse_single_shard

            refuse_single_shard(s)
    else:
        from ckptfix.formats.deepspeed import find_zero_checkpoint
        from ckptfix.formats.hfstorage import find_hf_storage
        from ckptfix.ops.convert.hfstorage import convert_hf_storage
        from ckptfix.ops.convert.zero import convert_zero

        zc = find_zero_checkpoint(s, c.tag)
        if zc is not None:
            _refuse_other_formats(o, c, "a DeepSpeed ZeRO checkpoint")
            return convert_zero(zc, outputs=o, options=c)
        hf = find_hf_storage(s) if c.tag is None else None
        if hf is not None:
            _refuse_other_formats(o, c, "a torch HuggingFaceStorageWriter checkpoint")
            return convert_hf_storage(hf, outputs=o, options=c)
        from ckptfix.formats.dtensor_ranks import find_dtensor_ranks

        dr = find_dtensor_ranks(s) if c.tag is None else None
        if dr is not None:
            from ckptfix.ops.convert.dtensor_ranks import convert_dtensor_ranks

            _refuse_other_formats(o, c, "a folder of FSDP per-rank DTensor files")
            return convert_dtensor_ranks(dr, outputs=o, options=c)
        if c.tag is None and c.dtype is None:
            from ckptfix.ops.convert.folders import convert_folder, resolve

            fw = resolve(s)
            if fw is not None:  # a framework's folder: its model weights (ckptfix.ops.frameworks)
                _refuse_misnamed(o.output, "safetensors", s)
                return convert_folder(fw, o.output, **keywords_of(o, c))
    inp = classify_or_none(src)  # the one sniff; an input that does not classify fails in its entry point
    direction = _direction(inp, s, o.output, c.to)
    _refuse_misnamed(o.output, direction, s)
    refuse_inapplicable(direction, o, c)
    if c.trust:  # a full unpickle is torch's: never silently ignored when torch is missing
        from ckptfix._torch import require_torch

        require_torch("--trust")
    given = inp or s  # an input that did not classify goes down as a path: its entry point reports the error
    if direction == "dcp":
        from ckptfix.ops.convert.dcp_out import convert_to_dcp

        return convert_to_dcp(given, outputs=o, options=c)
    if direction == "pt":
        from ckptfix.ops.convert.reverse import convert_from_safetensors

        return convert_from_safetensors(given, outputs=o, options=c)
    return convert_to_safetensors(given, outputs=o, options=c)


def _direction(inp: Input | None, src: str, dst: str | None, to: str | None) -> str:
    """``dcp``, ``pt`` or ``safetensors``: what ``to`` says, else what the input (None: it did not classify) and
    the paths say."""
    if to == "dcp" or (to is None and dst is not None and dst.rstrip("/" + os.sep).endswith(".dcp")):
        return "dcp"
    st_in = inp is not None and to in ("pt", None) and _safetensors_in(inp)  # from the Input's format
    if to == "pt" and not st_in:
        raise UnsupportedError(f"--to pt: {src} is not a safetensors file; ckptfix writes .pth only from safetensors")
    merging = inp is not None and inp.format == Format.SHARDED and dst is None  # shards merge into one safetensors
    if to == "pt" or (to is None and st_in and not merging and (dst is None or not dst.endswith(".safetensors"))):
        return "pt"
    return "safetensors"


def _safetensors_in(inp: Input) -> bool:
    """:func:`~ckptfix.ops.convert.reverse.is_safetensors_input` of a classified input; only a safetensors file or a
    sharded index can be one (any other format is answered without importing the way back to torch)."""
    if inp.format not in (Format.SAFETENSORS, Format.SHARDED):
        return False
    from ckptfix.ops.convert.reverse import is_safetensors_input

    return is_safetensors_input(inp)


def _inside(path: str, folder: str) -> bool:
    """Whether ``path`` lies inside the folder ``folder`` (a file of the input folder)."""
    if not os.path.isdir(folder):
        return False
    a, b = os.path.realpath(path), os.path.realpath(folder)
    return os.path.commonpath([a, b]) == b


def _refuse_misnamed(output: str | None, direction: str, src: str) -> None:
    """An output whose name says another format than ``direction`` writes (``-o model.pt`` of safetensors bytes)."""
    if output is None or same_file(output, src) or _inside(output, src):  # refused as the input, below
        return
    stem = os.path.splitext(output.rstrip("/" + os.sep))[0]
    if direction == "safetensors":
        fix = (
            f"name it {stem}.safetensors (to rename keys and keep a torch file: ckptfix strip-prefix {src} -o {output})"
        )
        refuse_misnamed(output, "safetensors", fix)
    elif direction == "pt":
        refuse_misnamed(output, "torch", f"name it {stem}.pth")
    else:
        refuse_misnamed(output, "directory", f"name it {stem}.dcp")


def _refuse_other_formats(o: OutputOptions, c: ConvertOptions, what: str) -> None:
    """A folder consolidated to safetensors: ``--to pt``/``dcp`` or a ``.dcp`` output is refused."""
    if c.to in ("pt", "dcp") or (o.output is not None and o.output.rstrip("/" + os.sep).endswith(".dcp")):
        shown = f"--to {c.to}" if c.to in ("pt", "dcp") else f"-o {o.output}"
        raise OptionNotApplicableError(
            f"{shown}: {what} is consolidated to safetensors; pass -o NAME.safetensors (or no -o)"
        )
    refuse_misnamed(o.output, "safetensors", f"{what} is consolidated to safetensors: pass -o NAME.safetensors")


def _remote_input(src: str, dst: str | None, to: str | None) -> str:
    """The output of a conversion from a URL (``<stem>.safetensors`` here by default); other directions refused."""
    from ckptfix.files.remote.url import basename
    from ckptfix.ops.convert.paths import default_st_output

    back = to in ("pt", "dcp") or (dst is not None and not dst.rstrip("/").endswith(".safetensors"))
    if back:
        raise UnsupportedError(
            f"{src}: a URL converts to safetensors (-o NAME.safetensors); to write .pth or DCP from it, "
            "convert it to a local .safetensors first, then convert that"
        )
    if dst is not None:
        return dst
    name = basename(src.rstrip("/")) or "model"
    return os.path.relpath(default_st_output(os.path.join(os.getcwd(), name)))


def _is_url(path: str) -> bool:
    if "://" not in path:
        return False
    from ckptfix.files.source import is_url

    return is_url(path)
