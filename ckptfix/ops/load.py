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
import dataclasses
import importlib
import io
import os
import pickle
import types
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, cast

from ckptfix._torch import require_torch
from ckptfix.errors import CkptfixError, CorruptCheckpointError, UnsafePickleError, UnsupportedError
from ckptfix.files import pins
from ckptfix.files.source import in_session
from ckptfix.formats import Format, Input, ShardedDetails, classify, read_checkpoint, stmeta, tar_message
from ckptfix.formats.dcp.assemble import load_dcp
from ckptfix.formats.deepspeed import find_zero_checkpoint, zero_state_dict
from ckptfix.formats.hfstorage import find_hf_storage, hf_storage_state_dict, refuse_single_shard
from ckptfix.formats.layouts import Resolved, check_inside, resolve
from ckptfix.formats.registry import dispatch
from ckptfix.pickles import Stub, stub_class
from ckptfix.pickles.policy import PACKAGES, classify_global, needs_package

MapLocation = Any  # str | torch.device | dict | callable | None | "auto"


@dataclass
class LoadedCheckpoint:
    """Everything :func:`load_checkpoint` found.

    Attributes:
        state_dict: name -> tensor, ready for ``model.load_state_dict`` (``_metadata`` kept).
        checkpoint: the whole object (e.g. the wrapper dict with ``epoch`` and optimizer state).
        format: container format (a :class:`~ckptfix.formats.Format`: ``torch-zip``, ``torch-legacy``,
            ``safetensors``, ``sharded``, ``torchscript``, ``dcp``, ``pickle``, ``torch-tar``).
        key_path: where the state dict sat inside ``checkpoint`` (``()`` = top level).
        stubbed_globals: globals replaced by inert placeholders.
        locations: storage location tag -> number of storages (e.g. ``{"cuda:7": 12}``).
        remapped: location tag -> the device it was loaded on, where that differs.
        alignment: the alignment report when ``model=`` was given.
        tied: ``{name: the name it is tied to}`` of tied weights put back that the file stores once
            (transformers' ``save_pretrained`` leaves GPT-2's ``lm_head.weight`` out; ``config.json`` says so).
    """

    path: str
    state_dict: dict
    checkpoint: Any
    format: Format
    key_path: tuple[str, ...] = ()
    stubbed_globals: list[str] = field(default_factory=list)
    locations: dict[str, int] = field(default_factory=dict)
    remapped: dict[str, str] = field(default_factory=dict)
    alignment: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)
    tied: dict[str, str] = field(default_factory=dict)

    def __getitem__(self, key: str) -> Any:
        return self.checkpoint[key]

    def get(self, key: str, default: object = None) -> object:
        """An entry of the whole checkpoint (``lc.get("epoch")``), as ``dict.get``.

        Args:
            key: the top-level key.
            default: what to return when the checkpoint has no such entry (or is not a mapping).

        Returns:
            The entry, or ``default``.
        """
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


def _python3_name(module: str, name: str) -> tuple[str, str]:
    """``(module, name)`` as Python 3's unpickler resolves a Python 2 spelling (``_compat_pickle``).

    >>> _python3_name("commands", "call"), _python3_name("__builtin__", "long"), _python3_name("os", "system")
    (('subprocess', 'call'), ('builtins', 'int'), ('os', 'system'))
    """
    import _compat_pickle

    if (module, name) in _compat_pickle.NAME_MAPPING:
        module, name = _compat_pickle.NAME_MAPPING[(module, name)]
    elif module in _compat_pickle.IMPORT_MAPPING:
        module = _compat_pickle.IMPORT_MAPPING[module]
    return module, name


