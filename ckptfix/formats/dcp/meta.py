"""Read, validate and write DCP ``.metadata`` without torch and without running pickle code.

``.metadata`` is a pickle of torch's DCP dataclasses.  :class:`MetadataUnpickler`
(a :class:`~ckptfix.pickles.RecordingUnpickler`) maps exactly the globals in
:data:`ckptfix.pickles.policy.DCP_METADATA_GLOBALS` to inert placeholders that
record their arguments and state; every other global is a *foreign* placeholder,
counted so that loaders refuse the directory.  Nothing is imported and nothing
is called.  :func:`read_metadata` then turns the placeholder tree into plain
records (:class:`TensorEntry`, :class:`Chunk`, :class:`Location` ...) with
strict type checks, and :func:`validate` checks them against the files:
chunk ranges inside their ``.distcp`` files, no missing or unreferenced
``.distcp`` file, chunks that tile each tensor exactly.

:func:`dumps_metadata` writes the (renamed) placeholder tree back with the
original globals, which torch's ``FileSystemReader`` loads.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import os
import pickle
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ckptfix.errors import CheckpointNotFoundError, CorruptCheckpointError, UnsafePickleError, UnsupportedError
from ckptfix.files import pins, source
from ckptfix.pickles import (
    ELEMENT_SIZE,
    RecordingUnpickler,
    Stub,
    dumps,
    global_name,
    paused_gc,
    stub_class,
    stub_dtype,
)
from ckptfix.pickles.policy import DCP_ENUM_LOOKUPS, DCP_ENUM_MEMBERS, DCP_METADATA_GLOBALS

METADATA_NAME = ".metadata"
#: a ``.metadata`` larger than this is refused (millions of chunks); ``CKPTFIX_DCP_MAX_METADATA`` lifts it
MAX_METADATA_BYTES = int(os.environ.get("CKPTFIX_DCP_MAX_METADATA", str(1 << 30)))
#: list positions in a saved state dict's nesting (``param_groups.0``) above this are refused
MAX_LIST_INDEX = 1 << 20


# --------------------------------------------------------------------------- records


@dataclass(frozen=True)
class Chunk:
    """One chunk of a tensor: where it sits in the global tensor (element offsets and sizes per dim)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        """Elements in the chunk.

        Returns:
            The product of ``sizes``.
        """
        n = 1
        for s in self.sizes:
            n *= s
        return n


@dataclass(frozen=True)
class Location:
    """Where an item's bytes are: ``relative_path`` inside the directory, byte ``offset`` and ``length``."""

    relative_path: str
    offset: int
    length: int
    transform: str | None = None  # "zstd": the item is one zstd stream (torch's ZStandard extension, stream.zstd/1)


@dataclass
class TensorEntry:
    """A tensor of the saved state dict: global dtype/shape and its chunks with their locations."""

    fqn: str
    dtype: str
    shape: tuple[int, ...]
    chunks: list[Chunk]
    locations: list[Location] = field(default_factory=list)

    @property
    def numel(self) -> int:
        """Elements in the tensor.

        Returns:
            The product of ``shape``.
        """
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def element_size(self) -> int:
        """Bytes per element.

        Returns:
            The size of ``dtype``.
        """
        return ELEMENT_SIZE[self.dtype]

    @property
    def nbytes(self) -> int:
        """Bytes of the whole tensor.

        Returns:
            ``numel * element_size``.
        """
        return self.numel * self.element_size


@dataclass
class BytesEntry:
    """A non-tensor object of the state dict (``torch.save``'d pickle), e.g. an optimizer's ``param_groups``."""

    fqn: str
    location: Location | None = None


