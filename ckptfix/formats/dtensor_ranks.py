"""FSDP per-rank DTensor files (one ``torch.save`` of ``model.state_dict()`` per rank), read and merged torch-free.

With FSDP2 (``fully_shard``) every parameter is a ``DTensor``: each rank's ``state_dict()`` holds its local shard,
its placements (``Shard(dim)`` / ``Replicate()`` per mesh dimension) and its device mesh.  Writers that
``torch.save`` that dict per rank, with no DCP ``.metadata`` beside it:

* accelerate's FSDP helpers without DCP (``SHARDED_STATE_DICT``/``LOCAL_STATE_DICT``, ``use_dcp=False``):
  ``pytorch_model_fsdp_{i}_rank{R}.bin`` (``pytorch_model_fsdp_rank{R}.bin`` for model 0 in older releases) and
  ``optimizer_{i}_rank{R}.bin``;
* verl's FSDP checkpoint manager: ``model_world_size_{N}_rank_{R}.pt`` and ``optim_world_size_{N}_rank_{R}.pt``.

:func:`find_dtensor_ranks` tells such a folder from its names; :func:`read_dtensor_ranks` reads every rank's
pickle with the restricted reader (nothing is executed) and lays out each full tensor from the shards'
placements and mesh coordinates exactly as ``DTensor.full_tensor()`` gathers them: ``Shard(d)`` splits as
``torch.chunk`` does (an uneven last shard, empty shards past the end), nested over mesh dimensions in the
``shard_order`` recorded, ``Replicate()`` keeps one copy; every element is checked to come from exactly one
shard (by positions, :func:`ckptfix.formats.dcp.meta.check_tiling`).  ``_StridedShard`` (FSDP2 over tensor
parallelism) and ``Partial`` are refused by name.  The result is the same chunk layout as torch's
HuggingFaceStorageWriter (:mod:`ckptfix.formats.hfstorage`): the writer of :mod:`ckptfix.ops.convert.hfstorage`
streams it into one safetensors file, :func:`dtensor_state_dict` builds torch tensors for ``load_anywhere``.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

from ckptfix.errors import CorruptCheckpointError, UnsupportedError, ZeroIncompleteError, ZeroMismatchError
from ckptfix.files import pins
from ckptfix.formats.hfstorage import _Chunk, _Tensor
from ckptfix.formats.safetensors_fmt import DTYPE_TO_ST

__all__ = [
    "DTensorRanks",
    "RankGroup",
    "find_dtensor_ranks",
    "read_dtensor_ranks",
    "describe",
    "dtensor_shards",
    "one_rank_message",
    "dtensor_state_dict",
    "is_dtensor",
]

#: (group, regex): the model files and the optimizer files, accelerate's and verl's names
_PATTERNS: list[tuple[str, re.Pattern[str]]] = [
    ("model", re.compile(r"pytorch_model_fsdp(?:_(?P<i>\d+))?_rank(?P<r>\d+)\.bin$")),
    ("optimizer", re.compile(r"optimizer(?:_(?P<i>\d+))?_rank(?P<r>\d+)\.bin$")),
    ("model", re.compile(r"model_world_size_(?P<n>\d+)_rank_(?P<r>\d+)\.pt$")),
    ("optimizer", re.compile(r"optim_world_size_(?P<n>\d+)_rank_(?P<r>\d+)\.pt$")),
]
_DT = "torch.distributed.tensor."


@dataclass
class RankGroup:
    """One state dict saved per rank: ``files[r]`` is rank ``r``'s file."""

    kind: str  # "model" or "optimizer"
    index: int  # accelerate's model index (0 for verl)
    files: dict[int, str]
    world: int | None = None  # the world size the names say (verl), else from the meshes
    tensors: list[_Tensor] = field(default_factory=list)
    plain: dict[str, Any] = field(default_factory=dict)  # rank 0's non-tensor entries, by name path

    @property
    def label(self) -> str:
        return f"{self.kind} {self.index}" if self.kind == "model" and self.index else self.kind


