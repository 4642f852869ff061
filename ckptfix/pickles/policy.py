"""The pickle security policy: what each global a checkpoint names is, and what the restricted reader does with it.

One table, :data:`KNOWN_GLOBALS`, holds the globals ckptfix knows by exact name.  Each entry says
both things that must agree:

* the **verdict** :func:`classify_global` gives (``"safe"``: torch's weights-only loader allows it),
  which ``scan``, ``inspect``, ``sanitize`` and the write-back checks use;
* how :class:`ckptfix.pickles.RecordingUnpickler` builds it: for real (plain-data constructors
  that run no user code, some only while the result stays small) or as an inert placeholder.

Beyond the table, :func:`classify_global` applies rules: torch's rebuild functions, dtypes and
storage classes are safe; known code-running modules, builtins and dunder attributes are
dangerous; everything else is unknown.  No module prefix is trusted wholesale (outside
TorchScript's ``__torch__`` types), and a dotted attribute path is never safe.

This module is pure data and functions: it imports neither torch nor the reader.
"""

from __future__ import annotations

import codecs
import collections
import pickle
from dataclasses import dataclass
from typing import Any, Callable, Literal

#: what :func:`classify_global` says of a global
Verdict = Literal["safe", "unknown", "dangerous"]

# --------------------------------------------------------------------------- torch's pickle vocabulary

#: dtype names as torch pickles them (``GLOBAL torch float32``); :data:`DTYPE_GLOBALS` adds the aliases
DTYPE_NAMES: tuple[str, ...] = (
    "float64",
    "float32",
    "float16",
    "bfloat16",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
    "int64",
    "int32",
    "int16",
    "int8",
    "uint64",
    "uint32",
    "uint16",
    "uint8",
    "bool",
    "complex128",
    "complex64",
    "complex32",
    "qint8",
    "quint8",
    "qint32",
    "quint4x2",
    "quint2x4",
    "float4_e2m1fn_x2",
    "bits8",
    "bits16",
    "bits1x8",
    "bits2x4",
    "bits4x2",
)

#: names of ``torch.<name>`` globals that are dtypes -> the dtype's canonical name
DTYPE_GLOBALS: dict[str, str] = {name: name for name in DTYPE_NAMES}
DTYPE_GLOBALS.update(
    {
        "float": "float32",
        "double": "float64",
        "half": "float16",
        "long": "int64",
        "int": "int32",
        "short": "int16",
        "cfloat": "complex64",
        "cdouble": "complex128",
        "chalf": "complex32",
    }
)
for _b in range(1, 8):
    DTYPE_GLOBALS[f"uint{_b}"] = f"uint{_b}"
    DTYPE_GLOBALS[f"int{_b}"] = f"int{_b}"

# --------------------------------------------------------------------------- DCP .metadata vocabulary
# The exact globals a DCP ``.metadata`` pickle may name.  Every other global there is foreign: the
# restricted reader keeps it as an inert placeholder and the loaders refuse the directory.  No module
# prefix and no dotted name is trusted: ``torch.distributed.checkpoint.filesystem`` + ``os.system`` is
# the global ``torch.distributed.checkpoint.filesystem.os.system``, which is not listed.

_DCP_MD = "torch.distributed.checkpoint.metadata"
_DCP_FS = "torch.distributed.checkpoint.filesystem"
_SHARD_MD = "torch.distributed._shard.sharded_tensor.metadata"  # torch < 2.2 kept TensorProperties here

#: the record classes torch's DCP writes into ``.metadata``
RECORD_GLOBALS: frozenset[str] = frozenset(
    {
        f"{_DCP_MD}.Metadata",
        f"{_DCP_MD}.TensorStorageMetadata",
        f"{_DCP_MD}.BytesStorageMetadata",
        f"{_DCP_MD}.ChunkStorageMetadata",
        f"{_DCP_MD}.TensorProperties",
        f"{_DCP_MD}.MetadataIndex",
        f"{_DCP_MD}.StorageMeta",
        f"{_DCP_MD}._MEM_FORMAT_ENCODING",
        f"{_DCP_FS}._StorageInfo",
        f"{_SHARD_MD}.TensorProperties",
        f"{_SHARD_MD}.MEM_FORMAT_ENCODING",
        "torch.Size",
        "torch.serialization._get_layout",
        "pathlib.PosixPath",
        "pathlib.PurePosixPath",
        "pathlib.WindowsPath",
        "pathlib.PureWindowsPath",
        "collections.OrderedDict",
    }
)

