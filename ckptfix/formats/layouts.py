"""Folders that training frameworks write, as inputs: which layout, where the model weights are, what else.

A user of transformers' ``Trainer``, accelerate or Lightning holds the *folder* the framework wrote
(``checkpoint-500/``, ``save_state``'s directory, a ModelParallel/FSDP directory), not a plain file.
:func:`resolve` tells the layout from the names in the folder (nothing is unpickled to decide) and
returns a :class:`Resolved`: the framework, the model weights (a file, an index or a DCP directory
that the format readers already read) and every other file with its role.

This module is the *detection* (layer 3, beside the readers it names): the table :data:`LAYOUTS`, one
:class:`Layout` per layout, most specific first, each with the framework versions it was checked
against (``tests/fixtures/frameworks/`` holds folders the frameworks wrote, ``make.py`` regenerates
them), and the one-line summaries of the other files.  The *handlers* sit with the operation they
serve: ``inspect`` in :mod:`ckptfix.ops.inspect` (``inspect_folder``), ``scan`` in :mod:`ckptfix.ops.scan`,
``load_checkpoint`` in :mod:`ckptfix.ops.load` (``load_folder``) and ``convert`` in
:mod:`ckptfix.ops.convert.folders`; :mod:`ckptfix.ops.frameworks` re-exports them all.  A new layout is one
entry (see :func:`register`).

:func:`ckptfix.formats.sniff` names a Trainer ``output_dir``'s ``checkpoint-N/`` sub-folders for a folder with
no checkpoint in it (:func:`checkpoint_subfolders`).  The file roles are :mod:`ckptfix.formats.roles` (pure
names, used by the formats too).

Nothing here imports torch; the sidecar summaries read pickles with the restricted reader.
"""

from __future__ import annotations

import contextvars
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from ckptfix.errors import CkptfixError, NoModelWeightsError
from ckptfix.files import pins
from ckptfix.formats.roles import WEIGHT_NAMES, file_role

# --------------------------------------------------------------------------- the table


@dataclass
class FolderFile:
    """One file (or sub-folder) of a framework folder besides the weights."""

    file: str  # relative to the folder
    role: str
    bytes: int
    summary: str = ""
    details: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"file": self.file, "role": self.role, "bytes": self.bytes, "summary": self.summary}


@dataclass
class Resolved:
    """What :func:`resolve` found in a folder.

    Attributes:
        path: the folder.
        layout: the table entry that recognised it.
        weights: the model weights (a file, a ``*.index.json`` or a DCP directory), None when the folder
            has none (then ``convert`` / ``load`` raise :class:`~ckptfix.errors.NoModelWeightsError`).
        files: every other file, each with its role.
        extra: whatever the layout's handlers need (e.g. a DeepSpeed tag).
    """

    path: str
    layout: "Layout"
    weights: str | None
    files: list[FolderFile] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    def of_role(self, role: str) -> list[str]:
        """The paths of the files with ``role``, in folder order."""
        return [os.path.join(self.path, f.file) for f in self.files if f.role == role]

    def require_weights(self) -> str:
        """The weights path, or :class:`~ckptfix.errors.NoModelWeightsError` naming what the folder holds."""
        if self.weights is not None:
            return self.weights
        held = ", ".join(f.file for f in self.files[:6]) or "nothing else"
        want = " or ".join(self.layout.weight_hint)
        if self.layout.name == "torchtune-recipe-state":
            epochs = self.extra.get("epochs") or []
            parent = os.path.normpath(os.path.join(self.path, os.pardir))  # as the user typed the folder
            where = os.path.join(parent, epochs[-1]) if epochs else "epoch_N/"
            try:  # one model file there (torchtune's model-00001-of-00001.bin): name it, the folder alone is no index
                found = [n for n in sorted(os.listdir(where)) if n.endswith((".bin", ".pt", ".safetensors"))]
            except OSError:
                found = []
            if len(found) == 1:
                where = os.path.join(where, found[0])
            raise NoModelWeightsError(
                f"{self.path}: a torchtune recipe_state/ folder: the training state of an intermediate checkpoint "
                f"(optimizer, epochs run, seed; `ckptfix inspect {self.path}` shows it) and no model weights; the "
                f"model is in the epoch folder beside it: ckptfix convert {where}"
            )
        raise NoModelWeightsError(
            f"{self.path}: a {self.layout.framework} folder ({self.layout.name}) with no model weights in it "
            f"(no {want}; it holds {held}); point at the folder the model was saved to, or pass one of "
            "its files (`ckptfix inspect DIR/optimizer.pt`)"
        )

    def to_dict(self) -> dict[str, Any]:
        """The ``framework`` entry of ``inspect --json``."""
        return {
            "framework": self.layout.framework,
            "layout": self.layout.name,
            "checked_versions": self.layout.checked,
            "folder": self.path,
            "weights": None if self.weights is None else os.path.relpath(self.weights, self.path),
            "files": [f.to_dict() for f in self.files],
        }


