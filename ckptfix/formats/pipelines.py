"""Folders of adapters and of several models: peft adapters, diffusers pipelines and models, sentence-transformers.

The detection of four more framework folders (rows of :data:`ckptfix.formats.layouts.LAYOUTS`, added with
:func:`~ckptfix.formats.layouts.register` when :mod:`ckptfix.formats.layouts` is imported):

``peft-adapter``
    peft's ``save_pretrained``: ``adapter_config.json`` + ``adapter_model.safetensors`` (or ``.bin``); one
    checkpoint, read by the default handlers; ``adapter_config.json`` is summarised (base model, rank, alpha,
    target modules, task type).
``diffusers-model``
    one diffusers model's ``save_pretrained`` (``unet/`` on its own): ``config.json`` with ``_diffusers_version``
    + ``diffusion_pytorch_model[.VARIANT].safetensors`` / ``.bin`` or their ``*.index[.VARIANT].json``.
``diffusers-pipeline``
    a pipeline's ``save_pretrained``: ``model_index.json`` naming each component's sub-folder (``unet/``,
    ``vae/``, ``text_encoder/``, ``scheduler/`` ...), each with its own weights (or none: a scheduler).
``hf-model-variant``
    a transformers model saved with ``variant=`` (a pipeline's ``text_encoder/``: ``model.fp16.safetensors``).
``sentence-transformers``
    ``SentenceTransformer.save``: ``modules.json`` naming each module's folder (the Transformer at the root or
    in ``0_Transformer/``, ``1_Pooling/``, ``2_Dense/`` ...).

A folder of several models (the last two) has no single ``Resolved.weights``: its models are
``Resolved.extra["components"]``, a list of :class:`Component`, and the operations' handlers
(:mod:`ckptfix.ops.pipelines`, :mod:`ckptfix.ops.convert.pipelines`) read each one as an ordinary checkpoint.
Nothing here imports torch or unpickles anything: the decision is made from names and the JSON index files.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

from ckptfix.files import pins
from ckptfix.formats.layouts import Layout, Resolved, _others, register
from ckptfix.formats.roles import WEIGHT_NAMES

__all__ = [
    "ADAPTER_NAMES",
    "Component",
    "adapter_summary",
    "components_of",
    "find_component",
    "is_multi",
    "weight_entries",
]

#: peft's adapter weights, in the order ``PeftModel.from_pretrained`` prefers them
ADAPTER_NAMES = ("adapter_model.safetensors", "adapter_model.bin")

#: the JSON index files are small; a bigger one is not read (the folder is then not taken as that layout)
_MAX_JSON = 4 << 20

#: a weight file of a diffusers / transformers model folder: stem, optional variant, extension
_SINGLE = re.compile(r"(diffusion_pytorch_model|model|pytorch_model)(?:\.([\w-]+))?\.(safetensors|bin)")
#: a sharded index: ``diffusion_pytorch_model.safetensors.index.fp16.json``, ``model.safetensors.index.json``
_INDEX = re.compile(r"(diffusion_pytorch_model|model|pytorch_model)\.(safetensors|bin)\.index(?:\.([\w-]+))?\.json")
#: a shard: ``diffusion_pytorch_model-00001-of-00002.safetensors``, ``...fp16-00001-of-00002...``
_SHARD = re.compile(
    r"(diffusion_pytorch_model|model|pytorch_model)(?:\.([\w-]+))?-\d+-of-\d+(?:\.([\w-]+))?\.(safetensors|bin)"
)


@dataclass
class Component:
    """One model (or weight-less part) of a multi-model folder.

    Attributes:
        name: its name in the folder's index (``unet``, ``text_encoder``; a sentence-transformers module's ``0``).
        rel: its folder, relative to the top folder (``unet``, ``2_Dense``; ``.`` for the top folder itself).
        kind: what it is, as the index says (``diffusers UNet2DConditionModel``,
            ``sentence_transformers.models.Dense``).
        weights: ``{variant: path}`` of the file (or ``*.index.json``) its ``from_pretrained`` reads per variant
            (``""``: no variant; ``"fp16"``: ``*.fp16.safetensors``), safetensors preferred as from_pretrained does.
        unused: weight files beside the chosen ones (a ``.bin`` beside the ``.safetensors`` of its variant).
        prefix: the names its tensors take in the folder's combined state dict (``unet.``; ``0.model.``
            for a sentence-transformers Transformer, as ``SentenceTransformer.state_dict()`` names them;
            ``0.auto_model.`` for a folder saved before sentence-transformers 6).
        problem: why the component's folder cannot be read (absent, outside the folder), else "".
    """

    name: str
    rel: str
    kind: str
    weights: dict[str, str] = field(default_factory=dict)
    unused: list[str] = field(default_factory=list)
    prefix: str = ""
    problem: str = ""

    @property
    def main(self) -> str | None:
        """The weights read when no variant is asked: the variant-less file, else the only (first) variant."""
        if "" in self.weights:
            return self.weights[""]
        return self.weights[sorted(self.weights)[0]] if self.weights else None

    def to_dict(self, top: str) -> dict[str, Any]:
        """The ``framework.components`` entry of ``inspect --json`` (paths relative to ``top``)."""
        return {
            "name": self.name,
            "folder": self.rel,
            "kind": self.kind,
            "weights": {v: os.path.relpath(p, top) for v, p in self.weights.items()},
            "unused": [os.path.relpath(p, top) for p in self.unused],
            "prefix": self.prefix,
            "problem": self.problem,
        }


def is_multi(r: Resolved) -> bool:
    """Whether ``r`` is a folder of several models (its handlers read ``extra["components"]``)."""
    return "components" in r.extra


def components_of(r: Resolved) -> list[Component]:
    """The components :func:`resolve` found (empty for a single-checkpoint layout)."""
    got: list[Component] = r.extra.get("components", [])
    return got


def find_component(r: Resolved, name: str) -> Component:
    """The component ``name`` (its name or its folder), or :class:`~ckptfix.errors.KeyConflictError` naming them all."""
    from ckptfix.errors import KeyConflictError

    comps = components_of(r)
    for c in comps:
        if name in (c.name, c.rel, c.rel.rstrip("/")):
            return c
    names = ", ".join(c.name for c in comps) or "none"
    raise KeyConflictError(
        f"{r.path}: no component {name!r} in this {r.layout.framework} folder; its components: {names}"
    )


def _read_json(path: str) -> Any:
    """A small JSON file's document, None when it is missing, too big or not JSON."""
    try:
        if not os.path.isfile(path) or pins.fstat(path).st_size > _MAX_JSON:
            return None
        with open(pins.path_for(path), encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError, RecursionError):
        return None