@dataclass
class DcpMetadata:
    """A DCP directory's metadata as plain records.

    Attributes:
        path: the directory.
        entries: fqn -> :class:`TensorEntry` or :class:`BytesEntry`, in saved order.
        planner_data: fqn -> the key path of the entry in the nested state dict (``("model", "fc.weight")``).
        files: the ``relative_path`` of every data file the metadata references, sorted.
        globals_seen: every global ``.metadata`` named, with counts.
        foreign: the globals that are not DCP metadata records (each refused by the loaders).
        raw: the placeholder tree as read (what :func:`dumps_metadata` writes back).
        version: the metadata format version torch recorded, if any.
    """

    path: str
    entries: dict[str, TensorEntry | BytesEntry]
    planner_data: dict[str, tuple]
    files: list[str]
    globals_seen: dict[str, int]
    foreign: dict[str, int]
    raw: Any
    version: str | None = None

    def tensors(self) -> Iterator[TensorEntry]:
        """The tensor entries.

        Returns:
            An iterator of :class:`TensorEntry`, in metadata order.
        """
        for e in self.entries.values():
            if isinstance(e, TensorEntry):
                yield e

    def key_path(self, fqn: str) -> tuple:
        """The entry's path in the nested state dict.

        Args:
            fqn: the entry's flattened name.

        Returns:
            The path (its fqn alone when the planner recorded none).
        """
        return tuple(self.planner_data.get(fqn) or (fqn,))

    def check_safe(self) -> None:
        """Refuse metadata that named any global outside the DCP allowlist.

        Raises:
            UnsafePickleError: naming up to three of them.
        """
        if self.foreign:
            names = sorted(self.foreign)
            more = f" (and {len(names) - 3} more)" if len(names) > 3 else ""
            raise UnsafePickleError(
                f"{os.path.join(self.path, METADATA_NAME)} references {', '.join(names[:3])}{more}, which DCP "
                "metadata never contains; refusing to run it (a crafted or foreign .metadata; re-save the "
                "checkpoint, or pass --trust / trust=True only if you wrote it yourself)"
            )


# --------------------------------------------------------------------------- reading


class MetadataUnpickler(RecordingUnpickler):
    """Restricted reader for ``.metadata``: DCP record classes become placeholders, nothing else is trusted.

    The opcode pre-flight runs as for any pickle; the generic depth walk after it does not:
    the tree is only ever read by :func:`_records` through the fixed DCP schema (whose
    messages show foreign values by type, never by ``repr``) and written back by the C
    pickler, whose recursion is bounded (:func:`~ckptfix.pickles.dumps` turns it into an error).
    """

    check_nesting = False

    def __init__(self, file: Any, *, preflight: bool = True) -> None:
        super().__init__(file, preflight=preflight)
        self.foreign: collections.Counter[str] = collections.Counter()

    def find_class(self, module: str, name: str) -> Any:
        """A placeholder class for every global (``OrderedDict`` excepted); foreign ones are counted.

        Args:
            module: the global's module.
            name: its name.

        Returns:
            The placeholder class.
        """
        if module == "__builtin__":
            module = "builtins"
        full = f"{module}.{name}"
        self.globals_seen[full] += 1
        if full == "collections.OrderedDict":
            return collections.OrderedDict
        scanned = self.scanned
        if full == "builtins.getattr" and scanned is not None and ("builtins", "getattr") not in scanned.pairs:
            # the pre-flight scan saw it called only as getattr(DCP enum class, member name) (Python >= 3.12
            # pickles an enum member by name): the member, as the placeholder of cls(value) torch writes
            return _enum_member
        if full in DCP_ENUM_LOOKUPS:  # protocol 4 names a member as "Enum.MEMBER" too
            return _enum_member(stub_class(module, name.rsplit(".", 1)[0]), name.rsplit(".", 1)[1])
        if full not in DCP_METADATA_GLOBALS:
            self.foreign[full] += 1
            self.stubbed.add(full)
        return stub_class(module, name)

    def persistent_load(self, pid: Any) -> Any:
        """Refuse persistent ids (DCP metadata has none).

        Args:
            pid: the id.

        Raises:
            pickle.UnpicklingError: always.
        """
        raise pickle.UnpicklingError("DCP metadata holds no persistent ids")