@dataclass
class Layout:
    """One row of :data:`LAYOUTS`.

    Attributes:
        name: the layout's name (``hf-trainer``, ``accelerate``, ``lightning-dcp`` ...).
        framework: who writes it, in words (``transformers Trainer``).
        checked: the framework versions it was checked against (fixtures in tests/fixtures/frameworks).
        detect: ``detect(folder, names)`` -> :class:`Resolved` or None (names: the folder's entries, sorted).
        weight_hint: the weight names the layout expects (for the "no weights" message).
        consolidated: the model is spread over partition files (DeepSpeed ZeRO, torch's
            HuggingFaceStorageWriter), found by ``detect`` into ``Resolved.extra["checkpoint"]``: inspect reads
            their records, convert and load consolidate them (the handlers in inspecting, convert.folders
            and loading); False: the ordinary readers on ``Resolved.weights``.
        inspect, convert, load: a layout's own handlers, for a layout registered from above (they take
            precedence); None: the above.  ``inspect(resolved, key)`` -> InspectReport;
            ``convert(resolved, dst, **kw)`` -> ConvertReport; ``load(resolved, **kw)`` -> LoadedCheckpoint.
    """

    name: str
    framework: str
    checked: str
    detect: Callable[[str, list[str]], "Resolved | None"]
    weight_hint: tuple[str, ...] = ("model.safetensors", "pytorch_model.bin", "their *.index.json")
    consolidated: bool = False
    # the handlers' types live above this table (inspecting, convert, loading): named in words only
    inspect: Callable[..., Any] | None = None  # -> InspectReport
    convert: Callable[..., Any] | None = None  # -> ConvertReport
    load: Callable[..., Any] | None = None  # -> LoadedCheckpoint


def _size(p: str) -> int:
    """Bytes of a file, or of the regular files under a folder (a link to a folder is not walked)."""
    if os.path.islink(p) and os.path.isdir(p):
        return 0  # may point anywhere (``/``): not this folder's own bytes
    if os.path.isdir(p):
        total = 0
        for root, _, files in os.walk(p):
            for f in files:
                try:
                    total += os.lstat(os.path.join(root, f)).st_size
                except OSError:
                    pass
        return total
    try:
        return pins.fstat(p).st_size
    except OSError:
        return 0  # a dangling link


def _weights_in(folder: str, names: list[str]) -> str | None:
    for n in WEIGHT_NAMES:
        if n in names and os.path.isfile(os.path.join(folder, n)):
            return os.path.join(folder, n)
    return None


def _others(folder: str, names: list[str], weights: str | None, skip: tuple[str, ...] = ()) -> list[FolderFile]:
    """Every entry of the folder but the weights (and shards an index names), each with its role."""
    wname = os.path.basename(weights) if weights else None
    shards = _index_shards(weights) if weights and weights.endswith(".index.json") else set()
    out = []
    for n in names:
        if n == wname or n in skip or n.startswith("."):
            continue
        role = file_role(n)
        if role == "weights" and wname is not None:
            if n in shards:
                continue  # read through the index
            role = "weights-unused"  # the other format beside the chosen one, a shard the index does not name
        p = os.path.join(folder, n)
        out.append(FolderFile(n, role or ("folder" if os.path.isdir(p) else "other"), _size(p)))
    return out


