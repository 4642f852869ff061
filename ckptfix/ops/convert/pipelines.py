"""``convert FOLDER`` of a folder of several models: the same folder, every component's weights in safetensors.

A diffusers pipeline (``model_index.json``: ``unet/``, ``vae/``, ``text_encoder/`` ...) or a sentence-transformers
model (``modules.json``: the Transformer, ``2_Dense/`` ...) is written again as a new folder of the same layout:
every ``.bin`` weight file (or ``.bin`` sharded index) a component's ``from_pretrained`` reads becomes the
safetensors file it reads instead (``diffusion_pytorch_model[.VARIANT].safetensors``, ``model[.VARIANT].safetensors``),
safetensors weights and every other file (configs, scheduler, tokenizer) are copied as they are; the folder is
built beside the output and renamed into place when every file is written and verified.  ``component=``
(``--component unet``) converts one component: to its own model folder, or to one file with ``-o NAME.safetensors``.

The detection is :mod:`ckptfix.formats.pipelines`; each weight file is converted by :func:`ckptfix.ops.convert.convert`.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import tempfile
from typing import Any

from ckptfix.display import already_exists, missing_directory, not_writable, output_is_input
from ckptfix.errors import OutputError, UnsupportedError
from ckptfix.files.atomic import copy_file_data, fsync_dir, output_error, replace_directory
from ckptfix.formats.layouts import Resolved, check_inside
from ckptfix.formats.pipelines import Component, _index_shards, components_of, find_component, is_multi
from ckptfix.ops.convert.report import ConvertReport

__all__ = ["beside_bin", "convert_pipeline", "default_pipeline_output", "safetensors_name"]

_BIN = re.compile(r"(diffusion_pytorch_model|model|pytorch_model|adapter_model)((?:\.[\w-]+)?)\.bin")
_BIN_INDEX = re.compile(r"(diffusion_pytorch_model|model|pytorch_model)\.bin\.index((?:\.[\w-]+)?)\.json")


def safetensors_name(weights: str) -> str | None:
    """The safetensors name ``from_pretrained`` reads instead of a ``.bin`` weight file or ``.bin`` index.

    ``pytorch_model.fp16.bin`` -> ``model.fp16.safetensors``, ``diffusion_pytorch_model.bin`` ->
    ``diffusion_pytorch_model.safetensors`` (a ``.bin`` index becomes one merged file), ``adapter_model.bin`` ->
    ``adapter_model.safetensors``; None for a name of neither kind (a safetensors file: copied as it is).
    """
    base = os.path.basename(weights)
    m = _BIN.fullmatch(base) or _BIN_INDEX.fullmatch(base)
    if m is None:
        return None
    stem = "model" if m.group(1) == "pytorch_model" else m.group(1)
    return f"{stem}{m.group(2)}.safetensors"


def beside_bin(r: Resolved) -> str | None:
    """Where ``convert FOLDER`` writes by default for a peft adapter or a diffusers model whose weights are a ``.bin``:
    the safetensors name beside it, where ``from_pretrained`` looks first; None otherwise."""
    w = r.weights or ""
    peft = os.path.basename(w) == "adapter_model.bin"
    if peft or (r.layout.name == "diffusers-model" and not w.endswith(".safetensors")):
        name = safetensors_name(w)
        if name is not None:
            return os.path.join(r.path, name)
    return None


def default_pipeline_output(r: Resolved, comp: Component | None) -> str:
    """``FOLDER-safetensors/`` beside the folder (``FOLDER-unet-safetensors/`` for one component)."""
    top = os.path.normpath(r.path)
    return f"{top}-{comp.name}-safetensors" if comp is not None else f"{top}-safetensors"


def _check_output(out: str, src: str, force: bool) -> None:
    a_out, a_src = os.path.realpath(out), os.path.realpath(src)
    if a_out == a_src:
        raise OutputError(output_is_input(out))
    if a_out.startswith(a_src + os.sep):
        raise OutputError(f"{out}: inside the input folder {src}; choose an output outside it with -o")
    if os.path.lexists(out):
        if not force:
            raise OutputError(already_exists(out, directory=True))
        names = os.listdir(out) if os.path.isdir(out) and not os.path.islink(out) else None
        marks = {"model_index.json", "modules.json", "config.json"}
        if names is None or (names and not marks & set(names)):
            raise OutputError(f"{out} exists and is not a model folder; refusing to replace it (-o another path)")
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent):
        raise OutputError(missing_directory(parent))
    if not os.access(parent, os.W_OK):
        raise OutputError(not_writable(parent))


def convert_pipeline(r: Resolved, dst: str | None, **kw: Any) -> ConvertReport:
    """``convert FOLDER`` of a diffusers pipeline or a sentence-transformers folder (or ``component=`` of one).

    Args:
        r: the resolved folder.
        dst: the output folder (default :func:`default_pipeline_output`); with ``component``, a path ending in
            ``.safetensors`` writes that component's weights as one file.
        kw: :func:`~ckptfix.ops.convert.convert`'s keywords; ``component``, ``force``, ``fsync``, ``verify`` apply.

    Returns:
        The :class:`ConvertReport`: ``outputs`` every weight file written, ``components`` what each component
        became, ``not_converted`` the weight files left out (a ``.bin`` beside the ``.safetensors`` of its variant).

    Raises:
        OptionNotApplicableError: an option this conversion does not use, or ``component`` for a one-model folder.
        KeyConflictError: no such component.
        OutputError: the output exists (without ``force``), is inside the input, or cannot be written.
    """
    import time

    from ckptfix.ops.convert.options import options_of, refuse_inapplicable
    from ckptfix.ops.pipelines import refuse_component

    started = time.monotonic()
    o, c = options_of(dst, None, None, kw)
    if c.to not in (None, "safetensors"):
        raise UnsupportedError(
            f"{r.path}: --to {c.to}: a {r.layout.framework} folder converts to safetensors (the same folder layout); "
            "convert one weight file of it with `ckptfix convert FILE --to ...`"
        )
    if not is_multi(r):
        refuse_component(r.path, r)
    refuse_inapplicable("pipeline", o, c)
    comp = find_component(r, c.component) if c.component is not None else None
    if comp is not None and o.output is not None and o.output.endswith(".safetensors"):
        return _one_file(r, comp, o, started)
    comps = [comp] if comp is not None else components_of(r)
    src_root = os.path.normpath(os.path.join(r.path, comp.rel)) if comp is not None else r.path
    out = o.output or default_pipeline_output(r, comp)
    _check_output(out, src_root, o.force)
    rep = ConvertReport(source=r.path, outputs=[], source_format=r.layout.name)
    plan = _plan(r, comps)
    parent = os.path.dirname(os.path.abspath(out))
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(out))}.", suffix=".tmp", dir=parent)
    try:
        written = _write(r, src_root, tmp, plan, o, rep)
        replace_directory(tmp, out, fsync=bool(o.fsync))
        tmp = ""
    except OSError as e:
        raise output_error(e, out) from None
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    rep.outputs = [os.path.join(out, rel) for rel in written]
    for cp in comps:
        base = os.path.normpath(os.path.join(r.path, cp.rel))
        inner = os.path.relpath(base, src_root)
        mine = [os.path.join(out, w) for w in written if inner == "." or w.startswith(inner + os.sep)]
        if cp.rel == "." and len(comps) > 1:  # the top folder's own files only (not the other modules' folders)
            others = [os.path.normpath(x.rel) for x in comps if x.rel != "."]
            mine = [p for p in mine if not any(os.path.relpath(p, out).startswith(d + os.sep) for d in others)]
        rep.components[cp.name] = {
            "folder": cp.rel,
            "kind": cp.kind,
            "outputs": mine,
            "problem": cp.problem,
        }
    rep.seconds = time.monotonic() - started
    return rep


def _plan(r: Resolved, comps: list[Component]) -> dict[str, tuple[str, str]]:
    """``{source file: (action, detail)}``: ``convert`` (to this name), ``through`` (a shard read through its index),
    ``unused`` (a weight file beside the chosen one); every other file is copied."""
    plan: dict[str, tuple[str, str]] = {}
    for cp in comps:
        base = os.path.normpath(os.path.join(r.path, cp.rel))
        for w in cp.weights.values():
            name = safetensors_name(w)
            if name is not None:
                plan[os.path.normpath(w)] = ("convert", name)
                if w.endswith(".json"):
                    for s in _index_shards(w):
                        plan[os.path.normpath(os.path.join(base, s))] = ("through", os.path.basename(w))
        for u in cp.unused:
            chosen = ", ".join(os.path.basename(p) for p in cp.weights.values())
            plan.setdefault(
                os.path.normpath(u),
                ("unused", f"beside {chosen}, which from_pretrained reads; convert it on its own: ckptfix convert {u}"),
            )
    return plan


def _write(
    r: Resolved, src_root: str, tmp: str, plan: dict[str, tuple[str, str]], o: Any, rep: ConvertReport
) -> list[str]:
    """Every file of ``src_root`` into ``tmp``: weights converted or copied, the rest copied; returns the weight
    files written (relative to ``tmp``)."""
    from ckptfix.files.outputs import OutputOptions
    from ckptfix.ops.convert import convert
    from ckptfix.ops.convert.options import ConvertOptions

    written: list[str] = []
    verified = True
    for dirpath, dirnames, filenames in os.walk(src_root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))  # .git, .cache: not the model's
        for f in sorted(filenames):
            src = os.path.join(dirpath, f)
            rel = os.path.relpath(src, src_root)
            check_inside(r, src)
            if not os.path.isfile(src):
                rep.skipped[rel] = "not a regular file (a FIFO, device or dangling link); not copied"
                continue
            action, detail = plan.get(os.path.normpath(src), ("copy", ""))
            os.makedirs(os.path.join(tmp, os.path.dirname(rel)), exist_ok=True)
            if action == "through":
                continue  # written with its index's conversion
            if action == "unused":
                rep.not_converted[rel] = detail
                continue
            if action == "convert":
                target = os.path.join(tmp, os.path.dirname(rel), detail)
                one = convert(
                    src,
                    outputs=OutputOptions(output=target, fsync=o.fsync, verify=o.verify),
                    options=ConvertOptions(),
                )
                rep.tensors += one.tensors
                rep.bytes += one.bytes
                rep.aliases.update({f"{os.path.dirname(rel)}/{a}": s for a, s in one.aliases.items()})
                rep.used_torch |= one.used_torch
                verified &= one.verified
                written.append(os.path.relpath(target, tmp))
                continue
            target = os.path.join(tmp, rel)
            copy_file_data(src, target, fsync=o.fsync)
            if os.path.getsize(target) != os.path.getsize(src):
                raise OutputError(f"{target}: the copy of {src} has another size; nothing was written")
            if f.endswith(".safetensors") and _is_weights(f):
                n, b = _count(target)
                rep.tensors += n
                rep.bytes += b
                written.append(rel)
    if o.fsync:
        fsync_dir(tmp)
    rep.verified = verified and o.verify
    return written


def _is_weights(name: str) -> bool:
    return name.startswith(("diffusion_pytorch_model", "model", "pytorch_model", "adapter_model"))


def _count(path: str) -> tuple[int, int]:
    """Tensors and tensor bytes of a safetensors file (its header read back: the copy is a safetensors file)."""
    from ckptfix.formats.safetensors_fmt import read_header

    header, _ = read_header(path)
    rows = [v for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)]
    return len(rows), sum(int(v["data_offsets"][1]) - int(v["data_offsets"][0]) for v in rows)


def _one_file(r: Resolved, comp: Component, o: Any, started: float) -> ConvertReport:
    """``--component NAME -o NAME.safetensors``: that component's weights as one safetensors file."""
    from ckptfix.ops.convert import convert
    from ckptfix.ops.convert.options import ConvertOptions

    if comp.main is None:
        raise UnsupportedError(
            f"{r.path}: component {comp.name!r} ({comp.kind}) has no weights"
            + (f" ({comp.problem})" if comp.problem else " (a configuration only)")
        )
    rep = convert(check_inside(r, comp.main), outputs=dataclasses.replace(o), options=ConvertOptions())
    rep.source = r.path
    rep.components[comp.name] = {"folder": comp.rel, "kind": comp.kind, "outputs": list(rep.outputs), "problem": ""}
    return rep