def _enum_member(cls: Any, name: Any) -> Stub:
    """``getattr(cls, name)`` for a DCP enum placeholder class and one of its members' names.

    Args:
        cls: the enum's placeholder class.
        name: the member's name.

    Returns:
        The placeholder of ``cls(value)`` (what torch pickles by value, and loads on every Python).

    Raises:
        pickle.UnpicklingError: any other class or name (the pre-flight scan lets no other call through).
    """
    members = DCP_ENUM_MEMBERS.get(global_name(cls)) if isinstance(cls, type) and issubclass(cls, Stub) else None
    if members is None or type(name) is not str or name not in members:
        raise pickle.UnpicklingError("getattr on something other than a DCP enum member")
    return cls(members[name])


_NAMES: dict[type, str] = {}  # class -> "module.name" of a placeholder class, "" for any other type


def _name(x: Any) -> str | None:
    t = type(x)
    name = _NAMES.get(t)
    if name is None:
        name = _NAMES[t] = global_name(t) if issubclass(t, Stub) else ""
    return name or None


def _show(x: Any) -> str:
    """A value from the metadata for a message: strings and integers as written, anything else by type."""
    return repr(x)[:80] if type(x) in (str, int) else f"<{type(x).__name__}>"


def _state(x: Any, what: str, where: str) -> dict:
    if _name(x) != what:
        raise CorruptCheckpointError(
            f"{where}: expected a {what.rsplit('.', 1)[-1]}, found {_name(x) or type(x).__name__}; not DCP metadata"
        )
    st = x.state
    if isinstance(st, tuple) and len(st) == 2 and isinstance(st[1], dict) and isinstance(st[0], (dict, type(None))):
        # (dict, slots)
        merged = dict(st[0] or {})
        merged.update(st[1])
        return merged
    if isinstance(st, dict):
        return st
    if st is None:
        return {}
    raise CorruptCheckpointError(f"{where}: malformed {what.rsplit('.', 1)[-1]} state; not DCP metadata")


def _int(v: Any, where: str) -> int:
    if type(v) is not int:
        raise CorruptCheckpointError(f"{where}: expected an integer, found {type(v).__name__}")
    return v


def _size(x: Any, where: str) -> tuple[int, ...]:
    if _name(x) == "torch.Size":
        args = x.args
        x = args[0] if args else ()
    if type(x) not in (tuple, list) or len(x) > 64:
        raise CorruptCheckpointError(f"{where}: expected a torch.Size, found {type(x).__name__}")
    for v in x:
        if type(v) is not int:
            raise CorruptCheckpointError(f"{where}: expected an integer, found {type(v).__name__}")
        if v < 0:
            raise CorruptCheckpointError(f"{where}: negative size {list(x)}")
    return tuple(x)


_MD = "torch.distributed.checkpoint.metadata."


def _dtype(props: Any, where: str) -> str:
    name = _name(props)
    if name not in (_MD + "TensorProperties", "torch.distributed._shard.sharded_tensor.metadata.TensorProperties"):
        raise CorruptCheckpointError(f"{where}: tensor properties missing; not DCP metadata")
    st = props.state
    if isinstance(st, tuple) and st:  # torch >= 2.0: (dtype, layout, requires_grad, memory format, pin_memory)
        dt, layout = st[0], st[1] if len(st) > 1 else None
    elif isinstance(st, dict):
        dt, layout = st.get("dtype"), st.get("layout")
    else:
        raise CorruptCheckpointError(f"{where}: malformed tensor properties; not DCP metadata")
    largs = getattr(layout, "_args", None)
    if _name(layout) == "torch.serialization._get_layout" and largs not in (("torch.strided",),):
        raise UnsupportedError(
            f"{where}: layout {_show(largs[0]) if largs else '?'} (only dense, strided tensors are supported)"
        )
    dtype = stub_dtype(dt)
    if dtype is None:
        raise CorruptCheckpointError(f"{where}: no dtype recorded; not DCP metadata")
    if dtype not in ELEMENT_SIZE:
        raise UnsupportedError(f"{where}: dtype {dtype} is not supported")
    return dtype


