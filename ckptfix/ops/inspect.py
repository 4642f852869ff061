"""``inspect``: report on a checkpoint without torch and without running pickle code.

``scan`` is :mod:`ckptfix.ops.scan` (its public names are re-exported here, where they used to live).
"""

from __future__ import annotations

import collections
import fnmatch
import itertools
import os
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Mapping

from ckptfix.files import pins, source
from ckptfix.formats import CheckpointFile, DcpDetails, Format, SafetensorsDetails, is_tensor_like, read_checkpoint
from ckptfix.formats.layouts import Resolved, describe_files, identify_object, optimizer_summary, resolve
from ckptfix.ops.plaindata import NUMPY_TO_TORCH, dtype_code, normalise_global, opcodes_weights_only_cannot_read
from ckptfix.ops.scan import SCAN_SCHEMA, ScanReport, scan_checkpoint, scan_unsafe
from ckptfix.ops.scan import global_context as _context
from ckptfix.pickles import (
    Stub,
    TensorRecord,
    global_name,
)
from ckptfix.pickles.policy import classify_global, needs_package
from ckptfix.pickles.subclass import layout_notes, subclass_notes

INSPECT_SCHEMA = "ckptfix.inspect/1"


@dataclass
class InspectReport:
    """What :func:`inspect_checkpoint` found; ``to_dict()`` is the ``--json`` document.

    Counting (tied = one tensor under several names, as GPT-2's ``lm_head.weight`` and
    ``transformer.wte.weight``):

    ``tensor_count``            names in the state dict that hold a tensor
    ``parameter_count``         values summed over every name (tied counted once per name, as
                                ``sum(t.numel() for t in model.state_dict().values())``)
    ``unique_parameter_count``  values summed over distinct tensors (tied counted once, as
                                ``sum(p.numel() for p in model.parameters())`` for parameters)
    ``total_bytes``             bytes summed over every name (``numel * element_size``)
    ``unique_bytes``            bytes of the distinct storages the state dict uses (tied tensors and views
                                of one storage counted once): what loading it costs
    ``storage_bytes``           bytes of every storage in the file, inside the state dict or not

    A valid file without tensors (``training_args.bin``, a scheduler state) has ``tensor_count`` 0,
    ``state_dict_key`` None and its entries in ``non_tensor_entries``.
    """

    path: str
    format: Format
    file_size: int
    state_dict_key: list[str] | None
    tensor_count: int
    parameter_count: int
    unique_parameter_count: int
    total_bytes: int
    unique_bytes: int
    storage_bytes: int
    dtypes: dict[str, int]
    locations: dict[str, int]
    prefixes: dict[str, int]
    shared: list[list[str]]
    non_tensor_entries: dict[str, str]
    globals: dict[str, str]
    stubbed_globals: list[str]
    weights_only_ok: bool
    weights_only_reason: str
    notes: list[str] = field(default_factory=list)
    dcp: dict[str, Any] | None = None  # DCP directories: files, ranks, chunks, tensors, objects, version
    # the training framework that wrote the folder (or file): layout, weights, every other file
    # (ckptfix.ops.frameworks); None for a plain checkpoint
    framework: dict[str, Any] | None = None
    # one row per tensor name, in the state dict's order: name, shape (a list, as torch.Size holds it),
    # dtype, device (the storage tag as saved; None when the format has none) and shared_with (the other
    # names whose tensors use the same storage: tied weights, views; at most SHARED_WITH_MAX of them,
    # shared_count how many there are; the ``shared`` groups hold them all); only the names ``tensor_filter``
    # matches when one is given (the counts above are always of the whole state dict)
    tensors: list[dict[str, Any]] = field(default_factory=list)
    tensor_filter: str | None = None
    # a framework folder: ``scan`` of every pickle-bearing file in it, ``{"verdict", "files": {name: {"verdict",
    # "dangerous", "unknown", ...}}}`` (the folder's verdict is the worst file's); None for a single checkpoint
    folder_scan: dict[str, Any] | None = None
    # one rank's file of an FSDP per-rank state dict: ``{"shards", "rank", "world"}`` (rank/world None when its
    # mesh does not say); the values counted above are then only this rank's pieces.  None otherwise
    dtensor_shards: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """The ``inspect --json`` document.

        Returns:
            ``schema`` (``ckptfix.inspect/1``) and every field.
        """
        d: dict[str, Any] = {"schema": INSPECT_SCHEMA}
        # the rows and groups are plain values: copied directly (asdict's deep copy of 30,000 rows took seconds)
        d.update(asdict(replace(self, tensors=[], shared=[])))
        d["shared"] = [list(g) for g in self.shared]
        d["tensors"] = [{**r, "shape": list(r["shape"]), "shared_with": list(r["shared_with"])} for r in self.tensors]
        return d


