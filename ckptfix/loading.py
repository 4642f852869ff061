"""``load_anywhere``: load a state dict from any checkpoint on any machine, safely.

>>> from ckptfix import load_anywhere                      # doctest: +SKIP
>>> model.load_state_dict(load_anywhere("ddp_on_cuda7.pth"))  # doctest: +SKIP

The loader never runs code from the checkpoint unless told to: globals that
``torch.load(weights_only=True)`` allows are rebuilt, everything else becomes
an inert placeholder (see :mod:`ckptfix.pickles`), ``allow_globals`` rebuilds
exactly the named ones, and ``trust=True`` does a full unpickle.  Storage
location tags (``cuda:7``) are remapped to devices that exist here.
"""

from __future__ import annotations

import collections
import importlib
import io
import os
import pickle
import types
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

from ckptfix import stmeta
from ckptfix._torch import require_torch
from ckptfix.errors import CkptfixError, CorruptCheckpointError, UnsafePickleError, UnsupportedError
from ckptfix.formats import read_checkpoint, sniff
from ckptfix.pickles import Stub, stub_class
from ckptfix.policy import classify_global

MapLocation = Any  # str | torch.device | dict | callable | None | "auto"


@dataclass
class LoadedCheckpoint:
    """Everything :func:`load_checkpoint` found.

    Attributes:
        state_dict: name -> tensor, ready for ``model.load_state_dict`` (``_metadata`` kept).
        checkpoint: the whole object (e.g. the wrapper dict with ``epoch`` and optimizer state).
        format: container format (``torch-zip``, ``torch-legacy``, ``safetensors``, ``sharded``,
            ``torchscript``, ``dcp``, ``pickle``).
        key_path: where the state dict sat inside ``checkpoint`` (``()`` = top level).
        stubbed_globals: globals replaced by inert placeholders.
        locations: storage location tag -> number of storages (e.g. ``{"cuda:7": 12}``).
        remapped: location tag -> the device it was loaded on, where that differs.
        alignment: the alignment report when ``model=`` was given.
    """

    path: str
    state_dict: dict
    checkpoint: Any
    format: str
    key_path: tuple[str, ...] = ()
    stubbed_globals: list[str] = field(default_factory=list)
    locations: dict[str, int] = field(default_factory=dict)
    remapped: dict[str, str] = field(default_factory=dict)
    alignment: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, key: str) -> Any:
        return self.checkpoint[key]

    def get(self, key: str, default: Any = None) -> Any:
        try:
            return self.checkpoint[key]
        except (KeyError, TypeError, IndexError):
            return default


# --------------------------------------------------------------------------- safety