def weight_entries(folder: str, names: list[str] | None = None) -> tuple[dict[str, str], list[str]]:
    """The weights of one model folder, per variant: ``({variant: file or index}, [other weight files])``.

    A sharded variant is its index (its shards are read through it); per variant safetensors is preferred to
    ``.bin`` and the diffusers name to the transformers ones, as ``from_pretrained`` does.

    Args:
        folder: a model's folder (``unet/``, ``text_encoder/``, ``2_Dense/``).
        names: its entries (listed when None).

    Returns:
        The chosen entry per variant, and every other weight file (not a shard of a chosen index).
    """
    if names is None:
        try:
            names = sorted(os.listdir(folder))
        except OSError:
            return {}, []
    cands: dict[str, list[tuple[tuple[int, int, int], str]]] = {}
    shards: dict[str, str] = {}
    for n in names:
        if not os.path.isfile(os.path.join(folder, n)):
            continue
        m = _INDEX.fullmatch(n)
        if m is not None:
            stem, ext, variant = m.group(1), m.group(2), m.group(3) or ""
            cands.setdefault(variant, []).append((_rank(stem, ext, 1), n))
            continue
        m = _SHARD.fullmatch(n)
        if m is not None:
            shards[n] = m.group(2) or m.group(3) or ""
            continue
        m = _SINGLE.fullmatch(n)
        if m is not None:
            stem, variant, ext = m.group(1), m.group(2) or "", m.group(3)
            cands.setdefault(variant, []).append((_rank(stem, ext, 0), n))
    chosen: dict[str, str] = {}
    unused: list[str] = []
    read_through: set[str] = set()
    for variant, lst in sorted(cands.items()):
        lst.sort()
        best = lst[0][1]
        chosen[variant] = os.path.join(folder, best)
        if best.endswith(".json"):
            read_through |= _index_shards(os.path.join(folder, best))
        unused += [os.path.join(folder, n) for _, n in lst[1:] if not n.endswith(".json")]
    unused += [os.path.join(folder, n) for n in sorted(shards) if n not in read_through]
    return chosen, sorted(set(unused) - set(chosen.values()))


def _rank(stem: str, ext: str, index: int) -> tuple[int, int, int]:
    """Lower first: safetensors before bin, the diffusers stem before the transformers ones, a file before an index."""
    return (0 if ext == "safetensors" else 1, 0 if stem == "diffusion_pytorch_model" else 1, index)


def _index_shards(index: str) -> set[str]:
    doc = _read_json(index)
    wm = doc.get("weight_map") if isinstance(doc, dict) else None
    return {v for v in wm.values() if isinstance(v, str)} if isinstance(wm, dict) else set()


def _inside(top: str, rel: str) -> bool:
    """Whether the relative folder ``rel`` of an index stays inside ``top`` (no ``..``, no absolute path)."""
    if not isinstance(rel, str) or os.path.isabs(rel) or "\x00" in rel:
        return False
    norm = os.path.normpath(rel)
    return norm != ".." and not norm.startswith(".." + os.sep)