def _describe(v: Any) -> str:
    if isinstance(v, TensorRecord):
        return f"tensor {v.dtype} {list(v.shape)}"
    if isinstance(v, type):
        name = normalise_global(global_name(v)) if issubclass(v, Stub) else f"{v.__module__}.{v.__qualname__}"
        return f"class {name} (a reference, not an instance)"
    if isinstance(v, Stub):
        name = normalise_global(global_name(type(v)))
        st = v.state
        if name.endswith("multiarray._reconstruct") and isinstance(st, tuple) and len(st) == 5:
            code = dtype_code(st[2]) or "?"
            shape = list(st[1]) if isinstance(st[1], tuple) else "?"
            return f"numpy.ndarray {NUMPY_TO_TORCH.get(code, code)} {shape} (placeholder)"
        if name.endswith("multiarray.scalar") and v.args:
            code = dtype_code(v.args[0]) or "?"
            return f"numpy scalar {NUMPY_TO_TORCH.get(code, code)} (placeholder)"
        return f"object {name} (placeholder)"
    if isinstance(v, dict):
        n = sum(1 for _ in v)
        return f"dict ({n} keys)"
    if isinstance(v, (list, tuple)):
        return f"{type(v).__name__} ({len(v)} items)"
    if isinstance(v, (int, float, bool, str)) or v is None:
        s = repr(v)
        return s if len(s) <= 60 else s[:57] + "..."
    return type(v).__name__


def _prefix_counts(keys: list[str], own: Mapping[str, str] | None = None) -> dict[str, int]:
    from ckptfix.ops.prefixes import detect_prefixes

    rep = detect_prefixes(keys, own or ())
    out = dict(rep.leading)
    out.update({f"(inner) {k}": v for k, v in rep.inner.items()})
    return out


def tensor_name_matches(name: str, pattern: str | None) -> bool:
    """Whether ``inspect --filter PATTERN`` lists tensor ``name``.

    A pattern with a wildcard (``*``, ``?``, ``[...]``) matches the whole name, as a shell glob
    (case-sensitive); one without is a substring of the name.

    Args:
        name: a state-dict name.
        pattern: the pattern; None matches every name.

    Returns:
        True when the name is listed.

    >>> tensor_name_matches("layer1.0.conv1.weight", "layer1.*.weight"), tensor_name_matches("fc.bias", "conv")
    (True, False)
    """
    if pattern is None:
        return True
    if any(c in pattern for c in "*?["):
        return fnmatch.fnmatchcase(name, pattern)
    return pattern in name


def _rows(
    names: list[str],
    info: Mapping[str, tuple[list[int], str, str | None]],
    shared: list[list[str]],
    pattern: str | None,
) -> list[dict[str, Any]]:
    """The ``tensors`` rows of the names ``pattern`` matches (``info``: name -> shape, dtype, device).

    A row names at most :data:`SHARED_WITH_MAX` of the other names on its storage (``shared_count``: how many
    there are; ``shared`` lists every group whole): one row costs the same however many views share a
    storage (11,000 views of one storage listing each other were 121 million names)."""
    group = {n: g for g in shared for n in g}
    out = []
    for n in names:
        if not tensor_name_matches(n, pattern):
            continue
        shape, dtype, device = info[n]
        g = group.get(n, ())
        others = [x for x in itertools.islice(g, SHARED_WITH_MAX + 1) if x != n][:SHARED_WITH_MAX]
        out.append(
            {
                "name": n,
                "shape": shape,
                "dtype": dtype,
                "device": device,
                "shared_with": others,
                "shared_count": max(len(g) - 1, 0),
            }
        )
    return out