def restricted_pickle_module(
    allow_globals: Iterable[Any] = (), stubbed: set[str] | None = None, path: str = "the checkpoint"
) -> types.ModuleType:
    """A pickle-module stand-in for ``torch.load(pickle_module=...)`` that never runs unknown globals.

    torch-allowed globals are rebuilt, ``allow_globals`` entries are imported and
    rebuilt, every other global becomes a placeholder (recorded in ``stubbed``).

    Args:
        allow_globals: ``"module.Name"`` strings or the objects themselves, rebuilt for real.
        stubbed: a set that receives every global replaced by a placeholder.
        path: the checkpoint, for messages.

    Returns:
        A module with ``Unpickler``, ``load`` and ``loads``; its unpickler raises
        :class:`~ckptfix.errors.UnsafePickleError` when an allowed global cannot be imported here.
    """
    allowed = _normalise_allow(allow_globals)
    record = stubbed if stubbed is not None else set()

    class RestrictedUnpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            # the Python 3 name, as pickle's own find_class resolves a protocol < 3 pickle's Python 2 spelling
            # (which overriding it skips): ``commands call`` is subprocess.call, ``__builtin__ long`` builtins.int;
            # allow_globals, the policy and ``stubbed_globals`` then see the name scan and inspect report
            module, name = _python3_name(module, name)
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
                try:
                    return _real_global(module, name)
                except ImportError:
                    package = needs_package(full)
                    if package is None:
                        raise
                    raise UnsupportedError(_package_message(path, package)) from None
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


def _package_message(path: str, package: str) -> str:
    """Why a file whose tensors are ``package``'s classes does not load here, and the ways out."""
    return (
        f"{path}: its tensors are {package} tensor subclasses (torchao's quantized Int8Tensor, Float8Tensor ...), "
        f"which load only with {package} installed: `pip install {package}`; or `ckptfix convert` writes their "
        "inner tensors as safetensors without it (`ckptfix inspect` shows them)"
    )


# --------------------------------------------------------------------------- devices


def auto_device() -> str:
    """This process's device.

    Returns:
        ``cuda:$LOCAL_RANK`` under torchrun (when that GPU exists), else ``cuda:0``, else ``cpu``.
    """
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
    """A ``map_location`` callable that records every tag and never targets a device that is not here.

    Args:
        map_location: as for :func:`load_checkpoint`.
        tags: counts every storage location tag seen.
        remapped: receives tag -> the device used instead, where they differ.

    Returns:
        ``restore(storage, location)`` for ``torch.load(map_location=...)``.

    Raises:
        UnsupportedError: ``map_location`` names a CUDA device and CUDA is not available here.
    """
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

    if _is_remote(path):  # a URL: torch reads a seekable file object of range requests (no local copy, no mmap)
        from ckptfix.files.source import open_source

        with open_source(path) as src, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            f = src.fileobj()
            if trust:
                return torch.load(f, map_location=restore, weights_only=False)
            mod = restricted_pickle_module(allow_globals, stubbed, path)
            return torch.load(f, map_location=restore, weights_only=False, pickle_module=mod)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if trust:
            return torch.load(pins.path_for(path), map_location=restore, mmap=mmap, weights_only=False)
        mod = restricted_pickle_module(allow_globals, stubbed, path)
        return torch.load(pins.path_for(path), map_location=restore, mmap=mmap, weights_only=False, pickle_module=mod)


def _is_remote(path: str) -> bool:
    if "://" not in path:
        return False
    from ckptfix.files.source import is_url

    return is_url(path)


def _materialize_remote(records: Mapping[str, Any], device: str, url: str) -> dict:
    """:func:`_materialize` of a URL: each storage's byte range read once (range requests), no local copy."""
    import torch

    from ckptfix.files.source import open_source

    out: dict[str, Any] = {}
    bases: dict[int, Any] = {}
    with open_source(url) as src:
        for name, rec in records.items():
            st = rec.storage
            if rec.kind != "dense" or st is None or st.file_offset is None:
                raise UnsupportedError(f"{url}: tensor {name!r} ({rec.kind}) cannot be materialised; use --trust")
            dtype = getattr(torch, rec.dtype)
            base = bases.get(id(st))
            if base is None:
                data = bytearray(src.pread(st.nbytes, st.file_offset)) if st.nbytes else bytearray()
                if len(data) != st.nbytes:
                    raise CorruptCheckpointError(f"{url}: the object ended inside tensor {name!r} (truncated?)")
                raw = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
                base = raw.view(dtype)
                bases[id(st)] = base
            try:
                t = base.as_strided(rec.shape, rec.stride, rec.offset)
            except RuntimeError as e:
                raise CorruptCheckpointError(
                    f"{url}: tensor {name!r} does not fit its storage ({e}); the file is corrupt"
                ) from None
            if device != "cpu":
                t = t.to(device)
            out[name] = t
    return out


