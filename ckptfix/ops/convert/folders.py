"""``convert FOLDER`` for a folder a training framework wrote (the handlers of :mod:`ckptfix.formats.layouts`).

:func:`ckptfix.formats.layouts.resolve` tells the layout and where the model weights are; :func:`convert_folder`
converts those weights (with ``include_optimizer``, the optimizer files' tensors too), or, for a layout whose
model is spread over partitions (DeepSpeed ZeRO, torch's HuggingFaceStorageWriter), lets :func:`convert`
consolidate the folder.  The detection sits below (layer 3); this handler writes through ``convert/``, so it
lives here (layer 4).
"""

from __future__ import annotations

import os
from typing import Any

from ckptfix.formats import classify_or_none
from ckptfix.formats.layouts import NESTED, Resolved, check_inside, resolve
from ckptfix.ops.convert.report import ConvertReport

__all__ = ["convert_folder", "default_output", "meta_extras", "resolve"]


def _optimizer_files(r: Resolved) -> list[str]:
    return [p for p in r.of_role("optimizer") if os.path.isfile(p)]


def default_output(r: Resolved) -> str:
    """Where ``convert FOLDER`` writes by default.

    ``model.safetensors`` inside a Hugging Face folder whose weights are ``pytorch_model*.bin`` (where
    ``from_pretrained`` looks); else ``FOLDER.safetensors`` beside the folder.
    """
    from ckptfix.ops.convert.paths import default_output as beside

    w = r.weights or ""
    if r.layout.name in ("hf-model", "hf-trainer") and os.path.basename(w).startswith("pytorch_model"):
        return os.path.join(r.path, "model.safetensors")
    from ckptfix.ops.convert.pipelines import beside_bin

    inside = beside_bin(r)  # peft's adapter_model.bin, a diffusers model's .bin: where from_pretrained looks
    if inside is not None:
        return inside
    return beside(r.path, ".safetensors")


def convert_folder(r: Resolved, dst: str | None, **kw: Any) -> ConvertReport:
    """``convert FOLDER``: the model weights (and, with ``include_optimizer``, the optimizer files)."""
    from ckptfix.formats.pipelines import is_multi

    if is_multi(r) or kw.get("component") is not None:  # a diffusers pipeline, a sentence-transformers model
        from ckptfix.ops.convert.pipelines import convert_pipeline

        return convert_pipeline(r, dst, **kw)
    handler = r.layout.convert
    if handler is not None:
        got: ConvertReport = handler(r, dst, **kw)
        return got
    if r.layout.consolidated:
        return _convert_consolidated(r, dst, **kw)
    from ckptfix.ops.convert import convert
    from ckptfix.ops.convert.reverse import is_safetensors_input

    weights = check_inside(r, r.require_weights())
    given = classify_or_none(weights) or weights  # classified once: the conversion below does not sniff again
    dst = dst if dst is not None else default_output(r)
    _refuse_input_file(r, dst, kw.get("force", False))
    to = kw.get("to")
    if to is None:  # the paths decide, as for a file: the default output is always .safetensors
        if dst.rstrip("/" + os.sep).endswith(".dcp"):
            to = "dcp"
        elif is_safetensors_input(given) and not dst.endswith(".safetensors"):
            to = "pt"
        else:
            to = "safetensors"
    token = NESTED.set(True)  # the weights may be the folder itself (DCP): read it as a plain checkpoint now
    try:
        if to != "safetensors" or kw.get("restore_wrapper") or kw.get("shards", 1) != 1:
            rep = convert(given, dst, **kw)  # the other directions, and the refusals of misplaced options
        else:
            from ckptfix.ops.convert.forward import convert_to_safetensors

            extra: dict[str, Any] = {}
            if kw.get("include_optimizer") and os.path.isfile(weights):
                extra["optimizer_files"] = [check_inside(r, p) for p in _optimizer_files(r)]
            meta = [check_inside(r, p) for p in r.of_role("meta")]
            if meta:
                extra["extra_metadata"] = meta_extras(meta[0])
            rest = {k: v for k, v in kw.items() if k not in ("to", "restore_wrapper", "shards")}
            rep = convert_to_safetensors(given, dst, **rest, **extra)
    finally:
        NESTED.reset(token)
    rep.source = r.path
    for m in r.of_role("model"):  # accelerate's second model: its own file, its own conversion
        rep.not_converted[os.path.basename(m)] = (
            f"another model in the folder; convert it on its own: ckptfix convert {m}"
        )
    for m in r.of_role("optimizer-dcp"):  # FSDP SHARDED_STATE_DICT's optimizer: a DCP folder of its own
        rep.not_converted[os.path.basename(m) + "/"] = (
            "the optimizer state, a DCP folder of its own (FSDP SHARDED_STATE_DICT): not merged into the model's "
            "file"
            + (" (--include-optimizer takes optimizer files only)" if kw.get("include_optimizer") else "")
            + "; accelerate's load_state or torch's dcp.load reads it"
        )
    for m in r.of_role("weights-unused"):
        rep.not_converted[os.path.basename(m)] = (
            f"weights beside {os.path.basename(weights)}, which from_pretrained prefers; convert it on its own: "
            f"ckptfix convert {m}"
        )
    return rep


def _refuse_input_file(r: Resolved, dst: str, force: bool) -> None:
    """An output that would replace a file of the input folder (its config.json, an optimizer file ...)."""
    from ckptfix.errors import OutputError

    real, root = os.path.realpath(dst), os.path.realpath(r.path)
    if os.path.lexists(dst) and not os.path.isdir(dst) and real.startswith(root + os.sep):
        raise OutputError(
            f"{dst}: a file of the input folder {r.path}{' (--force does not apply)' if force else ''}; "
            "choose an output outside it with -o"
        )


def meta_extras(path: str) -> dict[str, Any]:
    """A Lightning ``meta.pt`` (epoch, global_step, hyper_parameters, loops ...) as the JSON convert keeps.

    Args:
        path: the ``meta.pt`` file.

    Returns:
        Its JSON-representable entries (placeholders as the plain data ``sanitize`` writes).
    """
    from ckptfix.formats import read_checkpoint
    from ckptfix.ops.convert.extras import plain_extras

    return plain_extras(read_checkpoint(path).obj)


def _convert_consolidated(r: Resolved, dst: str | None, **kw: Any) -> ConvertReport:
    from ckptfix.ops.convert import convert

    return convert(r.path, dst, **kw)  # convert() consolidates these folders first (--tag, --dtype)