#: the most other names a ``tensors`` row lists in ``shared_with`` (``shared_count`` says how many there are)
SHARED_WITH_MAX = 16


def inspect_checkpoint(
    path: str | os.PathLike, key: str | None = None, tensor_filter: str | None = None, component: str | None = None
) -> InspectReport:
    """Summarise a checkpoint without loading tensor data and without running any pickle code.

    Args:
        path: any checkpoint ckptfix reads (torch zip/legacy, safetensors, sharded index, DCP, TorchScript), or
            its :class:`~ckptfix.formats.Input` (not sniffed again).
        key: where the state dict sits (found automatically otherwise).
        tensor_filter: list only the tensors whose names match (:func:`tensor_name_matches`) in
            ``tensors``; the counts stay those of the whole state dict.
        component: a folder of several models (a diffusers pipeline, a sentence-transformers model): report
            only this component (``unet``), under its own names (:mod:`ckptfix.ops.pipelines`).

    Returns:
        InspectReport (see its docstring for what each count means).  A valid torch file without
        tensors is summarised too (``tensor_count`` 0).

    A folder a training framework wrote (Trainer ``checkpoint-N/``, accelerate ``save_state``, Lightning
    ModelParallel, a Hugging Face model folder: :mod:`ckptfix.ops.frameworks`) is reported as its model
    weights, with ``framework`` naming the layout and summarising every other file.

    Raises:
        CheckpointNotFoundError, CorruptCheckpointError, UnsupportedError: unreadable input.
        KeyConflictError: ``key`` does not exist.
        NoModelWeightsError: a framework folder without model weights.
    """
    if not source.is_url(path) and os.path.isdir(path):  # (framework folders are local only, for now)
        fw = resolve(path)
        if fw is not None:
            rep: InspectReport = inspect_folder(fw, key, tensor_filter, component)
            return rep
    if component is not None:
        from ckptfix.ops.pipelines import refuse_component

        refuse_component(path)
    # a remote object is opened once (one pinned version) for the whole inspection, and only its metadata is read
    with source.session():
        with source.metadata_only():
            rep = inspect_file(path, key, tensor_filter)
        # a folder (local without a framework layout, or remote): every file's verdict; a DCP directory is one
        # checkpoint (weights_only already fails for it; its scan reads every item, more than inspect's metadata)
        if rep.format != Format.DCP and source.isdir(path):
            sc = scan_checkpoint(path)
            from ckptfix.ops.scan import _rel

            _apply_scan(rep, sc, _rel(os.fspath(rep.path), os.fspath(path)))
        return rep