def _materialize(records: Mapping[str, Any], device: str, path: str) -> dict:
    """Turn TensorRecords (byte ranges of ``path``) into torch tensors, one copied buffer per storage."""
    import mmap as _mmap

    import torch

    if _is_remote(path):
        return _materialize_remote(records, device, path)
    out: dict[str, Any] = {}
    with pins.open_binary(path) as f:
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


@dataclass
class _Load:
    """One load: the caller's arguments, and what the per-format loader records on the way."""

    path: str
    map_location: MapLocation
    allow_globals: Iterable[Any]
    trust: bool
    mmap: bool | None
    format: Format | None = None  # what the entry point classified (the loaders' read_checkpoint does not sniff)
    tags: collections.Counter[str] = field(default_factory=collections.Counter)
    remapped: dict[str, str] = field(default_factory=dict)
    stubbed: set[str] = field(default_factory=set)
    metadata: dict[str, Any] = field(default_factory=dict)

    def restore(self) -> Callable:
        """The ``map_location`` callable for ``torch.load`` (records tags, remaps missing devices)."""
        return make_restore(self.map_location, self.tags, self.remapped)

    def torch_load(self, restore: Callable, *, mmap: bool) -> Any:
        """``torch.load`` the file through the restricted pickle module (or fully, with ``trust``)."""
        try:
            return _torch_load(
                self.path,
                restore,
                mmap=mmap,
                allow_globals=self.allow_globals,
                trust=self.trust,
                stubbed=self.stubbed,
            )
        except CkptfixError:
            raise
        except Exception as e:
            first = str(e).splitlines()[0] if str(e) else ""
            if isinstance(e, RuntimeError) and "Callable map_location not supported" in first:
                raise UnsupportedError(
                    f"{self.path}: the file holds wrapper-subclass tensors (torchao's quantized tensors, DTensor), "
                    "which torch cannot place with a callable map_location; pass a device (map_location='cpu', "
                    "'cuda:0', 'auto') or a dict of tags"
                ) from None
            missing = getattr(e, "name", None) if isinstance(e, ModuleNotFoundError) else None
            if missing and missing.split(".")[0] in PACKAGES:
                raise UnsupportedError(_package_message(self.path, missing.split(".")[0])) from None
            raise CorruptCheckpointError(f"{self.path}: torch could not load it ({type(e).__name__}: {first})") from e


def load_tar(ld: _Load) -> Any:
    if not ld.trust:
        raise UnsupportedError(tar_message(ld.path))
    return _torch_load(ld.path, ld.restore(), mmap=False, allow_globals=(), trust=True, stubbed=ld.stubbed)


def load_zip(ld: _Load) -> Any:
    restore = ld.restore()  # a map_location naming a device this machine lacks is refused first
    cf = read_checkpoint(ld.path, ld.format)  # names, record sizes and limits checked before torch maps anything
    return ld.torch_load(_wrapper_location(ld, cf) or restore, mmap=ld.mmap if ld.mmap is not None else True)


def load_legacy(ld: _Load) -> Any:
    restore = ld.restore()
    cf = read_checkpoint(ld.path, ld.format)  # truncated or damaged storages refused before torch reads them
    return ld.torch_load(_wrapper_location(ld, cf) or restore, mmap=False)