@dataclass
class DTensorRanks:
    """A folder of per-rank DTensor files (:func:`find_dtensor_ranks`).

    Attributes:
        path: the folder.
        groups: the model group(s) first (by model index), then the optimizer group(s).
        read: :func:`read_dtensor_ranks` ran.
    """

    path: str
    groups: list[RankGroup]
    read: bool = False

    @property
    def model(self) -> RankGroup:
        return self.groups[0]

    @property
    def files(self) -> list[str]:
        """The model's files, in rank order (what convert reads)."""
        return [self.model.files[r] for r in sorted(self.model.files)]

    @property
    def tensors(self) -> list[_Tensor]:
        return self.model.tensors

    def others(self, kind: str) -> list[RankGroup]:
        return [g for g in self.groups[1:] if g.kind == kind]


def _match(name: str) -> tuple[str, int, int, int | None] | None:
    for kind, rx in _PATTERNS:
        m = rx.match(name)
        if m:
            d = m.groupdict()
            return kind, int(d.get("i") or 0), int(d["r"]), int(d["n"]) if d.get("n") else None
    return None


def find_dtensor_ranks(path: str | os.PathLike) -> DTensorRanks | None:
    """Recognise a folder of per-rank FSDP state dicts (names only; nothing is read).

    Args:
        path: a directory.

    Returns:
        The folder's groups (not read yet), or None: no ``pytorch_model_fsdp*_rank*.bin`` /
        ``model_world_size_*_rank_*.pt`` in it, or a DCP ``.metadata`` beside them.
    """
    p = os.fspath(path)
    if not os.path.isdir(p) or os.path.exists(os.path.join(p, ".metadata")):
        return None
    try:
        names = sorted(os.listdir(p))
    except OSError:
        return None
    groups: dict[tuple[str, int], RankGroup] = {}
    for n in names:
        m = _match(n)
        if m is None or not os.path.isfile(os.path.join(p, n)):
            continue
        kind, idx, rank, world = m
        g = groups.setdefault((kind, idx), RankGroup(kind, idx, {}, world))
        if rank in g.files or (world is not None and g.world not in (None, world)):
            raise ZeroMismatchError(
                f"{p}: two {kind} files of rank {rank} ({os.path.basename(g.files.get(rank, n))}, {n}) or "
                "names of different world sizes; keep the files of one save"
            )
        g.files[rank] = os.path.join(p, n)
    models = sorted((g for g in groups.values() if g.kind == "model"), key=lambda g: g.index)
    if not models:
        return None
    rest = sorted((g for g in groups.values() if g.kind != "model"), key=lambda g: g.index)
    return DTensorRanks(p, models + rest)


def is_dtensor(v: Any) -> bool:
    """Whether a record the restricted reader made is a ``DTensor`` (``_rebuild_wrapper_subclass`` of it)."""
    from ckptfix.pickles import TensorRecord

    if not isinstance(v, TensorRecord) or v.kind != "subclass":
        return False
    a = v.reduce_args
    return isinstance(a, tuple) and len(a) >= 2 and _qual(a[1]) == _DT + "DTensor"


def _qual(x: Any) -> str:
    from ckptfix.pickles import Stub
    from ckptfix.pickles.stub import global_name

    if isinstance(x, type) and issubclass(x, Stub):
        return global_name(x)
    if isinstance(x, Stub):
        return global_name(type(x))
    return ""


def _fields(x: Any) -> Mapping[str, Any]:
    st = getattr(x, "state", None)
    if isinstance(st, tuple) and len(st) == 2 and (st[0] is None or isinstance(st[0], dict)):
        merged = dict(st[0] or {})
        merged.update(st[1] or {})
        return merged
    return st if isinstance(st, Mapping) else {}