#: every global a DCP ``.metadata`` file may reference, as ``module.name`` (dtypes under all their names)
DCP_METADATA_GLOBALS: frozenset[str] = RECORD_GLOBALS | frozenset(f"torch.{d}" for d in DTYPE_GLOBALS)

#: the enum classes of DCP's metadata records -> their members' names and values (torch's
#: ``torch/distributed/checkpoint/metadata.py``; torch < 2.2 kept ``MEM_FORMAT_ENCODING`` in ``_SHARD_MD``)
_MEM_FORMATS = {"TORCH_CONTIGUOUS_FORMAT": 0, "TORCH_CHANNELS_LAST": 1, "TORCH_PRESERVE_FORMAT": 2}
DCP_ENUM_MEMBERS: dict[str, dict[str, int]] = {
    f"{_DCP_MD}._MEM_FORMAT_ENCODING": _MEM_FORMATS,
    f"{_SHARD_MD}.MEM_FORMAT_ENCODING": _MEM_FORMATS,
}

#: ``module.Enum.MEMBER`` of every DCP enum member.  Python >= 3.12 pickles an enum member by name,
#: ``builtins.getattr(<the enum class>, "MEMBER")``: the opcode scan records such a call, when the class
#: is one of :data:`DCP_ENUM_MEMBERS` and the name one of its members, as this dotted name instead of
#: ``builtins.getattr`` (any other ``getattr`` stays dangerous), and :func:`classify_pair` allows exactly
#: these names in a ``.metadata`` file.
DCP_ENUM_LOOKUPS: frozenset[str] = frozenset(f"{cls}.{m}" for cls, ms in DCP_ENUM_MEMBERS.items() for m in ms)

#: ``torch._utils`` functions that rebuild a tensor (the reader turns each call into a tensor record)
TENSOR_REBUILDERS = frozenset(
    {
        "_rebuild_tensor",
        "_rebuild_tensor_v2",
        "_rebuild_tensor_v3",
        "_rebuild_parameter",
        "_rebuild_parameter_with_state",
        "_rebuild_qtensor",
        "_rebuild_sparse_tensor",
        "_rebuild_meta_tensor_no_storage",
        "_rebuild_nested_tensor",
        "_rebuild_wrapper_subclass",
        "_rebuild_device_tensor_from_numpy",
        "_rebuild_device_tensor_from_cpu_tensor",
    }
)

#: ``torch._tensor._rebuild_from_type_v2``: a tensor rebuilt, then given a (sub)class
REBUILD_FROM_TYPE = ("torch._tensor", "_rebuild_from_type_v2")


# --------------------------------------------------------------------------- plain-data constructors

#: the codecs :func:`codecs_encode` accepts (looking up any other codec may import a module)
SAFE_CODECS = frozenset(
    {"latin1", "latin-1", "latin_1", "iso-8859-1", "iso8859-1", "l1", "utf-8", "utf8", "utf_8", "ascii", "us-ascii"}
)


def codecs_encode(obj: Any, encoding: str = "utf-8", errors: str = "strict") -> bytes:
    """``_codecs.encode`` as the restricted reader runs it: a string through a plain text codec only.

    torch pickles ``bytes`` and numpy buffers at protocol 2 as ``_codecs.encode(str, "latin1")``.

    Args:
        obj: the string to encode.
        encoding: one of :data:`SAFE_CODECS`.
        errors: the codec's error handling.

    Returns:
        The encoded bytes.

    Raises:
        pickle.UnpicklingError: anything but a string, or any other codec.
    """
    if isinstance(obj, str) and isinstance(encoding, str) and encoding.lower() in SAFE_CODECS:
        return codecs.encode(obj, encoding, errors if isinstance(errors, str) else "strict")
    raise pickle.UnpicklingError("_codecs.encode with something other than a string and a plain text codec")