def _wrapper_location(ld: _Load, cf: Any) -> Any:
    """The ``map_location`` for a file with wrapper-subclass tensors (torchao's, DTensor), else None.

    torch refuses a callable ``map_location`` for ``_rebuild_wrapper_subclass`` ("Callable map_location not
    supported"), so such a file gets the device every storage goes to (a string), or, when its storages go to
    several devices, a dict of each tag (as a string and as the ``torch.device`` a wrapper records) to its
    device.  The tags and remaps are recorded from the storages read torch-free, as the callable would.
    A caller's own callable ``map_location`` is kept (torch then says it cannot; see :meth:`_Load.torch_load`).
    """
    import torch

    if "torch._utils._rebuild_wrapper_subclass" not in cf.globals_seen:
        return None
    m = ld.map_location
    if callable(m) and not isinstance(m, (str, dict, torch.device)):
        return None
    if isinstance(m, str) and m == "auto":
        m = auto_device()
    dests: dict[str, str] = {}
    for st in cf.storages.values():
        tag = str(st.location)
        ld.tags[tag] += 1
        if isinstance(m, dict):
            d = m.get(tag, tag)
            dest = str(d)
        elif m is None:
            dest = tag
        else:
            dest = str(m)
        fixed = _available(dest) or "cpu"
        dests[tag] = fixed
        if fixed != tag:
            ld.remapped[tag] = fixed
    targets = set(dests.values())
    if len(targets) <= 1:
        return next(iter(targets), _simple_target(ld.map_location))
    mapping: dict[Any, str] = {}
    for tag, dest in dests.items():
        mapping[tag] = dest
        try:
            mapping[torch.device(tag)] = dest
        except RuntimeError:
            pass
    return mapping


def load_pickle(ld: _Load) -> Any:
    ld.restore()  # map_location is checked as for any torch file
    read_checkpoint(ld.path, ld.format)
    with _open_binary(ld.path) as f:
        if ld.trust:
            return pickle.load(f)  # explicitly trusted
        return restricted_pickle_module(ld.allow_globals, ld.stubbed).load(f)


def _open_binary(path: str) -> Any:
    """``open(path, "rb")``, or a URL's seekable file object of range requests (a context manager either way)."""
    if _is_remote(path):
        import contextlib

        from ckptfix.files.source import open_source

        @contextlib.contextmanager
        def remote() -> Any:
            with open_source(path) as src:
                yield src.fileobj()

        return remote()
    return pins.open_binary(path)


def load_safetensors(ld: _Load) -> Any:
    from safetensors import safe_open
    from safetensors.torch import load_file

    dev = _simple_target(ld.map_location)
    cf = read_checkpoint(ld.path, ld.format)  # the header's limits and checks, as in every other command
    if _is_remote(ld.path):  # each tensor's byte range read once: no local copy of the file
        ld.metadata.update(_st_metadata(cf))
        obj = _materialize_remote(cf.obj, dev, ld.path)
        obj = _torchao_rebuilt(stmeta.restore(obj, ld.metadata), ld.metadata, ld.path)
        ld.tags["cpu"] = len(obj)
        return obj
    try:
        with safe_open(pins.path_for(ld.path), framework="pt") as f:
            ld.metadata.update(f.metadata() or {})
        obj = load_file(ld.path, device=dev)
    except Exception as e:
        raise CorruptCheckpointError(f"{ld.path}: safetensors could not read it ({e})") from e
    obj = _torchao_rebuilt(stmeta.restore(obj, ld.metadata), ld.metadata, ld.path)
    ld.tags["cpu"] = len(obj)
    return obj


def _torchao_rebuilt(obj: dict[str, Any], meta: dict[str, Any], path: str) -> dict[str, Any]:
    """A file in torchao's safetensors layout (transformers' ``TorchAoConfig``, ``ckptfix convert`` of torchao
    tensors) loaded as ``from_pretrained(...).state_dict()`` holds it: the torchao tensors rebuilt by torchao's
    own ``unflatten_tensor_state_dict``.  Without torchao: the inner tensors as stored, with a warning."""
    import importlib.util

    from ckptfix.pickles.subclass import torchao_entries

    if not isinstance(obj, dict) or torchao_entries(meta) is None:
        return obj
    if importlib.util.find_spec("torchao") is None:
        warnings.warn(
            f"ckptfix: {path} holds torchao tensors in torchao's safetensors layout; without torchao installed "
            "they load as their inner tensors (`pip install torchao` rebuilds them)",
            stacklevel=2,
        )
        return obj
    from ckptfix.ops.convert.torchao import rebuild

    return rebuild(obj, {k: str(v) for k, v in meta.items()}, path)[0]