#: torch.distributed.checkpoint._extension.ZStandard's descriptor: each item's bytes are one zstd stream
ZSTD_DESCRIPTOR = "stream.zstd/1"


def _location(info: Any, where: str) -> Location:
    st = _state(info, "torch.distributed.checkpoint.filesystem._StorageInfo", where)
    rel, off, length = st.get("relative_path"), st.get("offset"), st.get("length")
    if not isinstance(rel, str):
        raise CorruptCheckpointError(f"{where}: storage entry without a file name; not DCP metadata")
    check_relative_path(rel, where)
    transform = None
    td = st.get("transform_descriptors")
    if td and isinstance(td, (list, tuple)) and list(td) == [ZSTD_DESCRIPTOR]:
        import importlib.util

        if importlib.util.find_spec("zstandard") is None:
            raise UnsupportedError(
                f"{where}: compressed with torch's ZStandard extension ({ZSTD_DESCRIPTOR}); reading it needs the "
                "zstandard package (the zstd extra): pip install zstandard (or load it with torch's dcp.load)"
            )
        transform = "zstd"
    elif td:
        raise UnsupportedError(
            f"{where}: stored with transforms {[_show(t) for t in list(st['transform_descriptors'])[:3]]} "
            "(compression or encryption extensions); ckptfix reads plain DCP data only — "
            "load it with torch's dcp.load"
        )
    loc = Location(rel, _int(off, where), _int(length, where), transform)
    if loc.offset < 0 or loc.length < 0:
        raise CorruptCheckpointError(f"{where}: negative byte range {loc.offset}+{loc.length}")
    return loc


def check_relative_path(rel: str, where: str) -> None:
    """Refuse a data-file name that could leave the checkpoint directory.

    Args:
        rel: the name as recorded.
        where: names the metadata in messages.

    Raises:
        UnsafePickleError: absolute, ``..``, a path separator, a NUL byte, or empty.
    """
    bad = (
        not rel
        or "\x00" in rel
        or "/" in rel
        or "\\" in rel
        or rel in (".", "..")
        or os.path.isabs(rel)
        or rel.startswith("~")
    )
    if bad:
        raise UnsafePickleError(
            f"{where}: data file name {rel!r} would leave the checkpoint directory; refused "
            "(DCP writes plain file names such as __0_0.distcp)"
        )


def read_metadata(path: str | os.PathLike) -> DcpMetadata:
    """Read a DCP directory's ``.metadata`` with the restricted reader, as records.

    Foreign globals do not raise here (``inspect`` reports them); call
    :meth:`DcpMetadata.check_safe` before using the data, as every loader does.

    Args:
        path: the DCP directory.

    Returns:
        DcpMetadata

    Raises:
        CheckpointNotFoundError: no ``.metadata`` in ``path``.
        CorruptCheckpointError: not a pickle of DCP metadata records, or inconsistent records.
        UnsafePickleError: a data file name that leaves the directory.
        UnsupportedError: transforms (compression), non-strided layouts, unknown dtypes; ``.metadata``
            or a data file that is a symlink resolving outside the directory.
    """
    from ckptfix.files.containment import check_member, remote_name_escapes

    path = os.fspath(path)
    mpath = source.join(path, METADATA_NAME)
    check_member(path, METADATA_NAME, path)
    try:
        size = source.getsize(mpath)
        if size > MAX_METADATA_BYTES:
            from ckptfix.errors import ResourceLimitError

            raise ResourceLimitError(
                f"{mpath}: {size} bytes of DCP metadata is over the {MAX_METADATA_BYTES}-byte "
                "limit; set CKPTFIX_DCP_MAX_METADATA to read it"
            )
        with source.open_file(mpath) as f:
            data = f.read()
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{path}: no .metadata file; not a DCP checkpoint directory") from None
    except IsADirectoryError:
        raise CorruptCheckpointError(f"{mpath}: is a directory, not DCP metadata") from None
    meta = metadata_from_bytes(data, path)
    for rel in meta.files:  # a data file linking out of the directory is refused, as a sharded index's shard is
        if source.is_url(path) and remote_name_escapes(rel):  # %2e%2e, a query...: joined, it names another object
            raise UnsafePickleError(
                f"{mpath}: data file name {rel!r} would leave the checkpoint folder; refused "
                "(DCP writes plain file names such as __0_0.distcp)"
            )
        check_member(path, rel, path)
    return meta