def inspect_file(path: str | os.PathLike, key: str | None = None, tensor_filter: str | None = None) -> InspectReport:
    """:func:`inspect_checkpoint` of one checkpoint (file, index or DCP directory), no framework lookup.

    Args:
        path: the checkpoint.
        key: where the state dict sits.
        tensor_filter: as for :func:`inspect_checkpoint`.

    Returns:
        The :class:`InspectReport`.
    """
    from ckptfix.formats.hfarch import own_prefixes

    cf = read_checkpoint(path)
    key_path, sd, holder = _locate(cf, key)
    own = {} if source.is_url(path) else own_prefixes(path)
    tensors = {k: v for k, v in sd.items() if is_tensor_like(v)}
    distinct = _distinct(tensors)
    sd_storages = {id(t.storage): t.storage for t in tensors.values() if t.storage is not None}
    locations: collections.Counter[str] = collections.Counter(st.location for st in cf.storages.values())
    gl: dict[str, str] = {g: classify_global(g, _context(cf.format)) for g in sorted(cf.globals_seen)}
    wo_ok, why = _weights_only(cf, [g for g, c in gl.items() if c != "safe"])
    shared = _shared(tensors)
    info = {n: (list(map(int, t.shape)), t.dtype, t.location) for n, t in tensors.items()}
    return InspectReport(
        path=cf.path,
        format=cf.format,
        file_size=cf.file_size,
        state_dict_key=None if key_path is None else list(key_path),
        tensor_count=len(tensors),
        parameter_count=sum(t.numel for t in tensors.values()),
        unique_parameter_count=sum(t.numel for t in distinct),
        total_bytes=sum(t.nbytes for t in tensors.values()),
        unique_bytes=sum(st.nbytes or 0 for st in sd_storages.values())
        + sum(t.nbytes for t in distinct if t.storage is None),
        storage_bytes=sum(st.nbytes or 0 for st in cf.storages.values()),
        dtypes=dict(sorted(collections.Counter(t.dtype for t in tensors.values()).items())),
        locations=dict(sorted(locations.items())),
        prefixes=_prefix_counts(list(map(str, sd.keys())), own),
        shared=shared,
        non_tensor_entries=_non_tensor_entries(cf, key_path, sd),
        globals=gl,
        stubbed_globals=sorted(cf.stubbed),
        weights_only_ok=wo_ok,
        weights_only_reason=why,
        notes=_notes(cf, locations, holder, key_path)
        + _own_notes(list(map(str, sd.keys())), own)
        + _partitioned(cf, sd, tensors)
        + subclass_notes(tensors)
        + (layout_notes(cf.details.metadata) if isinstance(cf.details, SafetensorsDetails) else []),
        dcp=cf.details.summary if isinstance(cf.details, DcpDetails) else None,
        framework=identify_object(cf.obj),
        tensors=_rows(list(tensors), info, shared, tensor_filter),
        tensor_filter=tensor_filter,
        dtensor_shards=_dtensor_shards(cf, sd),
    )


def _dtensor_shards(cf: CheckpointFile, sd: Mapping[str, Any]) -> dict[str, Any] | None:
    """One rank's DTensor shards (an FSDP per-rank file): how many, of which rank of how many."""
    from ckptfix.formats.dtensor_ranks import dtensor_shards

    got = dtensor_shards(sd) if sd else None
    if got is None:
        return None
    n, rank, world = got
    return {"shards": n, "rank": rank, "world": world}


def _locate(cf: CheckpointFile, key: str | None) -> tuple[tuple[str, ...] | None, Mapping[str, Any], str]:
    """(key path, state dict, holder) as :func:`ckptfix.ops.convert.locate_state_dict`; key path None
    (and an empty state dict) for a valid torch file without tensors."""
    from ckptfix.formats.statedict import contains_tensors, locate_state_dict

    obj = cf.state_root
    if key is None and cf.format not in (Format.SAFETENSORS, Format.SHARDED, Format.DCP) and not contains_tensors(obj):
        return None, {}, "mapping"
    return locate_state_dict(obj, key)


def _own_notes(keys: list[str], own: Mapping[str, str]) -> list[str]:
    """Say which leading prefix is the model's own (config.json), so no one strips it."""
    out = []
    for p, whose in own.items():
        n = sum(1 for k in keys if k.startswith(p))
        if n:
            out.append(
                f"{p!r} on {n} of {len(keys)} keys is {whose}'s own base-model prefix (config.json beside the "
                "file), not a wrapper: strip-prefix and convert --strip-prefix leave it"
            )
    return out


def _distinct(tensors: Mapping[str, Any]) -> list[Any]:
    """The distinct tensors: names that share storage, offset, shape, stride and dtype count once."""
    distinct: dict[tuple, Any] = {}
    for t in tensors.values():
        st = t.storage
        distinct.setdefault(
            (id(st), t.offset, tuple(t.shape), tuple(t.stride), t.dtype) if st is not None else (id(t),), t
        )
    return list(distinct.values())


def _shared(tensors: Mapping[str, Any]) -> list[list[str]]:
    """Groups of names whose tensors use one storage (tied weights, views)."""
    by_storage: dict[int, list[str]] = collections.defaultdict(list)
    for name, t in tensors.items():
        if t.storage is not None:
            by_storage[id(t.storage)].append(name)
    return [names for names in by_storage.values() if len(names) > 1]