def _st_metadata(cf: Any) -> dict[str, Any]:
    """A safetensors file's ``__metadata__`` as its reader recorded it."""
    details = getattr(cf, "details", None)
    for attr in ("metadata", "st_metadata"):
        got = getattr(details, attr, None) if details is not None else None
        if isinstance(got, dict):
            return dict(got)
    got = getattr(cf, "metadata", None)
    return dict(got) if isinstance(got, dict) else {}


def load_sharded(ld: _Load) -> Any:
    cf = read_checkpoint(ld.path, ld.format)  # validates the index, every shard's name and contents
    details = cf.details_as(ShardedDetails)
    idx = details.index
    merged: dict[str, Any] = collections.OrderedDict()
    for shard, shard_path in idx.shards.items():
        one = Input(shard_path, details.shards[shard].format)  # sniffed once, by read_checkpoint
        sub = load_checkpoint(one, ld.map_location, allow_globals=ld.allow_globals, trust=ld.trust, mmap=ld.mmap)
        ld.tags.update(sub.locations)
        ld.remapped.update(sub.remapped)
        ld.stubbed.update(sub.stubbed_globals)
        ld.metadata.update(sub.metadata)
        for name, s in idx.weight_map.items():
            if s == shard:
                merged[name] = sub.state_dict[name]
    return stmeta.restore(merged, ld.metadata)


def load_torchscript(ld: _Load) -> Any:
    cf = read_checkpoint(ld.path, ld.format)
    for st in cf.storages.values():
        ld.tags[st.location] += 1
    dev = _simple_target(ld.map_location)
    if ld.trust:
        torch = require_torch("load_anywhere (loading tensors)")
        return torch.jit.load(ld.path, map_location=dev).state_dict()
    from ckptfix.formats.zipfmt import big_endian_parts

    if big_endian_parts(cf):  # the tensors are built from the raw bytes: never in the wrong order
        raise UnsupportedError(
            f"{ld.path}: a TorchScript archive with big-endian storages (byteorder 'big'); ckptfix reads its tensors "
            "without swapping bytes: load it with torch.jit.load (trust=True / --trust) only if you trust it"
        )
    return collections.OrderedDict(_materialize(cf.state_root, dev, ld.path))


def load_dcp_directory(ld: _Load) -> Any:
    """A DCP directory through ckptfix's own reader (:mod:`ckptfix.formats.dcp`), never torch's unrestricted one."""
    try:
        pmod = None if ld.trust else restricted_pickle_module(ld.allow_globals, ld.stubbed)
        obj = load_dcp(ld.path, device=_simple_target(ld.map_location), pickle_module=pmod)
    except CkptfixError:
        raise
    except OSError as e:
        raise CorruptCheckpointError(f"{ld.path}: cannot read the DCP directory ({e})") from None
    ld.tags["cpu"] += 1
    return obj