def metadata_from_bytes(data: bytes, path: str, *, ours: bool = False) -> DcpMetadata:
    """:func:`read_metadata` on the bytes of a ``.metadata`` file.

    Args:
        data: the file's bytes.
        path: the directory, for messages.
        ours: the bytes were just written by :func:`dumps_metadata` from metadata read with the
            limits checked, so the opcode pre-flight and nesting check are skipped.

    Returns:
        The :class:`DcpMetadata`.

    Raises:
        CorruptCheckpointError: not readable as DCP metadata.
        UnsafePickleError, UnsupportedError: as :func:`read_metadata`.
    """
    mpath = os.path.join(path, METADATA_NAME)
    up = MetadataUnpickler.for_bytes(data, preflight=not ours)
    try:
        with paused_gc():
            root = up.load()
    except (CorruptCheckpointError, UnsafePickleError, UnsupportedError):
        raise
    except Exception as e:  # noqa: BLE001 - any malformed pickle: a typed error, never a traceback
        raise CorruptCheckpointError(
            f"{mpath}: cannot read DCP metadata ({type(e).__name__}: "
            f"{str(e)[:200]}); the file is truncated or not DCP metadata"
        ) from None
    with paused_gc():
        meta = _records(root, path, mpath)
    meta.globals_seen = dict(up.globals_seen)
    meta.foreign = dict(up.foreign)
    return meta


def _records(root: Any, path: str, mpath: str) -> DcpMetadata:
    st = _state(root, _MD + "Metadata", mpath)
    sdm = st.get("state_dict_metadata")
    if not isinstance(sdm, dict):
        raise CorruptCheckpointError(f"{mpath}: no state_dict_metadata; not DCP metadata")
    entries: dict[str, TensorEntry | BytesEntry] = {}
    for fqn, md in sdm.items():
        if not isinstance(fqn, str):
            raise CorruptCheckpointError(f"{mpath}: entry name {_show(fqn)} is not a string")
        where = f"{mpath}: {fqn!r}"
        if _name(md) == _MD + "BytesStorageMetadata":
            entries[fqn] = BytesEntry(fqn)
            continue
        mst = _state(md, _MD + "TensorStorageMetadata", where)
        shape = _size(mst.get("size"), where)
        chunks_raw = mst.get("chunks")
        if not isinstance(chunks_raw, list):
            raise CorruptCheckpointError(f"{where}: no chunk list; not DCP metadata")
        chunks = []
        for c in chunks_raw:
            cst = _state(c, _MD + "ChunkStorageMetadata", where)
            chunks.append(Chunk(_size(cst.get("offsets"), where), _size(cst.get("sizes"), where)))
        entries[fqn] = TensorEntry(fqn, _dtype(mst.get("properties"), where), shape, chunks)
    planner = st.get("planner_data")
    planner_data: dict[str, tuple] = {}
    if isinstance(planner, dict):
        for k, v in planner.items():
            if (
                isinstance(k, str)
                and isinstance(v, (tuple, list))
                and v
                and all(isinstance(p, str) or (type(p) is int and 0 <= p <= MAX_LIST_INDEX) for p in v)
            ):
                planner_data[k] = tuple(v)
            else:
                raise CorruptCheckpointError(f"{mpath}: malformed planner_data entry {_show(k)}; not DCP metadata")
    elif planner is not None:
        raise CorruptCheckpointError(f"{mpath}: malformed planner_data; not DCP metadata")
    storage = st.get("storage_data")
    if not isinstance(storage, dict):
        raise CorruptCheckpointError(f"{mpath}: no storage_data (not written by the file-system writer)")
    found: dict[tuple, Location] = {}
    for idx, info in storage.items():
        ist = _state(idx, _MD + "MetadataIndex", mpath)
        fqn = ist.get("fqn")
        if type(fqn) is not str:
            raise CorruptCheckpointError(f"{mpath}: storage entry named {_show(fqn)}, not a string; not DCP metadata")
        where = f"{mpath}: {fqn!r}"
        off = ist.get("offset")
        key = (fqn, None if off is None else _size(off, where))
        if key in found:
            raise CorruptCheckpointError(f"{where}: two storage entries for the same chunk")
        found[key] = _location(info, where)
    for fqn, e in entries.items():
        where = f"{mpath}: {fqn!r}"
        if isinstance(e, BytesEntry):
            e.location = found.pop((fqn, None), None)
            if e.location is None:
                raise CorruptCheckpointError(f"{where}: no storage entry for this object; the metadata is incomplete")
            continue
        for c in e.chunks:
            loc = found.pop((fqn, c.offsets), None)
            if loc is None:
                raise CorruptCheckpointError(
                    f"{where}: no storage entry for the chunk at {list(c.offsets)}; the metadata is incomplete"
                )
            e.locations.append(loc)
    if found:
        fqn, off = next(iter(found))
        raise CorruptCheckpointError(
            f"{mpath}: storage entry {fqn!r}@{list(off) if off else off} belongs to no "
            "state-dict entry; the metadata is inconsistent"
        )
    files = sorted(
        {
            loc.relative_path
            for e in entries.values()
            for loc in ([e.location] if isinstance(e, BytesEntry) else e.locations)
            if loc is not None
        }
    )
    version = st.get("version")
    return DcpMetadata(
        path=path,
        entries=entries,
        planner_data=planner_data,
        files=files,
        globals_seen={},
        foreign={},
        raw=root,
        version=version if isinstance(version, str) else None,
    )


