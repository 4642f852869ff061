"""Convert checkpoints to safetensors and back, without loading them.

One concern per module:

* :mod:`~ckptfix.convert.forward`: checkpoint -> safetensors (:func:`convert_to_safetensors`);
* :mod:`~ckptfix.convert.reverse`: safetensors -> torch (:func:`convert_from_safetensors`);
* :mod:`~ckptfix.convert.plan`: which tensors are written, under which names, tied tensors once;
* :mod:`~ckptfix.convert.extras`: the non-tensor part of a checkpoint as JSON metadata;
* :mod:`~ckptfix.convert.items`: where each tensor's bytes come from (byte ranges, strided views);
* :mod:`~ckptfix.convert.header`, :mod:`~ckptfix.convert.write`, :mod:`~ckptfix.convert.paths`:
  the safetensors layout, writing with inline verification, output names;
* :mod:`~ckptfix.convert.report`: :class:`ConvertReport`;
* :mod:`~ckptfix.convert.dcp_in`: a DCP directory -> safetensors, streamed from its chunks;
* :mod:`~ckptfix.convert.dcp_out`: safetensors -> a DCP directory (through torch's writer);
* :mod:`~ckptfix.convert.hfstorage`: a ``HuggingFaceStorageWriter`` folder -> one safetensors file.

The ``ckptfix.*`` metadata format is :mod:`ckptfix.stmeta`; finding the state dict in a checkpoint
is :mod:`ckptfix.statedict`.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

from ckptfix.convert.dcp_out import convert_to_dcp
from ckptfix.convert.forward import convert_to_safetensors
from ckptfix.convert.header import safetensors_header
from ckptfix.convert.hfstorage import convert_hf_storage
from ckptfix.convert.report import ConvertReport, Progress
from ckptfix.convert.reverse import convert_from_safetensors, is_safetensors_input, rebuild_checkpoint
from ckptfix.convert.zero import convert_zero
from ckptfix.deepspeed import find_zero_checkpoint
from ckptfix.errors import UnsupportedError
from ckptfix.formats.hfstorage import find_hf_storage, refuse_single_shard
from ckptfix.statedict import contains_tensors, locate_state_dict, module_state_dict
from ckptfix.stmeta import restore as restore_aliases
from ckptfix.text import parse_size

__all__ = [
    "convert_to_safetensors",
    "convert_from_safetensors",
    "convert",
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


def convert(
    src: str | os.PathLike,
    dst: str | os.PathLike | None = None,
    *,
    verify: bool = True,
    force: bool = False,
    fsync: bool = False,
    progress: Progress | None = None,
    key: str | None = None,
    strip_prefix: bool | str | None = False,
    max_shard_size: int | str | None = None,
    include_optimizer: bool = False,
    allow_globals: Sequence[str] = (),
    trust: bool = False,
    ckptfix_metadata: bool = True,
    keep: Sequence[str] = (),
    allow_expand: bool = False,
    restore_wrapper: bool = False,
    jobs: int = 1,
    to: str | None = None,
    shards: int = 1,
    drop: Sequence[str] = (),
    tag: str | None = None,
    dtype: str | None = None,
) -> ConvertReport:
    """Convert in the direction ``to`` or the paths say.

    A ``dst`` ending in ``.dcp`` (or ``to="dcp"``) -> a DCP directory; safetensors in and a
    non-safetensors ``dst`` (or none, or ``to="pt"``) -> torch; anything else -> safetensors.

    Args:
        src: the input checkpoint.
        dst: the output (default: next to ``src``).
        verify, force, fsync, progress: as for both directions.
        key, strip_prefix, max_shard_size, include_optimizer, allow_globals, trust, ckptfix_metadata,
            keep, allow_expand: as for :func:`convert_to_safetensors`.
        restore_wrapper: as for :func:`convert_from_safetensors`.
        jobs: tensors (or DCP writer threads) at a time; ``0``: one per CPU.  Same output for any number.
        to: ``"safetensors"``, ``"pt"`` or ``"dcp"``; None: from the paths.
        shards: for DCP output, write as this many ranks would (:func:`ckptfix.convert.dcp_out.convert_to_dcp`).
        drop: tensors to leave out, by name or path pattern (:func:`convert_to_safetensors`).
        tag: a DeepSpeed ZeRO folder: the tag (``global_step14``) to consolidate instead of ``latest``'s.
        dtype: a DeepSpeed ZeRO folder: ``bf16``/``fp16``/``fp32`` for the floating tensors written.

    A folder a training framework wrote (:mod:`ckptfix.frameworks`) converts its model weights
    (``include_optimizer`` adds its optimizer files' tensors as ``optimizer.<path>``); a DeepSpeed
    ZeRO folder and torch's HuggingFaceStorageWriter output are consolidated (:mod:`ckptfix.deepspeed`,
    :mod:`ckptfix.convert.hfstorage`).

    Returns:
        A :class:`ConvertReport`.

    Raises:
        NoModelWeightsError: a framework folder without model weights.
        UnsupportedError: an option of the other direction was given.  Otherwise as
            :func:`convert_to_safetensors` / :func:`convert_from_safetensors`.
    """
    if _is_url(os.fspath(src)) and _no_session():  # one pinned version of each remote object for the whole run
        args = dict(locals())
        from ckptfix import source

        with source.session():
            return convert(**args)
    if dst is not None and _is_url(os.fspath(dst)):  # an object store: converted and verified locally, then uploaded
        args = dict(locals())
        from ckptfix.convert.remote_out import convert_to_url

        return convert_to_url(
            lambda local: convert(**{**args, "dst": local, "force": True}), os.fspath(dst), force=force, to=to
        )
    if _is_url(os.fspath(src)):  # a URL: to safetensors only; the default output is in the current directory
        dst = _remote_input(os.fspath(src), os.fspath(dst) if dst is not None else None, to)
    framework = _framework_convert(
        src, os.fspath(dst) if dst is not None else None, tag=tag, dtype=dtype, verify=verify, force=force,
        fsync=fsync, progress=progress, max_shard_size=max_shard_size, ckptfix_metadata=ckptfix_metadata, jobs=jobs,
        others={"key": key is not None, "include_optimizer": include_optimizer, "keep": bool(keep),
                "restore_wrapper": restore_wrapper, "shards": shards != 1, "to": to not in (None, "safetensors"),
                "drop": bool(drop)},
    )  # fmt: skip
    if framework is not None:  # DeepSpeed ZeRO / torch HF-writer DCP: consolidated, streaming
        return framework
    if os.path.isdir(src):
        from ckptfix.frameworks import convert_folder, resolve

        fw = resolve(src)
        if fw is not None:  # a framework's folder: its model weights (ckptfix.frameworks)
            return convert_folder(
                fw,
                os.fspath(dst) if dst is not None else None,
                verify=verify,
                force=force,
                fsync=fsync,
                progress=progress,
                key=key,
                strip_prefix=strip_prefix,
                max_shard_size=max_shard_size,
                include_optimizer=include_optimizer,
                allow_globals=allow_globals,
                trust=trust,
                ckptfix_metadata=ckptfix_metadata,
                keep=keep,
                allow_expand=allow_expand,
                restore_wrapper=restore_wrapper,
                jobs=jobs,
                to=to,
                shards=shards,
                drop=drop,
            )
    d = os.fspath(dst) if dst is not None else None
    if trust:  # a full unpickle is torch's: never silently ignored when torch is missing
        from ckptfix._torch import require_torch

        require_torch("--trust")
    to_safetensors_only = {
        "key": key is not None,
        "max_shard_size": bool(max_shard_size),
        "include_optimizer": include_optimizer,
        "allow_globals": bool(allow_globals),
        "trust": trust,
        "keep": bool(keep),
        "allow_expand": allow_expand,
        "drop": bool(drop),
    }
    if to == "dcp" or (to is None and d is not None and d.rstrip("/" + os.sep).endswith(".dcp")):
        given: dict[str, bool] = {k: v for k, v in to_safetensors_only.items() if v}
        if restore_wrapper:
            given["restore_wrapper"] = True
        return convert_to_dcp(
            src,
            d,
            strip_prefix=strip_prefix,
            verify=verify,
            force=force,
            fsync=fsync,
            progress=progress,
            jobs=jobs,
            shards=shards,
            ckptfix_metadata=ckptfix_metadata,
            **given,
        )
    if shards != 1:
        raise UnsupportedError("--shards applies to DCP output (-o DIR.dcp or --to dcp)")
    if to == "pt" and not is_safetensors_input(src):
        raise UnsupportedError(f"--to pt: {src} is not a safetensors file; ckptfix writes .pth only from safetensors")
    if to == "pt" or (to is None and is_safetensors_input(src) and (d is None or not d.endswith(".safetensors"))):
        back: dict[str, bool] = {
            **to_safetensors_only,
            "strip_prefix": bool(strip_prefix),
            "ckptfix_metadata": not ckptfix_metadata,
        }
        used = sorted(k for k, v in back.items() if v)
        if used:
            raise UnsupportedError(f"options {used} apply to conversion to safetensors, not back to torch")
        return convert_from_safetensors(
            src, d, verify=verify, force=force, fsync=fsync, restore_wrapper=restore_wrapper, progress=progress
        )
    if restore_wrapper:
        raise UnsupportedError("--restore-wrapper applies to conversion back to torch (a .safetensors input)")
    return convert_to_safetensors(
        src,
        d,
        key=key,
        strip_prefix=strip_prefix,
        max_shard_size=max_shard_size,
        include_optimizer=include_optimizer,
        verify=verify,
        force=force,
        fsync=fsync,
        allow_globals=allow_globals,
        trust=trust,
        progress=progress,
        ckptfix_metadata=ckptfix_metadata,
        keep=keep,
        allow_expand=allow_expand,
        jobs=jobs,
        drop=drop,
    )


def _remote_input(src: str, dst: str | None, to: str | None) -> str:
    """The output of a conversion from a URL (``<stem>.safetensors`` here by default); other directions refused."""
    from ckptfix.convert.paths import default_st_output
    from ckptfix.remote.url import basename

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


def _no_session() -> bool:
    from ckptfix.remote.stats import active

    return active() is None


def _is_url(path: str) -> bool:
    if "://" not in path:
        return False
    from ckptfix.source import is_url

    return is_url(path)


def _framework_convert(
    src: str | os.PathLike, d: str | None, *, tag: str | None, dtype: str | None, others: dict[str, bool], **kw: Any
) -> ConvertReport | None:
    """A DeepSpeed ZeRO folder (``--tag``, ``--dtype``) or torch HF-writer DCP folder: its consolidated model.

    Returns None for any other input (``--tag``/``--dtype`` are then refused).
    """
    s = os.fspath(src)
    if not os.path.isdir(s):
        refuse_single_shard(s)
    if os.path.isdir(s):
        zc = find_zero_checkpoint(s, tag)
        if zc is not None:
            _refuse(others, "a DeepSpeed ZeRO checkpoint")
            if d is not None and d.rstrip("/" + os.sep).endswith(".dcp"):
                raise UnsupportedError(
                    "a DeepSpeed ZeRO checkpoint is consolidated to safetensors; pass -o NAME.safetensors"
                )
            return convert_zero(zc, d, dtype=dtype, **kw)
        hf = find_hf_storage(s)
        if hf is not None and tag is None:
            _refuse(others, "a torch HuggingFaceStorageWriter checkpoint")
            if dtype is not None:
                raise UnsupportedError("--dtype applies to DeepSpeed ZeRO checkpoints")
            return convert_hf_storage(hf, d, **kw)
    if tag is not None or dtype is not None:
        raise UnsupportedError(
            f"{s}: --tag and --dtype apply to DeepSpeed ZeRO checkpoint folders (with a 'latest' file or "
            "*_optim_states.pt partitions); this is not one"
        )
    return None


def _refuse(others: dict[str, bool], what: str) -> None:
    used = sorted(k for k, v in others.items() if v)
    if used:
        raise UnsupportedError(f"options {used} do not apply to {what} (its model is written as safetensors)")