@in_session
def load_checkpoint(
    path: str | os.PathLike,
    map_location: MapLocation = "cpu",
    *,
    key: str | None = None,
    model: Any = None,
    allow_globals: Iterable[Any] = (),
    trust: bool = False,
    mmap: bool | None = None,
    untie: bool = False,
) -> LoadedCheckpoint:
    """Load a whole checkpoint and find its state dict.

    Args:
        path: a file or directory in any supported format (detected by content, once), or its
            :class:`~ckptfix.formats.Input` (:func:`~ckptfix.formats.classify`: not sniffed again).
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
        untie: tied weights a Hugging Face model stores once (``config.json``: ``tie_word_embeddings`` and the
            class's ``_tied_weights_keys``) are given back as ``model.state_dict()`` has them: by default as
            the very tensor they are tied to, with ``untie=True`` as a copy of their own (what
            ``safetensors.torch.save_file`` takes).

    Returns:
        LoadedCheckpoint.  For a valid file that holds no tensors at all (``training_args.bin``, an LR
        scheduler's state) ``state_dict`` is empty and ``checkpoint`` is the object (non-allowlisted
        classes such as ``TrainingArguments`` as placeholders unless ``allow_globals``/``trust``).

    A folder a training framework wrote (Trainer ``checkpoint-N/``, accelerate ``save_state``, a
    Hugging Face model folder, Lightning ModelParallel: :mod:`ckptfix.ops.frameworks`) gives its model weights.

    Raises:
        CheckpointNotFoundError, CorruptCheckpointError, UnsafePickleError, UnsupportedError.
        NoModelWeightsError: a framework folder without model weights.
        AlignmentError: ``model=`` and the only renaming that fits is one ``ckptfix align`` refuses (it
            matches under half the keys, or renames part of a group of keys such as ``module.fc.*`` but
            not ``module.conv.*``): nothing is renamed behind the caller's back.
    """
    require_torch("load_anywhere (loading tensors)")
    given, path = path, os.fspath(path)
    if _is_remote(path):  # one pinned version of each remote object for the whole load (metadata and tensors)
        from ckptfix.files.remote.stats import active, session

        if active() is None:
            with session():
                return load_checkpoint(
                    given,
                    map_location,
                    key=key,
                    model=model,
                    allow_globals=allow_globals,
                    trust=trust,
                    mmap=mmap,
                    untie=untie,
                )
    kw: dict[str, Any] = {
        "map_location": map_location,
        "key": key,
        "model": model,
        "allow_globals": allow_globals,
        "trust": trust,
        "mmap": mmap,
    }
    refuse_single_shard(path)
    framework = load_consolidated_folder(path, map_location, model) if os.path.isdir(path) and key is None else None
    if framework is not None:  # DeepSpeed ZeRO / torch HF-writer DCP: consolidated
        return framework
    if os.path.isdir(path):
        fw = resolve(path)
        if fw is not None:  # a framework's folder: its model weights (ckptfix.ops.frameworks)
            lc: LoadedCheckpoint = load_folder(fw, **kw)
            return _retie(lc, path, key, untie)
    return _retie(load_file(given, **kw), path, key, untie)


def _retie(lc: LoadedCheckpoint, path: str, key: str | None, untie: bool) -> LoadedCheckpoint:
    """Put back the tied weights a Hugging Face model folder stores once, as ``model.state_dict()`` has them."""
    if key is not None or _is_remote(path) or not lc.state_dict:
        return lc
    from ckptfix.formats.hfarch import missing_ties

    missing, _ = missing_ties(path, lc.state_dict)
    for name, target in missing.items():
        t = lc.state_dict[target]
        lc.state_dict[name] = t.clone() if untie and hasattr(t, "clone") else t
    lc.tied.update(missing)
    if missing and lc.alignment is not None and dataclasses.is_dataclass(lc.alignment):
        left = tuple(m for m in getattr(lc.alignment, "missing", ()) if m not in missing)
        lc.alignment = dataclasses.replace(cast(Any, lc.alignment), missing=left)
    return lc


def load_file(
    path: str | os.PathLike,
    map_location: MapLocation = "cpu",
    *,
    key: str | None = None,
    model: Any = None,
    allow_globals: Iterable[Any] = (),
    trust: bool = False,
    mmap: bool | None = None,
) -> LoadedCheckpoint:
    """:func:`load_checkpoint` of one checkpoint (file, index or DCP directory), no framework-folder lookup.

    Args:
        path, map_location, key, model, allow_globals, trust, mmap: as :func:`load_checkpoint`.

    Returns:
        LoadedCheckpoint.
    """
    inp = classify(path)  # the one sniff (none when the caller passed an Input)
    path, fmt = inp.path, inp.format
    if trust:
        warnings.warn(f"ckptfix: trust=True: unpickling {path} runs any code it contains", stacklevel=2)
    ld = _Load(path, map_location, allow_globals, trust, mmap, fmt)
    obj = dispatch(fmt, "load", path)(ld)
    return _found(ld, fmt, obj, key, model)