@dataclass(frozen=True)
class KnownGlobal:
    """What ckptfix knows about one global, by exact ``(module, name)``.

    ``safe``: torch's weights-only loader allows it (the verdict is ``"safe"``; otherwise the
    rules of :func:`classify_global` decide).  ``build``: the plain-data constructor the restricted
    reader calls for real (it runs no user code); ``None`` keeps the global as an inert
    placeholder.  ``bounded``: ``build`` runs only while its result stays within
    ``PickleLimits.max_items`` (a bigger one is kept as a placeholder recording its arguments).
    """

    safe: bool
    build: Callable[..., Any] | None = None
    bounded: bool = False
    #: the package that must be imported for torch's weights-only loader to allow it (it registers the class
    #: with ``torch.serialization.add_safe_globals`` on import); None for torch's own allowlist
    package: str | None = None


#: every global known by exact name: its verdict and how the restricted reader builds it
KNOWN_GLOBALS: dict[tuple[str, str], KnownGlobal] = {
    # rebuilt for real: plain data, no user code
    ("collections", "OrderedDict"): KnownGlobal(safe=True, build=collections.OrderedDict),
    ("builtins", "complex"): KnownGlobal(safe=True, build=complex),
    ("builtins", "slice"): KnownGlobal(safe=False, build=slice),
    # rebuilt for real while small
    ("builtins", "set"): KnownGlobal(safe=True, build=set, bounded=True),
    ("builtins", "bytearray"): KnownGlobal(safe=True, build=bytearray, bounded=True),
    ("_codecs", "encode"): KnownGlobal(safe=True, build=codecs_encode, bounded=True),
    ("builtins", "frozenset"): KnownGlobal(safe=False, build=frozenset, bounded=True),
    ("builtins", "bytes"): KnownGlobal(safe=False, build=bytes, bounded=True),
    ("builtins", "range"): KnownGlobal(safe=False, build=range, bounded=True),
    # allowed by the weights-only loader, kept as placeholders by the reader
    ("collections", "Counter"): KnownGlobal(safe=True),
    ("torch.nn.parameter", "Parameter"): KnownGlobal(safe=True),
    ("torch.serialization", "_get_layout"): KnownGlobal(safe=True),
    ("torch", "Size"): KnownGlobal(safe=True),
    ("torch", "Tensor"): KnownGlobal(safe=True),
    ("torch", "device"): KnownGlobal(safe=True),
    (REBUILD_FROM_TYPE[0], REBUILD_FROM_TYPE[1]): KnownGlobal(safe=True),
    ("torch", "per_tensor_affine"): KnownGlobal(safe=True),
    ("torch", "per_tensor_symmetric"): KnownGlobal(safe=True),
    ("torch", "per_channel_affine"): KnownGlobal(safe=True),
    ("torch", "per_channel_symmetric"): KnownGlobal(safe=True),
    ("torch", "per_channel_affine_float_qparams"): KnownGlobal(safe=True),
    # what torch.save writes for dtypes without a legacy typed storage class (uint16, float8 ...)
    ("torch.storage", "UntypedStorage"): KnownGlobal(safe=True),
    ("torch.storage", "TypedStorage"): KnownGlobal(safe=True),
}

#: torchao's tensor subclasses and the attribute classes they hold, by exact name (each one torchao registers with
#: ``add_safe_globals``): the restricted reader reads them as their inner tensors (:mod:`ckptfix.pickles.subclass`);
#: no other ``torchao`` global is known
TORCHAO_GLOBALS: tuple[str, ...] = (
    "torchao.quantization.Int8Tensor",
    "torchao.quantization.Float8Tensor",
    "torchao.quantization.IntxUnpackedToInt8Tensor",
    "torchao.quantization.Int4Tensor",
    "torchao.quantization.Int4PlainInt32Tensor",
    "torchao.quantization.Int4TilePackedTo4dTensor",
    "torchao.quantization.granularity.PerRow",
    "torchao.quantization.granularity.PerTensor",
    "torchao.quantization.quant_primitives.MappingType",
    "torchao.quantization.quantize_.common.kernel_preference.KernelPreference",
    "torchao.quantization.quantize_.workflows.int8.int8_tensor.QuantizeTensorToInt8Kwargs",
    "torchao.quantization.quantize_.workflows.float8.float8_tensor.QuantizeTensorToFloat8Kwargs",
    "torchao.float8.inference.Float8MMConfig",
)
for _g in TORCHAO_GLOBALS:
    KNOWN_GLOBALS[tuple(_g.rsplit(".", 1))] = KnownGlobal(safe=True, package="torchao")  # type: ignore[index]