def _index_shards(index: str) -> set[str]:
    """The shard names an index lists (empty when it cannot be read: reading the weights reports that)."""
    try:
        if pins.fstat(index).st_size > 64 << 20:
            return set()
        with open(pins.path_for(index), encoding="utf-8") as f:
            import json  # here, not at the top: start-up of inspect/scan

            wm = json.load(f).get("weight_map")
        return {v for v in wm.values() if isinstance(v, str)} if isinstance(wm, dict) else set()
    except (OSError, ValueError, RecursionError, AttributeError):
        return set()


def _detect_trainer(folder: str, names: list[str]) -> Resolved | None:
    """transformers ``Trainer``: ``checkpoint-N/`` with ``trainer_state.json`` (and optimizer, scheduler, rng, args)."""
    base = os.path.basename(os.path.normpath(folder))
    marks = {"trainer_state.json", "training_args.bin"}
    if not (marks & set(names) or (re.fullmatch(r"checkpoint-\d+", base) and "optimizer.pt" in names)):
        return None
    w = _weights_in(folder, names)
    if w is None:  # a peft model's checkpoint-N: its adapter is the model's weights
        from ckptfix.formats.pipelines import adapter_weights

        w = adapter_weights(folder, names)
    return Resolved(folder, _BY_NAME["hf-trainer"], w, _others(folder, names, w))


def _detect_accelerate(folder: str, names: list[str]) -> Resolved | None:
    """accelerate ``save_state``: ``random_states_*.pkl`` / ``optimizer.bin`` / ``scheduler.bin`` beside the model."""
    marks = r"random_states_\d+\.pkl|optimizer(_\d+)?\.bin|scheduler(_\d+)?\.bin|pytorch_model_fsdp(_\d+)?(\.bin)?"
    if not any(re.fullmatch(marks, n) for n in names):
        return None
    w = _weights_in(folder, names)
    skip: tuple[str, ...] = ()
    if w is None and os.path.isfile(os.path.join(folder, "pytorch_model_fsdp.bin")):
        w = os.path.join(folder, "pytorch_model_fsdp.bin")  # FSDP FULL_STATE_DICT: rank 0's whole state dict
    elif w is None and "pytorch_model_fsdp_0" in names:  # FSDP SHARDED_STATE_DICT: a DCP directory
        d = os.path.join(folder, "pytorch_model_fsdp_0")
        if os.path.isfile(os.path.join(d, ".metadata")):
            w, skip = d, ("pytorch_model_fsdp_0",)
    files = _others(folder, names, w, skip)
    for f in files:
        if re.fullmatch(r"pytorch_model_fsdp_\d+(\.bin)?", f.file):
            f.role = "model"  # another prepared model's (FULL: pytorch_model_fsdp_1.bin; SHARDED: its DCP folder)
        elif re.fullmatch(r"optimizer_\d+", f.file) and os.path.isfile(os.path.join(folder, f.file, ".metadata")):
            f.role = "optimizer-dcp"  # FSDP SHARDED_STATE_DICT's optimizer: a DCP directory
    return Resolved(folder, _BY_NAME["accelerate"], w, files)


def _detect_lightning_dcp(folder: str, names: list[str]) -> Resolved | None:
    """Lightning ModelParallel / FSDP (``state_dict_type="sharded"``): a DCP directory plus ``meta.pt``."""
    if ".metadata" not in names or "meta.pt" not in names or not os.path.isfile(os.path.join(folder, ".metadata")):
        return None
    return Resolved(folder, _BY_NAME["lightning-dcp"], folder, _others(folder, names, None, _dcp_files(names)))


def _dcp_files(names: list[str]) -> tuple[str, ...]:
    return tuple(n for n in names if n.endswith(".distcp") or n == ".metadata")


def _detect_dcp(folder: str, names: list[str]) -> Resolved | None:
    """torch ``dcp.save`` with the ``FileSystemWriter``: ``.metadata`` + ``__R_I.distcp`` files."""
    if ".metadata" not in names or not os.path.isfile(os.path.join(folder, ".metadata")):
        return None  # a ``.metadata`` folder (IDEs, dvc) is no DCP metadata
    return Resolved(folder, _BY_NAME["torch-dcp"], folder, _others(folder, names, None, _dcp_files(names)))