def _non_tensor_entries(cf: CheckpointFile, key_path: tuple[str, ...] | None, sd: Mapping[str, Any]) -> dict[str, str]:
    """What the checkpoint holds besides tensors, each described in a few words."""
    obj = cf.state_root
    non_tensor: dict[str, str] = {}
    if key_path is None:  # no tensors at all: the entries themselves
        top = obj.state if isinstance(obj, Stub) and isinstance(obj.state, dict) else obj
        if isinstance(top, Stub) and top.dictitems:
            top = top.dictitems
        if isinstance(top, dict):
            for k, v in top.items():
                non_tensor[str(k)] = _describe(v)
        else:
            non_tensor["(top level)"] = _describe(obj)
        if isinstance(obj, Stub):
            non_tensor = {"(top level)": _describe(obj), **non_tensor}
    elif key_path and hasattr(cf.obj, "items") and not isinstance(cf.obj, type):
        for k, v in cf.obj.items():
            if k != key_path[0]:
                non_tensor[str(k)] = _describe(v)
    for k, v in sd.items():
        if not is_tensor_like(v):
            non_tensor[f"{'/'.join(key_path) + '/' if key_path else ''}{k}"] = _describe(v)
    return non_tensor


def _weights_only(cf: CheckpointFile, bad: list[str]) -> tuple[bool, str]:
    """Whether ``torch.load(weights_only=True)`` reads the file, and why; ``bad``: globals it refuses."""
    if cf.format == Format.SAFETENSORS:
        other = scan_unsafe(cf.input)
        if other:  # a polyglot: torch.load unpickles the same bytes (and runs what they name)
            return False, (
                f"the file is also a pickle torch.load would unpickle, naming {', '.join(other[:3])}: read it only "
                "with safetensors (safetensors.torch.load_file) or `ckptfix convert` it"
            )
        return True, "safetensors holds no pickle"
    if cf.format == Format.TORCHSCRIPT:
        return False, (
            "a TorchScript archive: torch.load refuses weights_only=True for it (it hands the archive to "
            "torch.jit.load, which runs its code); load it with torch.jit.load only if you trust it"
        )
    if cf.format == Format.DCP:
        return False, "a DCP directory is not a torch.load file (use load_anywhere or dcp.load)"
    if bad:
        return False, f"globals not allowed by weights_only: {', '.join(bad[:5])}" + (" ..." if len(bad) > 5 else "")
    if cf.format in (Format.TORCH_ZIP, Format.TORCH_LEGACY) and (
        ops := opcodes_weights_only_cannot_read(cf.path, cf.format)
    ):
        return False, (
            f"the pickle uses opcodes torch's weights-only unpickler cannot read ({', '.join(ops)}: "
            "pickle protocol 3 or newer, or the text opcodes Python 2 wrote); `ckptfix sanitize` rewrites it"
        )
    other = [g for g in scan_unsafe(cf.input) if g not in bad]
    if other:  # another pickle of the file (a legacy stream's magic/protocol/sys-info/keys) or another reading
        return False, (
            f"the file's other pickles name globals weights_only refuses: {', '.join(other[:5])}"
            + (" ..." if len(other) > 5 else "")
            + " (`ckptfix scan` lists them; `ckptfix sanitize` writes the checkpoint without them)"
        )
    packages = sorted({p for g in cf.globals_seen if (p := needs_package(g))})
    if packages:
        return True, (
            "only globals torch's weights-only unpickler allows, once "
            + " and ".join(f"`import {p}`" for p in packages)
            + " has registered its tensor classes (without it torch.load refuses them)"
        )
    return True, "only globals torch's weights-only unpickler allows"


def _partitioned(cf: CheckpointFile, sd: Mapping[str, Any], tensors: Mapping[str, Any]) -> list[str]:
    """A warning when the tensors are empty placeholders of a partitioned (ZeRO-3) checkpoint."""
    from ckptfix.pickles.placeholders import describe, empty_placeholders

    found = empty_placeholders(cf.obj, sd)
    return [f"WARNING: {describe(cf.path, found, len(tensors))}"] if found else []