# --------------------------------------------------------------------------- peft


def adapter_summary(doc: Any) -> tuple[str, dict[str, Any]]:
    """One line and the numbers of a peft ``adapter_config.json`` (base model, rank, alpha, target modules, task).

    Args:
        doc: the parsed JSON.

    Returns:
        ``(summary, details)``.
    """
    if not isinstance(doc, dict):
        return "JSON (not an object)", {}
    keys: tuple[str, ...] = ("peft_type", "base_model_name_or_path", "r", "lora_alpha", "target_modules", "task_type")
    keys += ("lora_dropout", "bias", "modules_to_save", "use_dora", "revision")
    d = {k: doc[k] for k in keys if k in doc}
    tm = d.get("target_modules")
    if isinstance(tm, list):
        tm = sorted(map(str, tm))
        d["target_modules"] = tm
    parts = [str(d.get("peft_type", "adapter"))]
    if "r" in d:
        parts.append(f"r {d['r']}")
    if "lora_alpha" in d:
        parts.append(f"lora_alpha {d['lora_alpha']}")
    if tm:
        parts.append("target modules " + (", ".join(tm) if isinstance(tm, list) else str(tm)))
    if d.get("task_type"):
        parts.append(f"task {d['task_type']}")
    parts.append(f"base model {d.get('base_model_name_or_path') or '?'}")
    return ", ".join(parts), d


def _detect_peft(folder: str, names: list[str]) -> Resolved | None:
    """peft ``save_pretrained``: ``adapter_config.json`` beside ``adapter_model.safetensors`` / ``.bin``."""
    if "adapter_config.json" not in names:
        return None
    found = [n for n in ADAPTER_NAMES if n in names and os.path.isfile(os.path.join(folder, n))]
    w = os.path.join(folder, found[0]) if found else None
    files = _others(folder, names, w)
    for f in files:
        if f.file in found[1:]:
            f.role = "weights-unused"  # the .bin beside the .safetensors peft prefers
    return Resolved(folder, _LAYOUTS["peft-adapter"], w, files)


def adapter_weights(folder: str, names: list[str]) -> str | None:
    """The adapter weights of a folder that holds a peft adapter (a Trainer ``checkpoint-N/`` of a peft model)."""
    if "adapter_config.json" not in names:
        return None
    for n in ADAPTER_NAMES:
        if n in names and os.path.isfile(os.path.join(folder, n)):
            return os.path.join(folder, n)
    return None


# --------------------------------------------------------------------------- diffusers


def _is_diffusers_config(path: str) -> bool:
    doc = _read_json(path)
    return isinstance(doc, dict) and "_diffusers_version" in doc


def _detect_diffusers_model(folder: str, names: list[str]) -> Resolved | None:
    """One diffusers model's ``save_pretrained`` (``unet/``): ``config.json`` with ``_diffusers_version`` + weights."""
    if "config.json" not in names or not any(n.startswith("diffusion_pytorch_model") for n in names):
        return None
    if not _is_diffusers_config(os.path.join(folder, "config.json")):
        return None
    chosen, unused = weight_entries(folder, names)
    main = chosen.get("") or (chosen[sorted(chosen)[0]] if chosen else None)
    skip = _read_through(chosen)
    files = _others(folder, names, main, tuple(skip))
    held = {os.path.basename(p) for p in chosen.values() if p != main} | {os.path.basename(p) for p in unused}
    for f in files:
        if f.file in held:
            f.role = "weights-unused"
    return Resolved(folder, _LAYOUTS["diffusers-model"], main, files, {"variants": chosen})


def _detect_variant_model(folder: str, names: list[str]) -> Resolved | None:
    """A transformers model saved with ``variant=`` (a pipeline's ``text_encoder/``: ``model.fp16.safetensors``):
    ``config.json`` and only variant weight files (the plain names are the ``hf-model`` row's)."""
    if "config.json" not in names or any(n in names for n in WEIGHT_NAMES):
        return None
    chosen, unused = weight_entries(folder, names)
    if not chosen or "" in chosen:
        return None
    main = chosen[sorted(chosen)[0]]
    files = _others(folder, names, main, tuple(_read_through(chosen)))
    held = {os.path.basename(p) for p in chosen.values() if p != main} | {os.path.basename(p) for p in unused}
    for f in files:
        if f.file in held:
            f.role = "weights-unused"
    return Resolved(folder, _LAYOUTS["hf-model-variant"], main, files, {"variants": chosen})


def _read_through(chosen: dict[str, str]) -> set[str]:
    """The shards the chosen indexes name (not listed as files of their own)."""
    out: set[str] = set()
    for p in chosen.values():
        if p.endswith(".json"):
            out |= _index_shards(p)
    return out