def _detect_torchtune_recipe_state(folder: str, names: list[str]) -> Resolved | None:
    """torchtune's ``output_dir/recipe_state/``: ``recipe_state.pt``, the training state of an intermediate checkpoint
    (the optimizer's state, ``seed``, ``epochs_run``, ``total_epochs`` ...); the model is in ``epoch_N/`` beside it."""
    if "recipe_state.pt" not in names or not os.path.isfile(os.path.join(folder, "recipe_state.pt")):
        return None
    files = _others(folder, names, None)
    for f in files:
        if f.file == "recipe_state.pt":
            f.role = "recipe-state"
    parent = os.path.dirname(os.path.abspath(folder))
    try:
        epochs = sorted(
            (n for n in os.listdir(parent) if re.fullmatch(r"epoch_\d+", n) and os.path.isdir(os.path.join(parent, n))),
            key=lambda n: int(n[6:]),
        )
    except OSError:
        epochs = []
    return Resolved(folder, _BY_NAME["torchtune-recipe-state"], None, files, {"epochs": epochs})


def _detect_hf_model(folder: str, names: list[str]) -> Resolved | None:
    """A Hugging Face model folder (``save_pretrained``): ``config.json`` and/or the weight names."""
    w = _weights_in(folder, names)
    if w is None or (w.endswith(".index.json") and "config.json" not in names):
        return None  # shards + index alone: the plain sharded format already reads the folder
    return Resolved(folder, _BY_NAME["hf-model"], w, _others(folder, names, w))


#: every layout, most specific first (the first whose detect returns something wins)
LAYOUTS: list[Layout] = [
    Layout("lightning-dcp", "Lightning ModelParallel/FSDP", "lightning 2.6.6", _detect_lightning_dcp),
    Layout("torch-dcp", "torch.distributed.checkpoint", "torch 2.4-2.13", _detect_dcp),
    Layout("hf-trainer", "transformers Trainer", "transformers 4.40-5.23", _detect_trainer),
    Layout(
        "accelerate",
        "accelerate save_state",
        "accelerate 1.15.0-1.16.0",
        _detect_accelerate,
        weight_hint=("model.safetensors", "pytorch_model.bin", "pytorch_model_fsdp.bin", "pytorch_model_fsdp_0/"),
    ),  # fmt: skip
    Layout(
        "torchtune-recipe-state",
        "torchtune recipe state",
        "torchtune 0.6.1",
        _detect_torchtune_recipe_state,
        weight_hint=("the model, which torchtune writes to epoch_N/ beside recipe_state/",),
    ),  # fmt: skip
    Layout("hf-model", "Hugging Face model folder", "transformers 4.40-5.23", _detect_hf_model),
]
_BY_NAME: dict[str, Layout] = {lay.name: lay for lay in LAYOUTS}


#: set while a handler reads a folder's weights: the weights may be the folder itself (a DCP directory)
NESTED: contextvars.ContextVar[bool] = contextvars.ContextVar("ckptfix_frameworks_nested", default=False)


def register(layout: Layout, *, before: str | None = None) -> None:
    """Add a layout to :data:`LAYOUTS` (before the entry named ``before``, else before the generic ones).

    DeepSpeed ZeRO and torch's HuggingFaceStorageWriter are added this way, at the bottom of this module
    (``consolidated=True``: inspect, convert and load consolidate their partitions).  A layout registered
    from above (a plugin) may bring its own handlers instead; the default ones read ``Resolved.weights``::

        def _detect_mine(folder, names):          # names: the folder's entries, sorted
            if "my_state.json" not in names:
                return None
            w = os.path.join(folder, "weights.pt")
            return Resolved(folder, LAYOUT, w if "weights.pt" in names else None, [])

        LAYOUT = Layout("my-framework", "My framework", "my-framework 1.0", _detect_mine,
                        weight_hint=("weights.pt",),
                        inspect=lambda r, key: ...,             # -> InspectReport (set .framework = r.to_dict())
                        convert=lambda r, dst, **kw: ...,       # convert()'s keywords -> ConvertReport
                        load=lambda r, **kw: ...)               # load_checkpoint()'s keywords -> LoadedCheckpoint
        register(LAYOUT)

    Args:
        layout: the new entry.
        before: the name of the entry it must be tried before (default ``"hf-trainer"``: after the DCP
            entries, before the folders recognised by file names alone).
    """
    at = next((i for i, lay in enumerate(LAYOUTS) if lay.name == (before or "hf-trainer")), len(LAYOUTS))
    LAYOUTS.insert(at, layout)
    _BY_NAME[layout.name] = layout