#: the packages :func:`needs_package` names
PACKAGES: frozenset[str] = frozenset(k.package for k in KNOWN_GLOBALS.values() if k.package)


def needs_package(name: str) -> str | None:
    """The package whose import makes torch's weights-only loader allow global ``name`` (None: torch's own).

    Args:
        name: ``module.name``.

    Returns:
        ``"torchao"`` for torchao's tensor classes; None for any other global.
    """
    module, _, attr = name.rpartition(".")
    known = KNOWN_GLOBALS.get((module, attr))
    return known.package if known is not None else None


def known_global(module: str, name: str) -> KnownGlobal | None:
    """The :data:`KNOWN_GLOBALS` entry of exactly ``module.name`` (a dotted ``name`` is never known).

    Args:
        module: the module as the unpickler resolves it.
        name: the attribute name.

    Returns:
        The entry, or None.
    """
    return KNOWN_GLOBALS.get((module, name))


#: the opcodes torch's weights-only unpickler reads (torch/_weights_only_unpickler.py, torch 2.13): protocol 2
#: as torch.save writes it; FRAME, SHORT_BINUNICODE, BINBYTES, ADDITEMS, MEMOIZE ... make it fail
WEIGHTS_ONLY_OPCODES = frozenset(
    {
        "PROTO",
        "STOP",
        "GLOBAL",
        "NEWOBJ",
        "REDUCE",
        "BUILD",
        "APPEND",
        "APPENDS",
        "SETITEM",
        "SETITEMS",
        "MARK",
        "TUPLE",
        "TUPLE1",
        "TUPLE2",
        "TUPLE3",
        "NONE",
        "NEWFALSE",
        "NEWTRUE",
        "EMPTY_TUPLE",
        "EMPTY_LIST",
        "EMPTY_DICT",
        "EMPTY_SET",
        "BININT",
        "BININT1",
        "BININT2",
        "BINFLOAT",
        "BINUNICODE",
        "SHORT_BINSTRING",
        "BINPERSID",
        "BINGET",
        "LONG_BINGET",
        "BINPUT",
        "LONG_BINPUT",
        "LONG1",
    }
)


# --------------------------------------------------------------------------- dangerous names

DANGEROUS_MODULES = frozenset(
    {
        "os",
        "posix",
        "nt",
        "subprocess",
        "sys",
        "runpy",
        "importlib",
        "pickle",
        "_pickle",
        "cPickle",
        "marshal",
        "shutil",
        "socket",
        "ctypes",
        "pty",
        "code",
        "codeop",
        "commands",
        "webbrowser",
        "multiprocessing",
        "asyncio",
        "platform",
        "signal",
        "tempfile",
        "io",
        "_io",
        "urllib",
        "http",
        "requests",
        "ftplib",
        "smtplib",
        "telnetlib",
        "types",
        "inspect",
        "pdb",
        "timeit",
        "cProfile",
        "profile",
        "trace",
        "dill",
        "cloudpickle",
        "joblib",
        "bdb",
        "_posixsubprocess",
        "torch.hub",
        "torch._C",
        "torch.jit",
        "torch.package",
        "torch._dynamo",
        "torch.utils.cpp_extension",
        "numpy.testing",
        "numpy.f2py",
        "numpy.distutils",
        "_ctypes",
        "operator",
        "functools",
        "builtins.getattr",
    }
)
#: attribute names that, reached through a dotted path, mean running something
DANGEROUS_ATTRS = frozenset(
    {
        "system",
        "popen",
        "spawnl",
        "spawnv",
        "execl",
        "execv",
        "execve",
        "fork",
        "load",
        "loads",
        "run",
        "call",
        "check_call",
        "check_output",
        "Popen",
        "torch_save_to_dcp",
        "remove",
        "unlink",
        "rmtree",
        "rename",
        "write",
        "write_text",
        "write_bytes",
    }
)
DANGEROUS_BUILTINS = frozenset(
    {
        "eval",
        "exec",
        "compile",
        "open",
        "getattr",
        "setattr",
        "delattr",
        "__import__",
        "globals",
        "locals",
        "vars",
        "input",
        "breakpoint",
        "apply",
        "execfile",
        "file",
        "reload",
        "memoryview",
        "help",
        "exit",
        "quit",
        "object",
        "type",
        "super",
        "classmethod",
        "staticmethod",
        "property",
        "callable",
        "map",
        "filter",
    }
)