def load_consolidated_folder(path: str, map_location: MapLocation, model: Any) -> LoadedCheckpoint | None:
    """A DeepSpeed ZeRO folder, a torch HuggingFaceStorageWriter folder or FSDP per-rank DTensor files, consolidated
    (None: none of them)."""
    from ckptfix.formats.dtensor_ranks import dtensor_state_dict, find_dtensor_ranks

    zc = find_zero_checkpoint(path)
    hf = find_hf_storage(path) if zc is None else None
    dr = find_dtensor_ranks(path) if zc is None and hf is None else None
    if zc is not None:
        sd: dict = zero_state_dict(zc)
        fmt = f"deepspeed-zero{zc.stage}"
    elif hf is not None:
        sd = collections.OrderedDict(hf_storage_state_dict(hf))
        fmt = "hf-storage-dcp"
    elif dr is not None:
        sd = collections.OrderedDict(dtensor_state_dict(dr))
        fmt = "fsdp-dtensor-ranks"
    else:
        return None
    target = _simple_target(map_location) if map_location not in (None, "cpu") else "cpu"
    if target != "cpu":
        moved: dict[int, Any] = {}
        for k, v in sd.items():  # shared parameters stay shared
            if id(v) not in moved:
                moved[id(v)] = v.to(target)
            sd[k] = moved[id(v)]
    alignment = None
    if model is not None:
        sd, alignment = _aligned(path, sd, model)
    return LoadedCheckpoint(
        path=path,
        state_dict=sd,
        checkpoint=sd,
        format=fmt,  # type: ignore[arg-type]  # a framework layout, not a file Format
        alignment=alignment,
    )


def _aligned(path: str, sd: Any, model: Any) -> tuple[Any, Any]:
    """``sd`` renamed to fit ``model``, and the report; a renaming ``align`` refuses is refused here too.

    Raises:
        AlignmentError: the renaming fits badly or renames part of a group of keys
            (:func:`ckptfix.ops.prefixes.rename_refusal`, the rule of ``ckptfix align``).
        UnsupportedError: a key is not a string (naming the file).
    """
    from ckptfix.ops.prefixes import align_state_dict, rename_refusal

    try:
        renamed, alignment = align_state_dict(sd, model)
    except UnsupportedError as e:
        raise UnsupportedError(f"{path}: {e}") from None
    err = rename_refusal(alignment, len(sd))
    if err is not None:
        raise err
    extra = set(alignment.unexpected)
    if extra and isinstance(renamed, dict):  # (a torchvision EMA's n_averaged beside its module.* weights)
        kept = type(renamed)() if isinstance(renamed, collections.OrderedDict) else {}
        for k, v in renamed.items():
            if k not in extra:
                kept[k] = v
        if hasattr(renamed, "_metadata"):
            kept._metadata = renamed._metadata  # type: ignore[attr-defined]
        shown = ", ".join(sorted(map(str, extra))[:5]) + (f" and {len(extra) - 5} more" if len(extra) > 5 else "")
        warnings.warn(
            f"ckptfix: {path}: left out {len(extra)} entr{'y' if len(extra) == 1 else 'ies'} the model has no place "
            f"for: {shown} (model.load_state_dict(strict=True) refuses them; load without model= to keep them)",
            stacklevel=4,
        )
        renamed = kept
    return renamed, alignment


def _found(ld: _Load, fmt: Format, obj: Any, key: str | None, model: Any) -> LoadedCheckpoint:
    """The :class:`LoadedCheckpoint` of a loaded object: its state dict found, aligned to ``model``."""
    from ckptfix.formats.statedict import contains_tensors, locate_state_dict

    common: dict[str, Any] = {
        "path": ld.path,
        "checkpoint": obj,
        "format": fmt,
        "stubbed_globals": sorted(ld.stubbed),
        "locations": dict(ld.tags),
        "remapped": ld.remapped,
        "metadata": ld.metadata,
    }
    if key is None and not contains_tensors(obj):
        # a valid file without tensors (training_args.bin, a scheduler state): the object, no state dict
        return LoadedCheckpoint(state_dict=collections.OrderedDict(), key_path=(), **common)
    key_path, found, _ = locate_state_dict(obj, key)
    sd = found if isinstance(found, dict) else collections.OrderedDict(found.items())
    alignment = None
    if model is not None:
        sd, alignment = _aligned(ld.path, sd, model)
    return LoadedCheckpoint(state_dict=sd, key_path=tuple(key_path), alignment=alignment, **common)