def resolve(path: str | os.PathLike) -> Resolved | None:
    """Which framework wrote the folder ``path``, where its model weights are, and what else it holds.

    Decided from the names in the folder only (nothing is read or unpickled).

    Args:
        path: a directory (anything else gives None).

    Returns:
        A :class:`Resolved`, or None when the folder is none of :data:`LAYOUTS` (callers then keep their
        own handling: a sharded index's folder, or the "no checkpoint in it" message).
    """
    p = os.fspath(path)
    if NESTED.get() or not os.path.isdir(p):
        return None
    try:
        names = sorted(os.listdir(p))
    except OSError:
        return None
    for lay in LAYOUTS:
        r = lay.detect(p, names)
        if r is not None:
            return r
    return None


# --------------------------------------------------------------------------- what each other file holds


def optimizer_summary(obj: Any) -> dict[str, Any] | None:
    """Param groups, state tensors and their bytes of an optimizer state (torch, accelerate, DeepSpeed ZeRO).

    Args:
        obj: the object read from the file (records and placeholders).

    Returns:
        ``{"param_groups", "params", "state_tensors", "state_bytes", "state_keys", "kind"}``, or None when
        ``obj`` is no optimizer state.
    """
    from ckptfix.formats.statedict import flatten_containers, is_optimizer_state

    kind = is_optimizer_state(obj)
    if kind is None:
        return None
    inner = obj
    if kind == "deepspeed":
        inner = obj.get("optimizer_state_dict", obj)
        inner = inner.get("base_optimizer_state", inner) if isinstance(inner, Mapping) else inner
    groups = inner.get("param_groups") if isinstance(inner, Mapping) else None
    groups = groups if isinstance(groups, list) else []
    state = inner.get("state") if isinstance(inner, Mapping) else None
    keys: set[str] = set()
    if isinstance(state, Mapping):
        for v in state.values():
            if isinstance(v, Mapping):
                keys.update(str(k) for k in v.keys())
    flat = flatten_containers(obj)
    params = sum(len(g.get("params", [])) for g in groups if isinstance(g, Mapping))
    return {
        "kind": kind,
        "param_groups": len(groups),
        "params": params,
        "state_tensors": len(flat),
        "state_bytes": sum(getattr(t, "nbytes", 0) for t in flat.values()),
        "state_keys": sorted(keys),
    }