# --------------------------------------------------------------------------- validation


def _overlap(a: Chunk, b: Chunk) -> bool:
    return all(
        ao < bo + bs and bo < ao + as_ for ao, as_, bo, bs in zip(a.offsets, a.sizes, b.offsets, b.sizes, strict=False)
    )


#: the most chunk pairs :func:`check_tiling` compares for one tensor (a few seconds)
MAX_TILING_PAIRS = 1 << 22


def _sweep_dim(live: list[Chunk], nd: int, where: str) -> int:
    """The dimension whose sweep compares the fewest chunk pairs (chunks spread apart there).

    Raises:
        ResourceLimitError: even that sweep would compare more than :data:`MAX_TILING_PAIRS` pairs.
    """
    best, best_cost = 0, -1
    for d in range(nd):
        starts = sorted(c.offsets[d] for c in live)
        ends = sorted(c.offsets[d] + c.sizes[d] for c in live)
        # the pairs the sweep visits: for each chunk, those starting at or after it and before it ends
        cost = sum(bisect.bisect_left(starts, end) for end in ends) - len(live) * (len(live) + 1) // 2
        if best_cost < 0 or cost < best_cost:
            best, best_cost = d, cost
    if best_cost > MAX_TILING_PAIRS:
        from ckptfix.errors import ResourceLimitError

        raise ResourceLimitError(
            f"{where}: its {len(live)} chunks are crowded on every dimension; checking them for overlaps "
            f"would compare over {MAX_TILING_PAIRS:,} pairs (no DCP writer lays chunks out like that); "
            "if the checkpoint is yours, load it with torch's dcp.load"
        )
    return best