@dataclass
class _Shard:
    """One DTensor's local piece on one rank, and where it sits in the full tensor."""

    dtype: str
    shape: tuple[int, ...]  # the full tensor's
    placements: list[tuple[str, int]]  # ("shard", dim) / ("replicate", -1) per mesh dim
    order: list[tuple[int, tuple[int, ...]]]  # (tensor dim, mesh dims in sharding order)
    mesh: tuple[int, ...]
    coord: tuple[int, ...]
    rank: int | None
    local: Any  # the local TensorRecord

    def box(self, coord: tuple[int, ...] | None = None) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(offsets, sizes) in the full tensor of the piece at mesh coordinate ``coord`` (default: this rank's)."""
        c = self.coord if coord is None else coord
        offs, sizes = [0] * len(self.shape), list(self.shape)
        for tdim, mdims in self.order:
            for md in mdims:  # torch.chunk's split, nested over the mesh dims in order
                n, k, size = self.mesh[md], c[md], sizes[tdim]
                full = -(-size // n) if size % n else size // n
                start = min(size, full * k)
                sizes[tdim] = max(0, min(size, start + full) - start)
                offs[tdim] += start
        return tuple(offs), tuple(sizes)


def _dtensor_shard(v: Any, where: str) -> _Shard:
    """A DTensor record's local tensor, placements, mesh and coordinate (refusals name the placement)."""
    from ckptfix.pickles import TensorRecord, stub_dtype

    a = v.reduce_args
    args = a[2] if len(a) > 2 and isinstance(a[2], tuple) else ()
    state = a[3] if len(a) > 3 else None
    slots: Mapping[str, Any] = {}
    if isinstance(state, tuple) and len(state) == 2:
        slots = (
            {**(state[0] or {}), **(state[1] or {})} if all(isinstance(s, (dict, type(None))) for s in state) else {}
        )
    elif isinstance(state, dict):
        slots = state
    local, spec = slots.get("_local_tensor"), slots.get("_spec")
    if not isinstance(local, TensorRecord) or local.kind != "dense" or local.storage is None:
        raise CorruptCheckpointError(f"{where}: a DTensor without its local tensor; the file is corrupt")
    sp = _fields(spec)
    mesh, placements = sp.get("mesh"), sp.get("placements")
    if not isinstance(placements, (tuple, list)) or not placements:
        raise CorruptCheckpointError(f"{where}: a DTensor without placements; the file is corrupt")
    shape: tuple[int, ...] | None = None
    if len(args) > 2 and isinstance(args[2], (tuple, list)) and all(type(x) is int for x in args[2]):
        shape = tuple(args[2])
    dtype = stub_dtype(args[1]) if len(args) > 1 else None
    if shape is None or dtype is None:
        raise CorruptCheckpointError(f"{where}: a DTensor without its global shape or dtype; the file is corrupt")
    pl: list[tuple[str, int]] = []
    for p in placements:
        q = _qual(p)
        if q.endswith("placement_types.Replicate"):
            pl.append(("replicate", -1))
        elif q.endswith("placement_types.Shard"):
            d = _fields(p).get("dim")
            if type(d) is not int or not -len(shape) <= d < len(shape):
                raise CorruptCheckpointError(
                    f"{where}: Shard(dim={d!r}) of a {len(shape)}-d tensor; the file is corrupt"
                )
            pl.append(("shard", d % len(shape)))
        else:
            kind = q.rsplit(".", 1)[-1] or type(p).__name__
            why = (
                "FSDP2 over tensor parallelism interleaves its shards"
                if kind == "_StridedShard"
                else "its values must be summed across ranks"
                if kind == "Partial"
                else "a placement ckptfix does not know"
            )
            raise UnsupportedError(
                f"{where}: a DTensor placed as {kind} ({why}); ckptfix merges Shard(dim) and Replicate() only — "
                "gather it in torch (DTensor.full_tensor() on every rank) and save that"
            )
    m = _fields(mesh)
    coord = m.get("_coordinate_on_dim")
    sizes = _mesh_sizes(m)
    if not isinstance(coord, (tuple, list)) or sizes is None or len(coord) != len(pl) or len(sizes) != len(pl):
        raise UnsupportedError(
            f"{where}: a DTensor whose device mesh does not say this rank's coordinates (a mesh of "
            f"{len(pl)} dims); ckptfix merges meshes saved by torch 2.4 and later — gather it in torch"
        )
    if any(type(c) is not int or not 0 <= c < s for c, s in zip(coord, sizes, strict=True)):
        raise CorruptCheckpointError(f"{where}: mesh coordinate {list(coord)} outside a mesh of {list(sizes)}")
    order = _shard_order(sp.get("shard_order"), pl, where)
    rank = m.get("_rank")
    if local.dtype != dtype:
        raise CorruptCheckpointError(f"{where}: the local shard is {local.dtype}, the DTensor {dtype}; corrupt")
    return _Shard(dtype, shape, pl, order, tuple(sizes), tuple(coord), rank if type(rank) is int else None, local)


def _mesh_sizes(m: Mapping[str, Any]) -> list[int] | None:
    """The size of each mesh dimension: ``_layout``'s axes (torch >= 2.10) or the ``mesh`` tensor's shape."""
    from ckptfix.pickles import TensorRecord

    mt = m.get("mesh")
    if isinstance(mt, TensorRecord):
        return [int(x) for x in mt.shape]
    axes = _fields(m.get("_layout")).get("axes")
    if isinstance(axes, (tuple, list)):
        out = []
        for ax in axes:
            shp = _fields(ax).get("shape")
            if not isinstance(shp, (tuple, list)) or not all(type(x) is int and x > 0 for x in shp):
                return None
            out.append(math.prod(shp))
        return out
    return None


def _shard_order(raw: Any, pl: list[tuple[str, int]], where: str) -> list[tuple[int, tuple[int, ...]]]:
    """(tensor dim, mesh dims) in the order the tensor dim is split; the placements' order when none is saved."""
    default: dict[int, list[int]] = {}
    for md, (kind, d) in enumerate(pl):
        if kind == "shard":
            default.setdefault(d, []).append(md)
    if not raw:
        return [(d, tuple(mds)) for d, mds in sorted(default.items())]
    out: list[tuple[int, tuple[int, ...]]] = []
    for e in raw:
        args = getattr(e, "args", None) or _fields(e).get("_args") or ()
        if not (isinstance(args, tuple) and len(args) == 2 and type(args[0]) is int and isinstance(args[1], tuple)):
            raise CorruptCheckpointError(f"{where}: an unreadable shard_order entry; the file is corrupt")
        out.append((args[0], tuple(int(x) for x in args[1])))
    if sorted((d, tuple(sorted(m))) for d, m in out) != sorted((d, tuple(m)) for d, m in default.items()):
        raise CorruptCheckpointError(f"{where}: its shard_order does not match its placements; the file is corrupt")
    return out


def _walk(obj: Any, path: tuple[str, ...] = (), depth: int = 0) -> Iterator[tuple[tuple[str, ...], Any]]:
    """Every leaf of nested mappings/lists, with its path (names as strings)."""
    if depth < 8 and isinstance(obj, Mapping):
        for k, v in obj.items():
            yield from _walk(v, path + (str(k),), depth + 1)
    elif depth < 8 and isinstance(obj, (list, tuple)) and any(isinstance(x, (Mapping, list, tuple)) for x in obj):
        for i, v in enumerate(obj):
            yield from _walk(v, path + (str(i),), depth + 1)
    else:
        yield path, obj


def _file_for(g: RankGroup, rank: int, folder: str) -> str:
    if g.files:
        some = os.path.basename(next(iter(g.files.values())))
        m = _match(some)
        if m is not None:
            r0 = m[2]
            return re.sub(rf"rank_?{r0}(\.\w+)$", lambda x: x.group(0).replace(str(r0), str(rank)), some)
    return f"rank {rank}"


def _read_group(dr: DTensorRanks, g: RankGroup) -> None:
    from ckptfix.formats import read_checkpoint
    from ckptfix.formats.dcp.meta import Chunk, TensorEntry, check_tiling
    from ckptfix.pickles import TensorRecord

    pieces: dict[str, list[tuple[int, _Shard]]] = {}
    order: list[str] = []
    plain: dict[str, tuple[Any, int]] = {}
    for rank in sorted(g.files):
        f = g.files[rank]
        cf = read_checkpoint(f)
        for path, v in _walk(cf.obj):
            name = ".".join(path)
            if is_dtensor(v):
                s = _dtensor_shard(v, f"{f}: tensor {name!r}")
                if s.rank is not None and s.rank != rank:
                    raise ZeroMismatchError(
                        f"{f}: holds rank {s.rank}'s shard of {name!r}, but its name says rank {rank} (a file "
                        "copied over another's); copy every rank's own file"
                    )
                if name not in pieces:
                    pieces[name] = []
                    order.append(name)
                pieces[name].append((rank, s))
            elif isinstance(v, TensorRecord) and name not in plain:
                plain[name] = (v, rank)
                if name not in pieces:
                    order.append(name)
            elif name not in plain and name not in pieces and rank == min(g.files):
                g.plain[name] = v
    meshes = [math.prod(ps[0][1].mesh) for ps in pieces.values()]
    world = g.world if g.world is not None else meshes[0] if meshes else max(g.files) + 1
    missing = [r for r in range(world) if r not in g.files]
    if missing:
        names = ", ".join(_file_for(g, r, dr.path) for r in missing[:4])
        raise ZeroIncompleteError(
            f"{dr.path}: the {g.label} file(s) of rank(s) {', '.join(map(str, missing[:8]))} of {world} are "
            f"missing ({names}); every rank saved its own shards: copy all {world} files"
        )
    extra = sorted(r for r in g.files if r >= world)
    if extra:
        raise ZeroMismatchError(
            f"{dr.path}: {g.label} file(s) of rank(s) {extra} beside a save of {world} ranks "
            f"({os.path.basename(g.files[extra[0]])}); keep the files of one save"
        )
    tensors: list[_Tensor] = []
    for name in order:
        if name not in pieces:
            rec, rank = plain[name]
            tensors.append(_plain_tensor(name, rec, g.files[rank]))
            continue
        shards = pieces[name]
        first = shards[0][1]
        size = math.prod(first.mesh)
        if size != world:
            raise ZeroMismatchError(
                f"{dr.path}: {name!r} is sharded over a mesh of {size} ranks, the folder holds {world} {g.label} "
                "file(s); copy the files of one save, every rank's"
            )
        if len(shards) != len(g.files):
            have = sorted(r for r, _ in shards)
            lost = sorted(set(g.files) - set(have))
            raise CorruptCheckpointError(
                f"{dr.path}: tensor {name!r} is missing from rank(s) {lost} ({_file_for(g, lost[0], dr.path)}); "
                "the files come from different saves"
            )
        if name in plain:
            raise CorruptCheckpointError(f"{dr.path}: {name!r} is a DTensor on some ranks and plain on others")
        t = _Tensor(name, _st(first.dtype, name), list(first.shape))
        boxes: dict[tuple, tuple[int, _Shard]] = {}
        for rank, s in shards:
            if (s.dtype, s.shape, s.placements, s.mesh) != (first.dtype, first.shape, first.placements, first.mesh):
                raise CorruptCheckpointError(
                    f"{g.files[rank]}: tensor {name!r} is {s.dtype} {list(s.shape)} on {s.placements}, rank "
                    f"{shards[0][0]}'s {first.dtype} {list(first.shape)} on {first.placements}; files of "
                    "different saves"
                )
            offs, sizes = s.box()
            if tuple(s.local.shape) != sizes:
                raise CorruptCheckpointError(
                    f"{g.files[rank]}: tensor {name!r}: the local shard is {list(s.local.shape)}, its placements "
                    f"{s.placements} on mesh {list(s.mesh)} at {list(s.coord)} make it {list(sizes)}; corrupt"
                )
            if (offs, sizes) in boxes:  # a replica (Replicate() on some mesh dim): one copy is the tensor's
                continue
            boxes[(offs, sizes)] = (rank, s)
            t.chunks.append(_local_chunk(g.files[rank], name, s, offs, sizes))
        entry = TensorEntry(name, first.dtype, first.shape, [Chunk(tuple(c.offsets), tuple(c.sizes)) for c in t.chunks])
        check_tiling(
            entry,
            f"{dr.path}: tensor {name!r} ({list(first.shape)}); a rank's file is missing or copied from another's "
            f"(copy every {g.label} file the ranks wrote)",
        )
        tensors.append(t)
    g.tensors = tensors


def _st(dtype: str, name: str) -> str:
    st = DTYPE_TO_ST.get(dtype)
    if st is None:
        raise UnsupportedError(f"tensor {name!r} has dtype {dtype}, which safetensors cannot store")
    return st


def _local_chunk(path: str, name: str, s: _Shard, offs: tuple[int, ...], sizes: tuple[int, ...]) -> _Chunk:
    from ckptfix.pickles import is_c_contiguous

    rec = s.local
    st = rec.storage
    if st.file_offset is None or st.source is None:
        raise UnsupportedError(f"{path}: tensor {name!r}: its local shard's bytes cannot be located in the file")
    if math.prod(sizes) and not is_c_contiguous(tuple(rec.shape), tuple(rec.stride)):
        raise UnsupportedError(
            f"{path}: tensor {name!r}: a non-contiguous local shard (a transposed view); save "
            "contiguous shards (FSDP2 does) or gather it in torch"
        )
    es = rec.element_size
    end = (rec.offset + math.prod(sizes)) * es
    if math.prod(sizes) and end > st.nbytes:
        raise CorruptCheckpointError(f"{path}: tensor {name!r}: its shard runs past its storage; corrupt")
    return _Chunk(path, st.file_offset + rec.offset * es, list(offs), list(sizes))


def _plain_tensor(name: str, rec: Any, path: str) -> _Tensor:
    """A tensor every rank holds whole (a buffer, an optimizer's ``step``): the first rank's copy."""
    from ckptfix.pickles import is_c_contiguous

    st = rec.storage
    if rec.kind != "dense" or st is None or st.file_offset is None:
        raise UnsupportedError(f"{path}: entry {name!r} is a {rec.kind} tensor; safetensors stores dense tensors only")
    n = math.prod(rec.shape)
    if n and not is_c_contiguous(tuple(rec.shape), tuple(rec.stride)):
        raise UnsupportedError(f"{path}: tensor {name!r} is a non-contiguous view; ckptfix merges contiguous ones")
    es = rec.element_size
    if n and (rec.offset + n) * es > st.nbytes:
        raise CorruptCheckpointError(f"{path}: tensor {name!r} runs past its storage; corrupt")
    t = _Tensor(name, _st(rec.dtype, name), list(rec.shape))
    t.chunks.append(_Chunk(path, st.file_offset + rec.offset * es, [0] * len(rec.shape), list(rec.shape)))
    return t


def read_dtensor_ranks(dr: DTensorRanks, kinds: tuple[str, ...] = ("model",)) -> DTensorRanks:
    """Read the rank files of the groups of ``kinds``; lay out every full tensor from its shards.

    Args:
        dr: from :func:`find_dtensor_ranks`.
        kinds: ``("model",)``, or ``("model", "optimizer")`` to merge the optimizer's too.

    Returns:
        ``dr`` with each such group's ``tensors`` (the state dict's order) and ``plain`` (rank 0's non-tensor
        entries) filled.

    Raises:
        ZeroIncompleteError: a rank's file is missing (named).  ZeroMismatchError: a file holds another rank's
        shards, or the mesh is not the folder's world size.  CorruptCheckpointError: shards that do not tile their
        tensor, disagree, or run past their file.  UnsupportedError: ``_StridedShard``/``Partial`` placements, a
        mesh without coordinates, a dtype safetensors has no code for.
    """
    for g in dr.groups:
        if g.kind in kinds and not g.tensors:
            _read_group(dr, g)
    dr.read = True
    return dr


def describe(dr: DTensorRanks) -> list[tuple[str, str]]:
    """Lines for ``inspect FOLDER``: ``(label, text)`` pairs (reads the model's rank files on demand).

    Args:
        dr: from :func:`find_dtensor_ranks`.

    Returns:
        framework, shards, weights and the other groups.
    """
    from ckptfix.formats.safetensors_fmt import ST_TO_DTYPE
    from ckptfix.text import human_bytes

    read_dtensor_ranks(dr)
    g = dr.model
    dtypes: dict[str, int] = {}
    for t in g.tensors:
        dtypes[ST_TO_DTYPE[t.st_dtype]] = dtypes.get(ST_TO_DTYPE[t.st_dtype], 0) + 1
    n = sum(math.prod(t.shape) for t in g.tensors)
    lines = [
        (
            "framework",
            "FSDP per-rank state dicts (DTensor shards, no DCP .metadata): merged from each shard's placements",
        ),
        ("shards", f"{len(g.files)} rank file(s), {human_bytes(sum(pins.fstat(f).st_size for f in dr.files))}"),
        (
            "weights",
            f"{len(g.tensors)} tensors, {n:,} values, {human_bytes(sum(t.nbytes for t in g.tensors))}; "
            + ", ".join(f"{d} x{c}" for d, c in sorted(dtypes.items())),
        ),
    ]
    for o in dr.groups[1:]:
        lines.append((o.label, f"{len(o.files)} rank file(s) ({os.path.basename(o.files[min(o.files)])} ...)"))
    return lines


def dtensor_shards(obj: Any) -> tuple[int, int | None, int | None] | None:
    """How many DTensor shards a single file's object holds, and of which rank of how many.

    Args:
        obj: the object the restricted reader made of one file.

    Returns:
        ``(shards, rank, world)`` (rank/world None when the mesh does not say), or None: no DTensor in it.
    """
    count, rank, world = 0, None, None
    for _, v in _walk(obj):
        if not is_dtensor(v):
            continue
        count += 1
        if rank is None:
            try:
                s = _dtensor_shard(v, "")
            except (CorruptCheckpointError, UnsupportedError):
                continue
            rank, world = s.rank, math.prod(s.mesh)
    return (count, rank, world) if count else None


def one_rank_message(path: str, obj: Any) -> str | None:
    """The refusal for one rank's file of DTensor shards passed alone (None: the object holds none).

    Args:
        path: the file.
        obj: what the restricted reader made of it.

    Returns:
        One line naming the folder to pass instead.
    """
    got = dtensor_shards(obj)
    if got is None:
        return None
    n, rank, world = got
    of = f" of rank {rank} of {world}" if rank is not None else ""
    return (
        f"{path}: {n} DTensor shard(s){of} (an FSDP per-rank state dict: only this rank's pieces); pass the "
        f"folder with every rank's file to merge them: ckptfix convert {os.path.dirname(path) or '.'}"
    )


def dtensor_state_dict(dr: DTensorRanks) -> dict[str, Any]:
    """The merged model tensors as torch tensors (for ``load_anywhere``).  Needs torch.

    Args:
        dr: from :func:`find_dtensor_ranks`.

    Returns:
        name -> CPU tensor, in the state dict's order.
    """
    from ckptfix.formats.hfstorage import tensors_of

    read_dtensor_ranks(dr)
    return tensors_of(dr.tensors, "load_anywhere on a folder of FSDP rank files")