def _short(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 40 else s[:37] + "..."


def _stub_fields(obj: Any) -> Mapping[str, Any]:
    from ckptfix.pickles import Stub

    if isinstance(obj, Stub):
        st = obj.state
        if isinstance(st, tuple) and st and isinstance(st[0], dict):
            st = st[0]
        return st if isinstance(st, Mapping) else (obj.dictitems or {})
    return obj if isinstance(obj, Mapping) else {}


def describe_file(path: str, role: str) -> tuple[str, dict[str, Any]]:
    """One line on what a framework's file holds, and the numbers behind it.

    Args:
        path: the file.
        role: its role (:func:`file_role`).

    Returns:
        ``(summary, details)``; a file that cannot be read is described, never raised.
    """
    if not os.path.isdir(path) and not os.path.isfile(path):
        return "not a regular file (a FIFO, device or dangling link); not read", {}
    try:
        return _describe(path, role)
    except CkptfixError as e:
        return f"unreadable ({e})", {"error": str(e)}
    except RecursionError:
        return "unreadable (nested too deeply)", {"error": "nested too deeply"}
    except (OSError, ValueError) as e:
        return f"unreadable ({type(e).__name__}: {e})", {"error": str(e)}


def _describe(path: str, role: str) -> tuple[str, dict[str, Any]]:
    from ckptfix.text import human_bytes

    if os.path.isdir(path):
        return f"folder, {human_bytes(_size(path))}", {}
    if path.endswith(".json"):
        if pins.fstat(path).st_size > 4 << 20:
            return "JSON, not read (over 4 MiB)", {}
        with open(pins.path_for(path), encoding="utf-8") as f:
            import json  # here, not at the top: start-up of inspect/scan

            doc = json.load(f)
        if not isinstance(doc, dict):
            return "JSON", {}
        if role == "trainer-state":
            d = {k: doc.get(k) for k in ("global_step", "epoch", "max_steps", "best_metric") if k in doc}
            return ", ".join(f"{k} {v}" for k, v in d.items() if v is not None), d
        if role == "adapter":
            from ckptfix.formats.pipelines import adapter_summary

            return adapter_summary(doc)
        if role == "config":
            d = {k: doc.get(k) for k in ("architectures", "model_type", "tie_word_embeddings") if k in doc}
            if "_diffusers_version" in doc:  # a diffusers model's config (unet/config.json)
                return f"{doc.get('_class_name', '?')} (diffusers {doc['_diffusers_version']})", {}
            arch = ", ".join(map(str, doc.get("architectures") or [])) or "?"
            return f"{arch} ({doc.get('model_type', '?')})", d
        return f"JSON ({len(doc)} keys)", {}
    if role in ("tokenizer", "other", "folder"):
        return human_bytes(pins.fstat(path).st_size), {}
    from ckptfix.formats import read_checkpoint
    from ckptfix.formats.statedict import contains_tensors

    cf = read_checkpoint(path)
    obj = cf.obj
    if role == "recipe-state" and isinstance(obj, Mapping):
        return _recipe_state(obj)
    opt = optimizer_summary(obj)
    if opt is not None:
        keys = f" ({', '.join(opt['state_keys'][:4])})" if opt["state_keys"] else ""
        s = (
            f"{opt['param_groups']} param group(s), {opt['params']} params, {opt['state_tensors']} state tensors"
            f"{keys}, {human_bytes(opt['state_bytes'])}"
        )
        if opt["kind"] == "deepspeed":
            s = "DeepSpeed ZeRO partition: " + s
        return s, opt
    fields = _stub_fields(obj)
    if role == "scheduler":
        d = {k: fields[k] for k in ("last_epoch", "_step_count", "_last_lr") if k in fields}
        return ", ".join(f"{k.lstrip('_')} {_short(v)}" for k, v in d.items()) or "scheduler state", {
            k: v for k, v in d.items() if isinstance(v, (int, float, str))
        }
    if role == "rng":
        states = [str(k) for k in fields.keys()]
        return "RNG states: " + (", ".join(states) or "?"), {"states": states}
    if role == "args":
        d = {k: fields[k] for k in ("max_steps", "num_train_epochs", "learning_rate", "seed") if k in fields}
        cls = type(obj).__name__
        return f"{cls}: " + ", ".join(f"{k} {_short(v)}" for k, v in d.items()), {
            k: v for k, v in d.items() if isinstance(v, (int, float, str))
        }
    if role == "meta":
        d = lightning_meta(obj)
        parts = [f"{k} {_short(d[k])}" for k in ("epoch", "global_step") if k in d]
        if "hyper_parameters" in d:
            parts.append(f"hyper_parameters {_short(d['hyper_parameters'])}")
        if "pytorch-lightning_version" in d:
            parts.append(f"lightning {d['pytorch-lightning_version']}")
        return ", ".join(parts), d
    n = len(fields)
    what = "tensors" if contains_tensors(obj) else "no tensors"
    return f"{cf.format}, {n} entries, {what}", {}


def _recipe_state(obj: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """torchtune's ``recipe_state.pt``: its counters, and its optimizer state's summary."""
    from ckptfix.text import human_bytes

    d: dict[str, Any] = {
        k: obj[k] for k in ("epochs_run", "total_epochs", "max_steps_per_epoch", "seed", "steps_run") if k in obj
    }
    d = {k: v for k, v in d.items() if v is None or isinstance(v, (int, float, str))}
    parts = [f"{k} {v}" for k, v in d.items()]
    opt = optimizer_summary(obj.get("optimizer"))
    if opt is not None:
        d["optimizer"] = opt
        parts.append(
            f"optimizer: {opt['param_groups']} param group(s), {opt['params']} params, {opt['state_tensors']} state "
            f"tensors, {human_bytes(opt['state_bytes'])}"
        )
    others = [str(k) for k in obj if k not in d and k != "optimizer"]
    if others:
        parts.append("also " + ", ".join(others[:5]))
    return "torchtune recipe state: " + ", ".join(parts), d


def lightning_meta(obj: Any) -> dict[str, Any]:
    """The plain-data part of a Lightning ``meta.pt`` (epoch, global_step, hyper_parameters, version ...).

    Args:
        obj: the object read from ``meta.pt``.

    Returns:
        The entries whose values are JSON data (numbers, strings, and dicts/lists of them).
    """

    def plain(v: Any, depth: int = 0) -> Any:
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        if depth < 6 and isinstance(v, Mapping):
            out = {str(k): plain(x, depth + 1) for k, x in v.items()}
            return {k: x for k, x in out.items() if x is not _NOPE}
        if depth < 6 and isinstance(v, (list, tuple)):
            return [x for x in (plain(x, depth + 1) for x in v) if x is not _NOPE]
        return _NOPE

    out: dict[str, Any] = {}
    if isinstance(obj, Mapping):
        for k in ("epoch", "global_step", "pytorch-lightning_version", "hparams_name", "hyper_parameters"):
            if k in obj:
                v = plain(obj[k])
                if v is not _NOPE:
                    out[k] = v
    return out


_NOPE = object()


def describe_files(r: Resolved) -> Resolved:
    """Fill in each file's summary (reads each file with the restricted, torch-free reader)."""
    from ckptfix.files.containment import allowed_roots, inside

    roots = allowed_roots(r.path)
    for f in r.files:
        p = os.path.join(r.path, f.file)
        real = os.path.realpath(p)
        if os.path.islink(p) and not inside(real, roots):
            if f.role == "meta":  # a file convert and load read (the Lightning DCP meta.pt): refused, as by them
                check_inside(r, p)
            f.summary, f.details = f"a link to {real}, outside the folder; not read", {}
            continue
        f.summary, f.details = describe_file(p, f.role)
    return r


def identify_object(obj: Any) -> dict[str, str] | None:
    """The framework a single file's object came from, when it says so (a Lightning ``.ckpt``).

    Args:
        obj: the object read from the file.

    Returns:
        ``{"framework", "layout", "checked_versions"}`` or None.
    """
    if isinstance(obj, Mapping) and "pytorch-lightning_version" in obj and "state_dict" in obj:
        return {
            "framework": "Lightning",
            "layout": "lightning-ckpt",
            "checked_versions": "lightning 2.6.6",
            "version": str(obj.get("pytorch-lightning_version")),
        }
    return None


def checkpoint_subfolders(folder: str) -> list[str]:
    """The sub-folders of ``folder`` that are framework folders (Trainer's ``output_dir``), newest first.

    Args:
        folder: a directory that is no checkpoint itself.

    Returns:
        Their names, the highest trailing number (``checkpoint-1000``) first.
    """
    try:
        subs = [n for n in os.listdir(folder) if not n.startswith(".") and os.path.isdir(os.path.join(folder, n))]
    except OSError:
        return []
    found = [n for n in subs[:1000] if resolve(os.path.join(folder, n)) is not None]

    def newest(n: str) -> tuple[int, str]:
        m = re.search(r"(\d+)$", n)
        return (-int(m.group(1)) if m else 0, n)

    return sorted(found, key=newest)


def check_inside(r: Resolved, path: str) -> str:
    """``path`` (a file convert or load reads from the folder), refused if it links outside the folder.

    The Hugging Face hub cache (``snapshots/<rev>/x -> ../../blobs/<hash>``) is allowed, as for a sharded
    index's shards: a folder from someone else must not make ``convert`` copy a file of yours into an output.
    """
    from ckptfix.errors import UnsupportedError

    real = outside(r, path)
    if real is not None:
        raise UnsupportedError(
            f"{path}: a link to {real}, outside the folder {r.path}; refused "
            "(copy the file into the folder, or pass the file itself)"
        )
    return path


def outside(r: Resolved, path: str) -> str | None:
    """Where ``path`` really is when that is outside the folder (the hub cache's blobs count as inside), else
    None: what :func:`check_inside` refuses and a folder's scan leaves unread."""
    from ckptfix.formats.sharded import _allowed_roots, _inside

    real = os.path.realpath(path)
    return None if _inside(real, _allowed_roots(os.path.abspath(r.path))) else real


# --------------------------------------------------------------------------- consolidated layouts
# DeepSpeed ZeRO (ckptfix.formats.deepspeed) and torch's HuggingFaceStorageWriter (ckptfix.formats.hfstorage): the model
# is not in one file but spread over partitions; inspect reads their records, convert/load consolidate them.


def _detect_zero(folder: str, names: list[str]) -> Resolved | None:
    """A DeepSpeed ``ckpt_dir`` (``latest`` -> ``global_stepN/``) or a tag folder of ZeRO partitions."""
    if not ("latest" in names or any(n.startswith("global_step") or n.endswith("_optim_states.pt") for n in names)):
        return None
    if _weights_in(folder, names) is not None:
        return None  # a Trainer checkpoint-N saved with DeepSpeed that also holds the model: that layout reads it
    from ckptfix.formats.deepspeed import find_zero_checkpoint

    zc = find_zero_checkpoint(folder)
    if zc is None:
        return None
    tag = os.path.relpath(zc.tag_dir, folder)
    skip = tuple(n for n in (tag, "latest") if n != ".")
    files = [
        f for f in _others(folder, names, None, skip) if not f.file.endswith(("_optim_states.pt", "_model_states.pt"))
    ]
    return Resolved(folder, _BY_NAME["deepspeed-zero"], zc.tag_dir, files, {"checkpoint": zc})


def _detect_hf_storage(folder: str, names: list[str]) -> Resolved | None:
    """torch's ``HuggingFaceStorageWriter`` output: ``shard-NNNNN-model-*-of-*.safetensors``, no ``.metadata``."""
    if ".metadata" in names or not any(n.startswith("shard-") and n.endswith(".safetensors") for n in names):
        return None
    from ckptfix.formats.hfstorage import find_hf_storage

    hf = find_hf_storage(folder)
    if hf is None:
        return None
    shards = tuple(os.path.basename(f) for f in hf.files)
    return Resolved(
        folder, _BY_NAME["hf-storage-dcp"], folder, _others(folder, names, None, shards), {"checkpoint": hf}
    )


def _detect_dtensor_ranks(folder: str, names: list[str]) -> Resolved | None:
    """Per-rank FSDP state dicts of DTensors (accelerate ``use_dcp=False``, verl): ``*_rank{R}.bin``, ``*_rank_R.pt``"""
    if not any("_rank" in n for n in names):
        return None
    from ckptfix.formats.dtensor_ranks import find_dtensor_ranks

    dr = find_dtensor_ranks(folder)
    if dr is None:
        return None
    skip = tuple(os.path.basename(f) for f in dr.model.files.values())
    files = _others(folder, names, None, skip)
    ranked = {os.path.basename(f) for g in dr.groups[1:] for f in g.files.values()}
    for f in files:
        if f.file in ranked:
            f.role = "optimizer" if f.file.startswith("optim") else "model"
    return Resolved(folder, _BY_NAME["fsdp-dtensor-ranks"], folder, files, {"checkpoint": dr})


register(
    Layout(
        "fsdp-dtensor-ranks", "FSDP per-rank DTensor files", "torch 2.13.0 FSDP2, accelerate 1.16.0",
        _detect_dtensor_ranks, weight_hint=("pytorch_model_fsdp_0_rank0.bin", "model_world_size_N_rank_0.pt"),
        consolidated=True,
    )
)  # fmt: skip
register(
    Layout(
        "deepspeed-zero", "DeepSpeed ZeRO", "deepspeed 0.19.8", _detect_zero, weight_hint=("latest", "global_stepN/"),
        consolidated=True,
    )
)  # fmt: skip
register(
    Layout(
        "hf-storage-dcp", "torch HuggingFaceStorageWriter", "torch 2.13.0", _detect_hf_storage,
        weight_hint=("shard-NNNNN-model-*-of-*.safetensors",),
        consolidated=True,
    ),
    before="hf-model",
)  # fmt: skip
# peft adapters, diffusers pipelines and models, sentence-transformers folders: their rows (ckptfix.formats.pipelines)
from ckptfix.formats import pipelines as _pipelines  # noqa: E402,F401  (registers its layouts)