def check_tiling(e: TensorEntry, where: str) -> None:
    """The chunks lie inside the tensor, do not overlap and leave no hole.

    Args:
        e: the tensor entry.
        where: names the metadata in messages.

    Raises:
        CorruptCheckpointError: naming the tensor and the offending chunk(s).
        ResourceLimitError: chunks so crowded on every dimension that the check would take minutes.
    """
    nd = len(e.shape)
    total = 0
    for c in e.chunks:
        if len(c.offsets) != nd or len(c.sizes) != nd:
            raise CorruptCheckpointError(
                f"{where}: chunk at {list(c.offsets)} has {len(c.offsets)} dims, the "
                f"tensor {nd}; the metadata is corrupt"
            )
        for o, s, g in zip(c.offsets, c.sizes, e.shape, strict=False):
            if o + s > g:
                raise CorruptCheckpointError(
                    f"{where}: chunk {list(c.offsets)}+{list(c.sizes)} reaches past the "
                    f"tensor's shape {list(e.shape)}; the metadata is corrupt"
                )
        total += c.numel
    live = [c for c in e.chunks if c.numel]
    if nd:
        d = _sweep_dim(live, nd, where)
        live.sort(key=lambda c: c.offsets[d])
        for i, a in enumerate(live):  # sweep on dim d: only chunks starting before a ends can overlap it
            end0 = a.offsets[d] + a.sizes[d]
            for b in live[i + 1 :]:
                if b.offsets[d] >= end0:
                    break
                if _overlap(a, b):
                    raise CorruptCheckpointError(
                        f"{where}: chunks {list(a.offsets)}+{list(a.sizes)} and {list(b.offsets)}+{list(b.sizes)} "
                        "overlap; the checkpoint mixes saves of different runs or its metadata is corrupt"
                    )
    elif len(live) > 1:
        raise CorruptCheckpointError(f"{where}: a scalar saved as {len(live)} chunks; the metadata is corrupt")
    if total != e.numel:
        raise CorruptCheckpointError(
            f"{where}: the chunks cover {total} of {e.numel} elements (a hole); a rank's "
            "shard is missing from the metadata"
        )


def validate(meta: DcpMetadata, *, check_files: bool = True) -> dict[str, int]:
    """Check the metadata against itself and the directory.

    Args:
        meta: the metadata read.
        check_files: also check the data files' sizes and that none is unreferenced.

    Returns:
        Data file name -> size.

    Raises:
        CheckpointNotFoundError: a referenced data file is missing.
        CorruptCheckpointError: chunks overlapping / leaving holes, byte ranges past the end of their file
            (metadata of a different run), or a ``.distcp`` file the metadata does not reference.
    """
    mpath = os.path.join(meta.path, METADATA_NAME)
    for e in meta.tensors():
        check_tiling(e, f"{mpath}: tensor {e.fqn!r}")
    sizes: dict[str, int] = {}
    if not check_files:
        return sizes
    remote = _remote_sizes(meta.path) if "://" in os.fspath(meta.path) else None  # a folder at a URL: one listing
    for rel in meta.files:
        p = source.join(meta.path, rel)
        try:
            if remote is not None:
                sizes[rel] = remote[rel]
                continue
            if not os.path.isfile(p):
                raise FileNotFoundError(p)
            sizes[rel] = pins.fstat(p).st_size
        except (OSError, KeyError):
            raise CheckpointNotFoundError(
                f"{meta.path}: data file {rel} is missing (the metadata references it); "
                "copy the whole checkpoint directory"
            ) from None
    listed = set(meta.files)
    names = remote if remote is not None else os.listdir(meta.path)
    extra = sorted(n for n in names if n.endswith(".distcp") and n not in listed)
    if extra:
        raise CorruptCheckpointError(
            f"{meta.path}: {', '.join(extra[:3])} {'is' if len(extra) == 1 else 'are'} not "
            "referenced by .metadata (a leftover of another save, or .metadata of a "
            "different run); remove stray files or re-save the checkpoint"
        )
    for e in meta.tensors():
        for c, loc in zip(e.chunks, e.locations, strict=False):
            if loc.length < c.numel * e.element_size:
                raise CorruptCheckpointError(
                    f"{meta.path}: {e.fqn!r} chunk {list(c.offsets)} needs {c.numel * e.element_size} bytes but is "
                    f"recorded as {loc.length} bytes of {loc.relative_path} (.metadata from a different run, or "
                    "corrupt)"
                )
    for entry in meta.entries.values():
        locs: list[Location | None] = [entry.location] if isinstance(entry, BytesEntry) else list(entry.locations)
        for place in locs:
            if place is not None and place.offset + place.length > sizes[place.relative_path]:
                raise CorruptCheckpointError(
                    f"{meta.path}: {entry.fqn!r} is recorded at bytes {place.offset}..{place.offset + place.length} "
                    f"of {place.relative_path}, which has {sizes[place.relative_path]} bytes (truncated file, or "
                    ".metadata from a different run)"
                )
    return sizes