def _notes(
    cf: CheckpointFile, locations: Mapping[str, int], holder: str, key_path: tuple[str, ...] | None
) -> list[str]:
    """The reader's notes, then what a user should know before loading the file."""
    notes = list(cf.notes)
    cuda = [loc for loc in locations if loc.startswith("cuda")]
    if cuda:
        notes.append(
            f"storages are tagged {', '.join(sorted(cuda))}: plain torch.load fails without those GPUs; "
            "load_anywhere / --map-location remaps them"
        )
    if cf.format == Format.TORCH_LEGACY:
        notes.append("legacy (pre-1.6) format: cannot be memory-mapped; strip-prefix/convert rewrite it as zip")
    if holder == "module":
        notes.append(
            "a whole pickled nn.Module (torch.save(model)): the state dict is its state_dict(); loading "
            "the module itself runs its class's code (load_anywhere gives the state dict)"
        )
    elif holder == "modules":
        from ckptfix.formats.modules import describe, find_modules, follow

        hit = follow(cf.state_root, "/".join(key_path)) if key_path else ((), cf.state_root)
        mods = find_modules(hit[1], top=False) if hit is not None else []
        notes.append(
            f"an object holding {len(mods)} nn.Module(s), each one's state_dict() under its attribute path: "
            f"{describe(mods)}; loading the object itself runs its classes' code (load_anywhere gives the state dict)"
        )
    elif holder == "optimizer":
        opt = optimizer_summary(cf.obj) or {}
        notes.append(
            f"an optimizer state ({opt.get('param_groups', '?')} param group(s), {opt.get('state_tensors', '?')} "
            "state tensors), not model weights: load_checkpoint(...).checkpoint is what optimizer.load_state_dict "
            "takes; convert --include-optimizer writes its tensors"
        )
    elif holder == "tensor":
        notes.append(
            'one bare tensor (torch.save(tensor)), not a state dict: named "tensor" (convert writes that name)'
        )
    elif holder == "sequence":
        notes.append('a list/tuple holding tensors, not a state dict: each named by its position ("0", "1.2" ...)')
    if key_path is None:
        notes.append(
            "no tensors in this file (e.g. training arguments or a scheduler state); load it with "
            "load_checkpoint(...).checkpoint, or make it weights_only-loadable with ckptfix sanitize"
        )
    return notes


# --------------------------------------------------------------------------- framework folders


def inspect_folder(
    r: Resolved, key: str | None = None, tensor_filter: str | None = None, component: str | None = None
) -> InspectReport:
    """``inspect`` of a framework folder: the weights' report, with ``framework`` (layout, every other file) and
    ``folder_scan`` (every pickle-bearing file's verdict: ``weights_only_ok`` only when every one is safe)."""
    from ckptfix.formats.pipelines import is_multi

    if is_multi(r):  # a diffusers pipeline, a sentence-transformers model: every component (or one)
        from ckptfix.ops.pipelines import inspect_pipeline

        return _with_folder_scan(inspect_pipeline(r, key, tensor_filter, component), r)
    if component is not None:
        from ckptfix.ops.pipelines import refuse_component

        refuse_component(r.path, r)
    rep = _inspect_folder_weights(r, key, tensor_filter)
    return _with_folder_scan(rep, r)


def _with_folder_scan(rep: InspectReport, r: Resolved) -> InspectReport:
    """The folder's verdict is every file's: a file that runs code (or that weights_only refuses) makes
    ``weights_only_ok`` false, named in the reason and in ``folder_scan``."""
    from ckptfix.ops.scan import _scan_folder
    from ckptfix.pickles import PickleLimits

    if rep.format == Format.DCP and not r.files:
        return rep  # a DCP directory and nothing else: one checkpoint (as at a URL, where inspect reads metadata only)
    sc = _scan_folder(r, PickleLimits.from_env())
    return _apply_scan(rep, sc, os.path.relpath(r.weights, r.path) if r.weights else None)