def _detect_diffusers_pipeline(folder: str, names: list[str]) -> Resolved | None:
    """A diffusers pipeline's ``save_pretrained``: ``model_index.json`` and one sub-folder per component."""
    if "model_index.json" not in names:
        return None
    doc = _read_json(os.path.join(folder, "model_index.json"))
    if not isinstance(doc, dict):
        return None
    comps: list[Component] = []
    for name, spec in doc.items():
        if not isinstance(name, str) or name.startswith("_"):
            continue  # _class_name, _diffusers_version, _name_or_path
        if not (isinstance(spec, list) and len(spec) == 2):
            continue  # a plain setting (requires_safety_checker)
        lib, cls = spec
        if lib is None or cls is None:
            continue  # a component saved as None (no safety checker)
        c = Component(str(name), str(name), f"{lib} {cls}", prefix=f"{name}.")
        _fill(folder, c)
        comps.append(c)
    files = _others(folder, names, None)
    return Resolved(folder, _LAYOUTS["diffusers-pipeline"], None, files, {"components": comps})


def _fill(top: str, c: Component) -> None:
    """The component's weights, or why its folder cannot be read."""
    if not _inside(top, c.rel):
        c.problem = f"its folder {c.rel!r} is outside the folder; not read"
        return
    sub = os.path.normpath(os.path.join(top, c.rel))
    if not os.path.isdir(sub):
        c.problem = f"no folder {c.rel}/ (the index names it)"
        return
    c.weights, c.unused = weight_entries(sub)


# --------------------------------------------------------------------------- sentence-transformers


def _detect_sentence_transformers(folder: str, names: list[str]) -> Resolved | None:
    """``SentenceTransformer.save``: ``modules.json`` naming each module's folder (``""`` for the top folder)."""
    if "modules.json" not in names:
        return None
    doc = _read_json(os.path.join(folder, "modules.json"))
    if not isinstance(doc, list) or not doc:
        return None
    comps: list[Component] = []
    inner = _st_transformer_attribute(folder)
    for m in doc:
        if not isinstance(m, dict):
            return None
        name, rel, kind = m.get("name", m.get("idx")), m.get("path", ""), m.get("type", "?")
        if name is None or not isinstance(rel, str):
            return None
        rel = rel or "."
        prefix = f"{name}." + (inner if str(kind).endswith(".Transformer") else "")
        c = Component(str(name), rel, str(kind), prefix=prefix)
        _fill(folder, c)
        comps.append(c)
    files = _others(folder, names, None)  # (a Transformer at the top: its weights listed, so scan reads them)
    return Resolved(folder, _LAYOUTS["sentence-transformers"], None, files, {"components": comps})


def _st_transformer_attribute(folder: str) -> str:
    """The attribute a sentence-transformers ``Transformer`` keeps its transformers model in, as the version that
    saved the folder names it in ``state_dict()``: ``model.`` from 6.0, ``auto_model.`` before."""
    doc = _read_json(os.path.join(folder, "config_sentence_transformers.json"))
    v = doc.get("__version__", {}).get("sentence_transformers") if isinstance(doc, dict) else None
    v = v if isinstance(v, str) else ""
    m = re.match(r"(\d+)", v)
    return "model." if m is not None and int(m.group(1)) >= 6 else "auto_model."


_NEW = [
    Layout(
        "diffusers-pipeline", "diffusers pipeline", "diffusers 0.42.1", _detect_diffusers_pipeline,
        weight_hint=("model_index.json and its components' folders",),
    ),
    Layout(
        "sentence-transformers", "sentence-transformers", "sentence-transformers 6.3.0",
        _detect_sentence_transformers, weight_hint=("modules.json and its modules' folders",),
    ),
    Layout(
        "peft-adapter", "peft adapter", "peft 0.21.2", _detect_peft, weight_hint=ADAPTER_NAMES,
    ),
    Layout(
        "diffusers-model", "diffusers model", "diffusers 0.42.1", _detect_diffusers_model,
        weight_hint=("diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.bin", "their *.index.json"),
    ),
    Layout(
        "hf-model-variant", "Hugging Face model folder (variant weights)", "transformers 5.23.0",
        _detect_variant_model, weight_hint=("model.VARIANT.safetensors", "pytorch_model.VARIANT.bin"),
    ),
]  # fmt: skip
_LAYOUTS: dict[str, Layout] = {lay.name: lay for lay in _NEW}


def _register() -> None:
    # the folders of several models before the Trainer row (their index files say what they are); an adapter or a
    # diffusers model after it (a Trainer ``checkpoint-N/`` of a peft model is the Trainer's, its weights the
    # adapter), before the generic Hugging Face model folder
    for lay in _NEW:
        multi = lay.name in ("diffusers-pipeline", "sentence-transformers")
        register(lay, before="hf-trainer" if multi else "hf-model")


_register()