def _remote_sizes(url: str) -> dict[str, int] | None:
    """``{name: size}`` of the files in a DCP folder at a URL (one listing request), or None for a local path.

    Raises:
        RemoteNotFoundError, RemoteAccessDeniedError, RemoteUnavailableError: as the store answers.
    """
    if not source.is_url(url):
        return None
    if url.startswith(("http://", "https://")):  # no sizes in an HTTP listing: each file's own size
        out = {}
        for name in source.listdir(url):
            with contextlib.suppress(CheckpointNotFoundError), source.open_source(source.join(url, name)) as src:
                out[name] = src.size
        return out
    from ckptfix.files.remote.url import filesystem

    fs, p = filesystem(url)
    try:
        entries = fs.ls(p.rstrip("/"), detail=True)
    except FileNotFoundError:
        return {}
    except Exception as e:  # noqa: BLE001 (the store's own errors: mapped to the typed ones by the Source layer)
        raise source._remote_map(url, e) from None
    return {
        str(e["name"]).rstrip("/").rsplit("/", 1)[-1]: int(e.get("size") or 0)
        for e in entries
        if e.get("type", "file") == "file"
    }


# --------------------------------------------------------------------------- writing


def rename_metadata(meta: DcpMetadata, rename: dict[tuple, tuple]) -> Stub:
    """A new placeholder tree with entries moved to new key paths (``old path -> new path``).

    Renames keys in ``state_dict_metadata``, the ``fqn`` of every ``MetadataIndex`` in
    ``storage_data`` and ``planner_data``; everything else (chunks, byte ranges,
    storage_meta, version) is kept as read.

    Args:
        meta: the metadata read.
        rename: old key path -> new key path.

    Returns:
        The new placeholder tree (pickle it with :func:`dumps_metadata`).
    """
    root = meta.raw
    st = dict(_state(root, _MD + "Metadata", "metadata"))
    fqn_map: dict[str, tuple[str, tuple]] = {}
    for fqn in meta.entries:
        old = meta.key_path(fqn)
        new = rename.get(old, old)
        fqn_map[fqn] = (".".join(map(str, new)), new)
    new_sdm = type(st["state_dict_metadata"])()
    for fqn, md in st["state_dict_metadata"].items():
        new_sdm[fqn_map[fqn][0]] = md
    new_storage = type(st["storage_data"])()
    for idx, info in st["storage_data"].items():
        ist = dict(_state(idx, _MD + "MetadataIndex", "metadata"))
        ist["fqn"] = fqn_map[ist["fqn"]][0]
        new_storage[idx.with_state(ist if not isinstance(idx.state, tuple) else (ist, {}))] = info
    st["state_dict_metadata"] = new_sdm
    st["storage_data"] = new_storage
    if isinstance(st.get("planner_data"), dict):
        new_planner = type(st["planner_data"])()
        for fqn, (nf, npath) in fqn_map.items():
            if fqn in st["planner_data"]:
                old = st["planner_data"][fqn]
                new_planner[nf] = type(old)(npath) if isinstance(old, (tuple, list)) else old
        st["planner_data"] = new_planner
    return root.with_state(st)


def dumps_metadata(tree: Any) -> bytes:
    """Pickle a metadata placeholder tree back, naming the original DCP globals (torch loads it).

    Args:
        tree: the placeholder tree.

    Returns:
        The pickle bytes (protocol 2, as torch writes them).
    """
    return dumps(tree, protocol=2, storages=False)