def _apply_scan(rep: InspectReport, sc: ScanReport, weights: str | None) -> InspectReport:
    """``folder_scan`` from a folder's scan; ``weights_only_ok`` false when a file other than ``weights`` is not
    safe (named in the reason)."""
    rep.folder_scan = {"verdict": sc.verdict, "files": sc.files}
    bad = {n: f for n, f in sc.files.items() if f["verdict"] != "safe" and n != weights}
    if bad:
        named = "; ".join(
            f"{n} ({f['verdict']}"
            + (f": {', '.join((f['dangerous'] + f['unknown'])[:3])}" if f["dangerous"] or f["unknown"] else "")
            + ")"
            for n, f in list(bad.items())[:5]
        ) + (" ..." if len(bad) > 5 else "")
        runs = any(f["verdict"] == "dangerous" for f in bad.values())
        lead = "runs code when unpickled" if runs else "is not weights_only-loadable"
        was = "the weights load with weights_only=True, but" if rep.weights_only_ok else rep.weights_only_reason + ";"
        rep.weights_only_ok = False
        rep.weights_only_reason = (
            f"{was} {len(bad)} other file(s) in the folder are not safe ({lead} for at least one): {named} "
            "(`ckptfix scan` lists every global)"
        )
    return rep


def _inspect_folder_weights(r: Resolved, key: str | None = None, tensor_filter: str | None = None) -> InspectReport:
    handler = r.layout.inspect
    if handler is not None:
        rep: InspectReport = handler(r, key)
        rep.tensors = [t for t in rep.tensors if tensor_name_matches(t["name"], tensor_filter)]
        rep.tensor_filter = tensor_filter
        return rep
    if r.layout.consolidated:
        return _inspect_consolidated(r, key, tensor_filter)
    if r.weights is None and r.layout.name == "torchtune-recipe-state":
        return _inspect_training_state(r)
    from ckptfix.formats.layouts import check_inside

    weights = check_inside(r, r.require_weights())  # as convert and load: a link out of the folder is not read
    rep = inspect_file(weights, key, tensor_filter)
    describe_files(r)
    rep.framework = r.to_dict()
    meta = next((f for f in r.files if f.role == "meta"), None)
    if meta is not None and meta.details:
        rep.framework["lightning_meta"] = meta.details
    adapter = next((f for f in r.files if f.role == "adapter"), None)
    if adapter is not None and adapter.details:  # peft: base model, r, lora_alpha, target modules, task type
        rep.framework["adapter"] = adapter.details
    return rep


def _inspect_training_state(r: Resolved) -> InspectReport:
    """inspect of a folder of training state only (torchtune's recipe_state/): no tensors of a model, its files."""
    describe_files(r)
    epochs = r.extra.get("epochs") or []
    return InspectReport(
        path=r.path,
        format=Format.TORCH_ZIP,
        file_size=sum(f.bytes for f in r.files),
        state_dict_key=None,
        tensor_count=0,
        parameter_count=0,
        unique_parameter_count=0,
        total_bytes=0,
        unique_bytes=0,
        storage_bytes=0,
        dtypes={},
        locations={},
        prefixes={},
        shared=[],
        non_tensor_entries={},
        globals={},
        stubbed_globals=[],
        weights_only_ok=True,
        weights_only_reason="training state only (the folder's files are scanned below)",
        notes=[
            f"{r.layout.framework}: the training state of an intermediate checkpoint; the model is in "
            + (f"{epochs[-1]}/ beside this folder" if epochs else "the epoch_N/ folder beside it")
        ],
        framework=r.to_dict(),
    )