# --------------------------------------------------------------------------- classification


def classify_global(name: str, context: str | None = None) -> Verdict:
    """Say whether a global is safe, dangerous or unknown.

    ``"safe"`` means torch's weights-only loader allows it.  ``context`` widens "safe" for
    pickles that are not ``torch.load`` files: ``"dcp"`` (a DCP ``.metadata`` file: exactly the
    metadata record classes of torch.distributed.checkpoint, and paths) and ``"torchscript"``
    (``__torch__.*`` classes are TorchScript types, resolved by the TorchScript runtime, not
    Python).  No module prefix is trusted wholesale outside TorchScript.

    Args:
        name: ``module.name`` as resolved; names the scan could not resolve (``<...>``) are unknown.
        context: ``None``, ``"dcp"`` or ``"torchscript"``.

    Returns:
        ``"safe"``, ``"unknown"`` or ``"dangerous"``.
    """
    if name.startswith("<"):
        return "unknown"
    module, _, attr = name.rpartition(".")
    known = KNOWN_GLOBALS.get((module, attr))
    if known is not None and known.safe:
        return "safe"
    if context == "dcp":
        if name in DCP_METADATA_GLOBALS or name in DCP_ENUM_LOOKUPS:  # exact names: no module prefix is trusted
            return "safe"
    if (
        context == "torchscript"
        and name.startswith("__torch__.")
        and "__" not in name[len("__torch__.") :].replace("___torch_mangle_", "")
    ):
        return "safe"
    if module == "torch._utils" and attr in TENSOR_REBUILDERS:
        return "safe"
    if module == "torch" and (attr in DTYPE_GLOBALS or attr.endswith("Storage") or attr.endswith("Tensor")):
        return "safe"
    if module in ("torch.cuda",) and (attr.endswith("Storage") or attr.endswith("Tensor")):
        return "safe"
    if module in ("torch.sparse", "torch.cuda.sparse") and attr.endswith("Tensor"):
        return "safe"
    if module in ("builtins", "__builtin__"):
        return "dangerous" if attr in DANGEROUS_BUILTINS else "unknown"
    root = module.split(".")[0]
    if module in DANGEROUS_MODULES or root in DANGEROUS_MODULES:
        return "dangerous"
    if any(part.startswith("__") and part.endswith("__") for part in name.split(".")[1:]):
        return "dangerous"  # __globals__, __builtins__, __subclasses__ ...
    if module.startswith("numpy") and attr in ("load", "loads", "fromfile", "memmap", "save"):
        return "dangerous"
    return "unknown"


_ORDER: dict[str, int] = {"safe": 0, "unknown": 1, "dangerous": 2}


def classify_pair(module: str, name: str, context: str | None = None) -> Verdict:
    """Classify a global the way the unpickler resolves it: ``name`` may be dotted (``path.join``).

    A dotted attribute path is never safe: the unpickler walks it with ``getattr``
    from ``module`` (protocol 4+), which reaches far beyond the name it spells.

    Args:
        module: the resolved module name.
        name: the resolved attribute name (dots walk attributes).
        context: as for :func:`classify_global`.

    Returns:
        ``"safe"``, ``"unknown"`` or ``"dangerous"``.
    """
    joined = classify_global(f"{module}.{name}", context)
    if "." not in name:
        return joined
    if context == "dcp" and f"{module}.{name}" in DCP_ENUM_LOOKUPS:  # an enum member, named exactly
        return "safe"
    parts = name.split(".")
    own: Verdict = (
        "dangerous"
        if (
            classify_global(f"{module}.{parts[0]}", context) == "dangerous"
            or any(
                p.startswith("__") or p in DANGEROUS_MODULES or p in DANGEROUS_BUILTINS or p in DANGEROUS_ATTRS
                for p in parts
            )
        )
        else "unknown"
    )
    return own if _ORDER[own] >= _ORDER[joined] else joined


def worst(*classes: str) -> str:
    """The most severe of some verdicts.

    Args:
        *classes: verdicts (``"safe"``, ``"unknown"``, ``"dangerous"``).

    Returns:
        The most severe one; ``"safe"`` when none is given.

    Raises:
        KeyError: a value that is not a verdict.
    """
    return max(classes, key=_ORDER.__getitem__) if classes else "safe"