def load_anywhere(
    path: str | os.PathLike,
    map_location: MapLocation = "cpu",
    *,
    key: str | None = None,
    model: Any = None,
    allow_globals: Iterable[Any] = (),
    trust: bool = False,
    mmap: bool | None = None,
    untie: bool = False,
) -> dict:
    """Load the state dict from any checkpoint, on any machine. A drop-in for ``torch.load`` in scripts.

    Returns the state dict itself (``dict`` name -> ``torch.Tensor``, ``_metadata`` kept), ready for
    ``model.load_state_dict``.  Use :func:`load_checkpoint` for the rest of the checkpoint and for how
    it was found.

    Args:
        path: a file or directory in any supported format (detected by content).
        map_location: as for ``torch.load``, plus ``"auto"`` and ``None`` (see :func:`load_checkpoint`).
        key: where the state dict sits; found automatically otherwise.
        model: an ``nn.Module`` to align the keys to (wrapper prefixes stripped/added; a renaming
            ``ckptfix align`` refuses raises its ``AlignmentError``, see :func:`load_checkpoint`).
        allow_globals: globals to rebuild for real instead of stubbing.
        trust: full unpickle (runs code from the file!). Only for files you made.
        mmap: memory-map zip-format files (default True for them).
        untie: tied weights stored once (GPT-2's ``lm_head.weight`` in a ``save_pretrained`` folder) come back
            as ``model.state_dict()`` gives them: the tensor they are tied to, or with ``untie=True`` a copy.

    Returns:
        The state dict (name -> ``torch.Tensor``).

    Example:
        >>> sd = load_anywhere("ddp_cuda7.pth", model=model)   # doctest: +SKIP
        >>> model.load_state_dict(sd)                          # doctest: +SKIP

    Raises:
        NoTensorsError: the file is valid but holds no tensors (``training_args.bin``, a scheduler state);
            :func:`load_checkpoint` returns such a file's object (``.checkpoint``) with an empty state dict.
        CheckpointNotFoundError, CorruptCheckpointError, UnsafePickleError, UnsupportedError: as
            :func:`load_checkpoint`.
    """
    lc = load_checkpoint(
        path, map_location, key=key, model=model, allow_globals=allow_globals, trust=trust, mmap=mmap, untie=untie
    )
    if not lc.state_dict and key is None:
        from ckptfix.errors import NoTensorsError

        raise NoTensorsError(
            f"{os.fspath(path)}: a valid {lc.format} file with no tensors in it (arguments, "
            "scheduler or other state), so there is no state dict to load; use "
            "load_checkpoint(path).checkpoint for the object itself"
        )
    return lc.state_dict


def is_stub(obj: Any) -> bool:
    """Whether ``obj`` is one of the inert placeholders that stand for globals that were not rebuilt.

    Args:
        obj: any value from a loaded checkpoint.

    Returns:
        True for a placeholder.
    """
    return isinstance(obj, Stub)


# --------------------------------------------------------------------------- framework folders


def load_folder(r: Resolved, **kw: Any) -> LoadedCheckpoint:
    """``load_checkpoint(FOLDER)``: the model weights, loaded as any checkpoint."""
    for p in r.of_role("meta"):  # the folder's own files (Lightning's meta.pt): one containment rule with convert
        check_inside(r, p)
    from ckptfix.formats.pipelines import is_multi

    if is_multi(r):  # a diffusers pipeline, a sentence-transformers model: every component (key=: one)
        from ckptfix.ops.pipelines import load_pipeline

        return load_pipeline(r, **kw)
    handler = r.layout.load
    if handler is not None:
        lc: LoadedCheckpoint = handler(r, **kw)
        return lc
    if r.layout.consolidated:
        # None only where the partitions went away since resolve() found them (as before the split)
        return cast(LoadedCheckpoint, _load_consolidated(r, **kw))
    return load_file(check_inside(r, r.require_weights()), **kw)


def _load_consolidated(r: Resolved, **kw: Any) -> LoadedCheckpoint | None:
    from ckptfix.errors import UnsupportedError

    if kw.get("key") is not None:
        raise UnsupportedError(f"{r.path}: key= does not apply to a {r.layout.framework} folder (one model in it)")
    return load_consolidated_folder(r.path, kw.get("map_location", "cpu"), kw.get("model"))
