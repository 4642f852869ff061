"""The exact globals a DCP ``.metadata`` pickle may name (pure data, imported by the pickle classifier too).

Every other global in ``.metadata`` is foreign: the restricted reader keeps it
as an inert placeholder and the loaders refuse the directory.  No module
prefix and no dotted name is trusted: ``torch.distributed.checkpoint.filesystem``
+ ``os.system`` is the global ``torch.distributed.checkpoint.filesystem.os.system``,
which is not listed.
"""

from __future__ import annotations

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

#: ``torch.<dtype>`` globals (TensorProperties.dtype)
DTYPE_NAMES: frozenset[str] = frozenset(
    {
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
        "float",
        "double",
        "half",
        "long",
        "int",
        "short",
        "cfloat",
        "cdouble",
        "chalf",
    }
)

#: every global a DCP ``.metadata`` file may reference, as ``module.name``
DCP_METADATA_GLOBALS: frozenset[str] = RECORD_GLOBALS | frozenset(f"torch.{d}" for d in DTYPE_NAMES)