def _inspect_consolidated(r: Resolved, key: str | None = None, tensor_filter: str | None = None) -> InspectReport:
    """inspect of a ZeRO / HF-writer folder: the consolidated state dict's records (nothing unpickled twice)."""
    from collections import Counter

    from ckptfix.errors import UnsupportedError
    from ckptfix.formats.base import Format

    if key is not None:
        raise UnsupportedError(f"{r.path}: --key does not apply to a {r.layout.framework} folder (one model in it)")
    c = r.extra["checkpoint"]
    if r.layout.name == "deepspeed-zero":
        from ckptfix.formats.deepspeed import describe as zero_lines
        from ckptfix.formats.deepspeed import read_zero_checkpoint

        read_zero_checkpoint(c)
        lines = zero_lines(c)
        recs = [(t.name, t.out_dtype(None), t.numel, t.numel * _elsize(t.out_dtype(None))) for t in c.tensors]
        shapes = {t.name: list(t.shape) for t in c.tensors}
        aliases = c.aliases()
        files = c.model_files + c.optim_files
        fmt = Format.TORCH_ZIP
    else:
        from ckptfix.formats.safetensors_fmt import ST_TO_DTYPE

        if r.layout.name == "fsdp-dtensor-ranks":
            from ckptfix.formats.dtensor_ranks import describe as dt_lines

            lines = dt_lines(c)
            fmt = Format.TORCH_ZIP
        else:
            from ckptfix.formats.hfstorage import describe as hf_lines
            from ckptfix.formats.hfstorage import read_hf_storage

            read_hf_storage(c)
            lines = hf_lines(c)
            fmt = Format.SAFETENSORS
        recs = [(t.name, ST_TO_DTYPE[t.st_dtype], t.nbytes // t.element_size, t.nbytes) for t in c.tensors]
        shapes = {t.name: list(t.shape) for t in c.tensors}
        aliases, files = {}, c.files
    by_name = {n: (d, v, b) for n, d, v, b in recs}
    names = [n for n, *_ in recs] + [a for a in aliases if a not in by_name]
    full = [by_name[aliases.get(n, n)] for n in names]
    shared = [[t, *sorted(a for a, x in aliases.items() if x == t)] for t in dict.fromkeys(aliases.values())]
    # the consolidated state dict is built on the CPU (zero_to_fp32, the HF readers): no saved device tag
    info = {n: (shapes[aliases.get(n, n)], by_name[aliases.get(n, n)][0], None) for n in names}
    describe_files(r)
    fw = r.to_dict()
    relabel = {"framework": "layout", "weights": "model"}  # the generic lines already say framework/weights
    fw["details"] = [[relabel.get(label, label), text] for label, text in lines]
    return InspectReport(
        path=r.path,
        format=fmt,
        file_size=sum(pins.fstat(f).st_size for f in files),
        state_dict_key=[],
        tensor_count=len(names),
        parameter_count=sum(v for _, v, _ in full),
        unique_parameter_count=sum(v for _, v, _ in by_name.values()),
        total_bytes=sum(b for *_, b in full),
        unique_bytes=sum(b for *_, b in by_name.values()),
        storage_bytes=sum(b for *_, b in by_name.values()),
        dtypes=dict(Counter(d for d, _, _ in full)),
        locations={},
        prefixes=_prefix_counts(names),
        shared=shared,
        non_tensor_entries={},
        globals={},
        stubbed_globals=[],
        # DeepSpeed pickles its own classes (ZeroStageEnum, LossScaler) beside the tensors: torch's weights-only
        # unpickler refuses its files, ckptfix reads the tensors without unpickling; scan lists every global
        weights_only_ok=fmt == Format.SAFETENSORS,
        weights_only_reason=(
            f"safetensors shards ({len(files)} file(s)): no pickle"
            if fmt == Format.SAFETENSORS
            else f"its {len(files)} files pickle DTensor and DeviceMesh classes torch.load(weights_only=True) refuses "
            "(torch.serialization.add_safe_globals lifts it); ckptfix reads the shards without unpickling"
            if r.layout.name == "fsdp-dtensor-ranks"
            else f"its {len(files)} files pickle DeepSpeed classes torch.load(weights_only=True) refuses; ckptfix "
            "reads the tensors without unpickling (`ckptfix scan` lists every global)"
        ),
        notes=[f"{r.layout.framework}: `ckptfix convert {r.path} -o model.safetensors` writes this state dict"],
        framework=fw,
        tensors=_rows(names, info, shared, tensor_filter),
        tensor_filter=tensor_filter,
    )


def _elsize(dtype: str) -> int:
    from ckptfix.pickles import ELEMENT_SIZE

    return ELEMENT_SIZE[dtype]


__all__ = [
    "INSPECT_SCHEMA",
    "SCAN_SCHEMA",
    "InspectReport",
    "ScanReport",
    "inspect_checkpoint",
    "inspect_file",
    "inspect_folder",
    "scan_checkpoint",
    "scan_unsafe",
    "tensor_name_matches",
]