def _real_global(module: str, name: str) -> Any:
    mod = importlib.import_module(module)
    obj: Any = mod
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def _normalise_allow(allow_globals: Iterable[Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for g in allow_globals or ():
        if isinstance(g, str):
            out[g] = None
        else:  # a class/function object
            out[f"{g.__module__}.{g.__qualname__}"] = g
    return out


def restricted_pickle_module(allow_globals: Iterable[Any] = (), stubbed: set[str] | None = None) -> types.ModuleType:
    """A pickle-module stand-in for ``torch.load(pickle_module=...)`` that never runs unknown globals.

    torch-allowed globals are rebuilt, ``allow_globals`` entries are imported and
    rebuilt, every other global becomes a placeholder (recorded in ``stubbed``).
    """
    allowed = _normalise_allow(allow_globals)
    record = stubbed if stubbed is not None else set()

    class RestrictedUnpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            if module == "__builtin__":
                module = "builtins"
            full = f"{module}.{name}"
            if full in allowed:
                obj = allowed[full]
                if obj is None:
                    try:
                        obj = _real_global(module, name)
                    except (ImportError, AttributeError) as e:
                        raise UnsafePickleError(
                            f"--allow-global {full}: cannot import it here ({e}); install the package that defines it"
                        ) from None
                return obj
            if classify_global(full) == "safe":
                return _real_global(module, name)
            record.add(full)
            return stub_class(module, name)

    mod = types.ModuleType("ckptfix_restricted_pickle")
    mod.Unpickler = RestrictedUnpickler  # type: ignore[attr-defined]

    def load(file: Any, **kw: Any) -> Any:
        kw.pop("encoding", None)
        return RestrictedUnpickler(file, encoding="utf-8").load()

    def loads(data: bytes, **kw: Any) -> Any:
        return load(io.BytesIO(data))

    mod.load = load  # type: ignore[attr-defined]
    mod.loads = loads  # type: ignore[attr-defined]
    mod.__name__ = "pickle"  # torch only checks for the standard interface
    return mod


# --------------------------------------------------------------------------- devices


def auto_device() -> str:
    """This process's device: ``cuda:$LOCAL_RANK`` under torchrun, else ``cuda:0``, else ``cpu``."""
    import torch

    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        lr = os.environ.get("LOCAL_RANK")
        if lr is not None and lr.isdigit() and int(lr) < n:
            return f"cuda:{int(lr)}"
        return "cuda:0"
    return "cpu"


def _available(dev: str) -> str | None:
    """The device to use for tag ``dev``: itself if it exists here, else a fallback (cuda:0 or cpu)."""
    import torch

    if dev.startswith("cuda"):
        if not torch.cuda.is_available():
            return "cpu"
        idx = int(dev.split(":", 1)[1]) if ":" in dev else 0
        return dev if idx < torch.cuda.device_count() else "cuda:0"
    if dev in ("cpu", "meta") or dev.startswith("cpu"):
        return dev
    if dev.startswith("mps"):
        mps = getattr(torch.backends, "mps", None)
        return dev if mps is not None and mps.is_available() else "cpu"
    try:
        torch.device(dev)
        return dev
    except RuntimeError:
        return "cpu"


def make_restore(map_location: MapLocation, tags: collections.Counter, remapped: dict[str, str]) -> Callable:
    """A ``map_location`` callable that records every tag and never targets a device that is not here."""
    import torch
    from torch.serialization import default_restore_location

    if isinstance(map_location, str) and map_location == "auto":
        map_location = auto_device()
    if isinstance(map_location, torch.device):
        map_location = str(map_location)
    if isinstance(map_location, str):
        target = map_location
        if target.startswith("cuda") and not torch.cuda.is_available():
            raise UnsupportedError(
                f"map_location={map_location!r} but CUDA is not available here; "
                "use map_location='cpu' (--map-location cpu) or 'auto'"
            )

    def restore(storage: Any, location: str) -> Any:
        tags[location] += 1
        if callable(map_location) and not isinstance(map_location, (str, dict)):
            r = map_location(storage, location)
            if r is not None:
                return r
            dest = location
        elif isinstance(map_location, dict):
            dest = map_location.get(location, location)
            dest = str(dest) if not isinstance(dest, str) else dest
        elif map_location is None:
            dest = location
        else:
            dest = target
        fixed = _available(dest) or "cpu"
        if fixed != location:
            remapped[location] = fixed
        return default_restore_location(storage, fixed)

    return restore


# --------------------------------------------------------------------------- loaders


def _torch_load(
    path: str, restore: Callable, *, mmap: bool, allow_globals: Iterable[Any], trust: bool, stubbed: set[str]
) -> Any:
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if trust:
            return torch.load(path, map_location=restore, mmap=mmap, weights_only=False)
        mod = restricted_pickle_module(allow_globals, stubbed)
        return torch.load(path, map_location=restore, mmap=mmap, weights_only=False, pickle_module=mod)


def _materialize(records: Mapping[str, Any], device: str, path: str) -> dict:
    """Turn TensorRecords (byte ranges of ``path``) into torch tensors, one copied buffer per storage."""
    import mmap as _mmap

    import torch

    out: dict[str, Any] = {}
    with open(path, "rb") as f:
        mm = _mmap.mmap(f.fileno(), 0, access=_mmap.ACCESS_COPY)
    whole = torch.frombuffer(mm, dtype=torch.uint8) if len(mm) else torch.empty(0, dtype=torch.uint8)
    bases: dict[int, Any] = {}
    for name, rec in records.items():
        st = rec.storage
        if rec.kind != "dense" or st is None or st.file_offset is None:
            raise UnsupportedError(f"{path}: tensor {name!r} ({rec.kind}) cannot be materialised; use --trust")
        dtype = getattr(torch, rec.dtype)
        base = bases.get(id(st))
        if base is None:
            # each storage gets its own memory (saving one tensor must not write the whole archive)
            base = whole[st.file_offset : st.file_offset + st.nbytes].clone().view(dtype)
            bases[id(st)] = base
        try:
            t = base.as_strided(rec.shape, rec.stride, rec.offset)
        except RuntimeError as e:
            raise CorruptCheckpointError(
                f"{path}: tensor {name!r} does not fit its storage ({e}); the file is corrupt"
            ) from None
        if device != "cpu":
            t = t.to(device)
        out[name] = t
    return out


def _load_dcp(path: str, allow_globals: Iterable[Any], stubbed: set[str], trust: bool, device: str) -> dict:
    """A DCP directory through ckptfix's own reader (:mod:`ckptfix.dcp`), never torch's unrestricted one."""
    from ckptfix.dcp.assemble import load_dcp

    try:
        pmod = None if trust else restricted_pickle_module(allow_globals, stubbed)
        return load_dcp(path, device=device, pickle_module=pmod)
    except CkptfixError:
        raise
    except OSError as e:
        raise CorruptCheckpointError(f"{path}: cannot read the DCP directory ({e})") from None


def _simple_target(map_location: MapLocation) -> str:
    """The one device a whole-file loader (safetensors, DCP, TorchScript) should use."""
    import torch

    if map_location is None:
        return "cpu"
    if isinstance(map_location, str) and map_location == "auto":
        return auto_device()
    if isinstance(map_location, (str, torch.device)):
        dev = str(map_location)
        if dev.startswith("cuda") and not torch.cuda.is_available():
            raise UnsupportedError(f"map_location={dev!r} but CUDA is not available here; use 'cpu' or 'auto'")
        return _available(dev) or "cpu"
    if isinstance(map_location, dict):
        return _available(str(map_location.get("cpu", "cpu"))) or "cpu"
    return "cpu"


def load_checkpoint(
    path: str | os.PathLike,
    map_location: MapLocation = "cpu",
    *,
    key: str | None = None,
    model: Any = None,
    allow_globals: Iterable[Any] = (),
    trust: bool = False,
    mmap: bool | None = None,
) -> LoadedCheckpoint:
    """Load a whole checkpoint and find its state dict.

    Args:
        path: a file or directory in any supported format (detected by content).
        map_location: as for ``torch.load`` (str, device, dict, callable), plus ``"auto"``
            (``cuda:$LOCAL_RANK`` / ``cuda:0`` / ``cpu``) and ``None`` (keep the saved devices where they
            exist here).  Storages tagged for a device this machine lacks are loaded on ``cuda:0``, or on
            the CPU when there is no GPU.
        key: where the state dict sits (``"model"``, ``"model/state_dict"``); found automatically otherwise.
        model: an ``nn.Module``; keys are aligned to it (wrapper prefixes stripped/added) and
            ``alignment`` reports missing / unexpected / shape-mismatched keys.
        allow_globals: ``"module.Name"`` strings (or the objects) to rebuild for real instead of stubbing.
        trust: full unpickle (runs code from the file!). Only for files you made.
        mmap: memory-map zip-format files (default True for them).

    Returns:
        LoadedCheckpoint.  For a valid file that holds no tensors at all (``training_args.bin``, an LR
        scheduler's state) ``state_dict`` is empty and ``checkpoint`` is the object (non-allowlisted
        classes such as ``TrainingArguments`` as placeholders unless ``allow_globals``/``trust``).

    Raises:
        CheckpointNotFoundError, CorruptCheckpointError, UnsafePickleError, UnsupportedError.
    """
    torch = require_torch("load_anywhere (loading tensors)")

    path = os.fspath(path)
    kind = sniff(path)
    tags: collections.Counter = collections.Counter()
    remapped: dict[str, str] = {}
    stubbed: set[str] = set()
    metadata: dict[str, Any] = {}
    fmt = kind
    if trust:
        warnings.warn(f"ckptfix: trust=True: unpickling {path} runs any code it contains", stacklevel=2)
    if kind == "torch-tar":
        if not trust:
            from ckptfix.formats import tar_message

            raise UnsupportedError(tar_message(path))
        obj = _torch_load(
            path, make_restore(map_location, tags, remapped), mmap=False, allow_globals=(), trust=True, stubbed=stubbed
        )
    elif kind in ("torch-zip", "pickle-stream"):
        restore = make_restore(map_location, tags, remapped)
        if kind == "torch-zip":
            read_checkpoint(path)  # names, record sizes and limits checked before torch maps anything
        if kind == "pickle-stream":
            cf_kind = read_checkpoint(path).format  # torch-legacy or a bare pickle
            fmt = cf_kind
        use_mmap = (mmap if mmap is not None else True) and kind == "torch-zip"
        if fmt == "pickle":
            with open(path, "rb") as f:
                if trust:
                    obj = pickle.load(f)  # noqa: S301 - explicitly trusted
                else:
                    obj = restricted_pickle_module(allow_globals, stubbed).load(f)
        else:
            try:
                obj = _torch_load(
                    path, restore, mmap=use_mmap, allow_globals=allow_globals, trust=trust, stubbed=stubbed
                )
            except CkptfixError:
                raise
            except Exception as e:
                raise CorruptCheckpointError(
                    f"{path}: torch could not load it ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
                ) from e
    elif kind == "safetensors":
        from safetensors import safe_open
        from safetensors.torch import load_file

        dev = _simple_target(map_location)
        read_checkpoint(path)  # the header's limits and checks, as in every other command
        try:
            with safe_open(path, framework="pt") as f:
                metadata = dict(f.metadata() or {})
            obj = load_file(path, device=dev)
        except Exception as e:
            raise CorruptCheckpointError(f"{path}: safetensors could not read it ({e})") from e
        obj = stmeta.restore(obj, metadata)
        tags["cpu"] = len(obj)
        fmt = "safetensors"
    elif kind in ("sharded", "sharded-dir"):
        from ckptfix.formats.sharded import load_index

        read_checkpoint(path)  # validates the index, every shard's name and contents
        idx = load_index(path)
        wm = idx.weight_map
        merged: dict = collections.OrderedDict()
        for shard, shard_path in idx.shards.items():
            sub = load_checkpoint(shard_path, map_location, allow_globals=allow_globals, trust=trust, mmap=mmap)
            tags.update(sub.locations)
            remapped.update(sub.remapped)
            stubbed.update(sub.stubbed_globals)
            metadata.update(sub.metadata)
            for name, s in wm.items():
                if s == shard:
                    merged[name] = sub.state_dict[name]
        obj = stmeta.restore(merged, metadata)
        fmt = "sharded"
    elif kind == "torchscript":
        cf = read_checkpoint(path)
        recs = cf.extra.get("torchscript_state_dict") or {}
        if trust:
            obj = torch.jit.load(path, map_location=_simple_target(map_location)).state_dict()
        else:
            obj = collections.OrderedDict(_materialize(recs, _simple_target(map_location), path))
        for st in cf.storages.values():
            tags[st.location] += 1
        fmt = "torchscript"
    elif kind == "dcp":
        obj = _load_dcp(path, allow_globals, stubbed, trust, _simple_target(map_location))
        tags["cpu"] += 1
        fmt = "dcp"
    else:  # pragma: no cover - sniff raises for everything else
        raise CorruptCheckpointError(f"{path}: unsupported format {kind}")

    from ckptfix.statedict import contains_tensors, locate_state_dict

    if key is None and not contains_tensors(obj):
        # a valid file without tensors (training_args.bin, a scheduler state): the object, no state dict
        return LoadedCheckpoint(
            path=path,
            state_dict=collections.OrderedDict(),
            checkpoint=obj,
            format=fmt,
            key_path=(),
            stubbed_globals=sorted(stubbed),
            locations=dict(tags),
            remapped=remapped,
            metadata=metadata,
        )
    key_path, sd, _ = locate_state_dict(obj, key)
    if not isinstance(sd, dict):
        sd = collections.OrderedDict(sd.items())
    alignment = None
    if model is not None:
        from ckptfix.prefixes import align_state_dict

        sd, alignment = align_state_dict(sd, model)
    return LoadedCheckpoint(
        path=path,
        state_dict=sd,
        checkpoint=obj,
        format=fmt,
        key_path=tuple(key_path),
        stubbed_globals=sorted(stubbed),
        locations=dict(tags),
        remapped=remapped,
        alignment=alignment,
        metadata=metadata,
    )


def load_anywhere(
    path: str | os.PathLike,
    map_location: MapLocation = "cpu",
    *,
    key: str | None = None,
    model: Any = None,
    allow_globals: Iterable[Any] = (),
    trust: bool = False,
    mmap: bool | None = None,
) -> dict:
    """Load the state dict from any checkpoint, on any machine. A drop-in for ``torch.load`` in scripts.

    Returns the state dict itself (``dict`` name -> ``torch.Tensor``, ``_metadata`` kept), ready for
    ``model.load_state_dict``.  Use :func:`load_checkpoint` for the rest of the checkpoint and for how
    it was found.  Arguments are those of :func:`load_checkpoint`.

    Example:
        >>> sd = load_anywhere("ddp_cuda7.pth", model=model)   # doctest: +SKIP
        >>> model.load_state_dict(sd)                          # doctest: +SKIP

    Raises:
        NoTensorsError: the file is valid but holds no tensors (``training_args.bin``, a scheduler state);
            :func:`load_checkpoint` returns such a file's object (``.checkpoint``) with an empty state dict.
        CheckpointNotFoundError, CorruptCheckpointError, UnsafePickleError, UnsupportedError: as
            :func:`load_checkpoint`.
    """
    lc = load_checkpoint(path, map_location, key=key, model=model, allow_globals=allow_globals, trust=trust, mmap=mmap)
    if not lc.state_dict and key is None:
        from ckptfix.errors import NoTensorsError

        raise NoTensorsError(
            f"{os.fspath(path)}: a valid {lc.format} file with no tensors in it (arguments, "
            "scheduler or other state), so there is no state dict to load; use "
            "load_checkpoint(path).checkpoint for the object itself"
        )
    return lc.state_dict


def is_stub(obj: Any) -> bool:
    """True for the inert placeholders that stand for globals that were not rebuilt."""
    return isinstance(obj, Stub)
