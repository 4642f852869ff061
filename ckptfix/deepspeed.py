"""DeepSpeed ZeRO checkpoints (stage 1, 2 and 3): the fp32 model, torch-free, as byte ranges.

What ``deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint`` rebuilds, without torch
and without holding a partition in memory.  A ZeRO checkpoint folder (``ckpt_dir/`` with a ``latest``
file naming ``global_stepN/``, or ``global_stepN/`` itself) holds per data-parallel rank:

* ``*_model_states.pt``: ``module`` (buffers; 16-bit or 0-element placeholder weights), ``param_shapes``
  (one ordered ``{name: torch.Size}`` per param group), ``buffer_names``, ``shared_params``
  (``{tied name: name stored}``), frozen parameters;
* ``*_optim_states.pt``: ``optimizer_state_dict`` with ``zero_stage``, ``partition_count`` and this rank's
  fp32 master weights: ``single_partition_of_fp32_groups`` (stage 1/2: one flat partition per group)
  or ``fp32_flat_groups`` (stage 3).

The layout, as zero_to_fp32.py reads it:

* stage 1/2: per group, the ranks' partitions concatenated make the group's flat vector; the group's
  parameters follow each other in it in ``param_shapes`` order, each followed by its
  ``param_alignment_paddings`` entry when the checkpoint has one; the vector ends padded to a multiple
  of ``2 * world_size``;
* stage 3: every parameter is partitioned on its own: rank ``r`` holds elements
  ``[r * ceil(n / world), (r + 1) * ceil(n / world))`` of it (the last rank padded), the parameters
  following each other in every rank's concatenated flat groups.

Each output tensor is thus a list of byte ranges (:class:`Piece`) of the partition files, located with
ckptfix's zip reader; :func:`ckptfix.convert.zero.convert_zero` copies them straight into a safetensors
file (memory: one 8 MiB buffer) and :func:`zero_state_dict` reads them into torch tensors for
``load_anywhere``.  This module is the reader (and the dtype rounding both share); consolidating into
safetensors is an operation, in :mod:`ckptfix.convert.zero`.
"""

from __future__ import annotations

import math
import os
import re
import sys
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

from ckptfix.errors import (
    CheckpointNotFoundError,
    CkptfixError,
    CorruptCheckpointError,
    UnsupportedError,
    ZeroIncompleteError,
    ZeroMismatchError,
)
from ckptfix.fileio import CHUNK, Fds
from ckptfix.formats.safetensors_fmt import DTYPE_TO_ST
from ckptfix.pickles import ELEMENT_SIZE, Stub, TensorRecord

__all__ = [
    "Piece",
    "ZeroTensor",
    "ZeroCheckpoint",
    "find_zero_checkpoint",
    "read_zero_checkpoint",
    "describe",
    "summary",
    "read_pieces",
    "output_dtype",
    "convert_bytes",
    "zero_state_dict",
    "OUTPUT_DTYPES",
]

#: ``--dtype`` names -> ckptfix dtype names (zero_to_fp32's ``OUTPUT_DTYPE_NAMES``)
OUTPUT_DTYPES = {
    "fp32": "float32",
    "float32": "float32",
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
}
_FLOAT = {"float32", "float16", "bfloat16", "float64"}
_OPTIM_RE = re.compile(r"(?:.*_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_MODEL3_RE = re.compile(r"zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
_MODEL_RE = re.compile(r"mp_rank_(\d+)_model_states\.pt$")


def _natural(text: str) -> list[Any]:
    return [int(c) if c.isdigit() else c for c in re.split(r"(\d+)", text)]


@dataclass(frozen=True)
class Piece:
    """A byte range of a partition file: ``nbytes`` bytes of ``path`` from ``offset``."""

    path: str
    offset: int
    nbytes: int


@dataclass
class ZeroTensor:
    """One tensor of the consolidated state dict: its bytes as pieces of the partition files.

    Attributes:
        name: the state-dict name.
        dtype: the dtype of the bytes in the files (``float32`` for master weights).
        shape: the shape.
        pieces: the byte ranges, in order, that make the tensor (``numel * element size`` bytes).
        kind: ``"param"``, ``"frozen"`` or ``"buffer"``.
        upcast: a floating buffer that zero_to_fp32 returns as float32 (``.float()``).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    pieces: list[Piece]
    kind: str = "param"
    upcast: bool = False

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes in the files (``numel`` x the source element size)."""
        return self.numel * ELEMENT_SIZE[self.dtype]

    def out_dtype(self, dtype: str | None) -> str:
        """The dtype written: float32 for an upcast buffer, ``dtype`` for floating tensors when given.

        Args:
            dtype: the requested output dtype (ckptfix name) or None.

        Returns:
            The ckptfix dtype name.
        """
        d = "float32" if self.upcast else self.dtype
        if dtype is not None and d in _FLOAT:
            return dtype
        return d


@dataclass
class ZeroCheckpoint:
    """A DeepSpeed ZeRO checkpoint found on disk (:func:`find_zero_checkpoint`); read by :func:`read_zero_checkpoint`.

    Attributes:
        path: what the user gave (``ckpt_dir`` or the tag folder).
        tag: the tag folder's name (``global_step14``).
        tag_dir: the folder holding the partitions.
        model_files: the ``*_model_states.pt`` files, in rank order.
        optim_files: the ``*_optim_states.pt`` files, in rank order.
        stage, world_size, ds_version, train_dtype: filled by :func:`read_zero_checkpoint`.
        tensors: the state dict, in zero_to_fp32's order (buffers, frozen, trainable).
        shared: ``[(tied name, name stored)]``, as DeepSpeed reports them in ``shared_params``.
        extra: small facts kept as metadata (``global_steps``, ``ds_version`` ...).
    """

    path: str
    tag: str
    tag_dir: str
    model_files: list[str]
    optim_files: list[str]
    stage: int = 0
    world_size: int = 0
    ds_version: str | None = None
    train_dtype: str = "float32"
    tensors: list[ZeroTensor] = field(default_factory=list)
    shared: list[tuple[str, str]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    read: bool = False

    def names(self) -> list[str]:
        """Every state-dict name, in zero_to_fp32's order (tied names where it puts them)."""
        order = [t.name for t in self.tensors]
        have = set(order)
        for alias, target in self.shared:
            if target in have and alias not in have:
                order.append(alias)
                have.add(alias)
        return order

    def aliases(self) -> dict[str, str]:
        """``{tied name: stored name}`` of the shared parameters whose target exists (as zero_to_fp32 applies them:
        ``state_dict[tied] = state_dict[stored]``, in order)."""
        stored = {t.name for t in self.tensors}
        out: dict[str, str] = {}
        for alias, target in self.shared:
            if alias == target:
                continue
            if target in out:
                out[alias] = out[target]
            elif target in stored:
                out[alias] = target
        return {a: t for a, t in out.items() if a != t and t not in out}


# --------------------------------------------------------------------------- finding


def _zero_files(d: str) -> tuple[list[str], list[str]]:
    try:
        names = os.listdir(d)
    except OSError:
        return [], []
    optim = sorted((n for n in names if n.endswith("_optim_states.pt") and _OPTIM_RE.match(n)), key=_natural)
    model = sorted((n for n in names if n.endswith("_model_states.pt")), key=_natural)
    return [os.path.join(d, n) for n in model], [os.path.join(d, n) for n in optim]


def _tags(p: str) -> list[str]:
    """The subfolders of ``p`` that hold ZeRO optimizer partitions, in natural order."""
    try:
        names = os.listdir(p)
    except OSError:
        return []
    return sorted(
        (n for n in names if os.path.isdir(os.path.join(p, n)) and _zero_files(os.path.join(p, n))[1]), key=_natural
    )


def find_zero_checkpoint(path: str | os.PathLike, tag: str | None = None) -> ZeroCheckpoint | None:
    """Recognise a DeepSpeed ZeRO checkpoint folder (cheap: names only; nothing is unpickled).

    ``path`` may be the folder ``engine.save_checkpoint`` was given (``latest`` names the tag, unless
    ``tag`` says otherwise; without ``latest``, its only tag folder) or a tag folder (``global_stepN/``) itself.

    Args:
        path: a directory.
        tag: the tag folder to use instead of what ``latest`` names.

    Returns:
        The :class:`ZeroCheckpoint` (not yet read), or None when ``path`` is not a ZeRO checkpoint.

    Raises:
        CheckpointNotFoundError: ``latest`` (or ``tag``) names a folder that does not exist or holds no
            ZeRO partitions; no ``latest`` and several tag folders.
    """
    p = os.fspath(path)
    if not os.path.isdir(p):
        return None
    latest = os.path.join(p, "latest")
    if tag is None:
        model, optim = _zero_files(p)
        if optim and model:
            return ZeroCheckpoint(p, os.path.basename(os.path.abspath(p)), p, model, optim)
        if not os.path.isfile(latest):
            tags = _tags(p)
            if len(tags) == 1:  # no 'latest' (deleted, or not copied) but one tag folder: that one
                return find_zero_checkpoint(p, tags[0])
            if tags:
                raise CheckpointNotFoundError(
                    f"{p}: a DeepSpeed checkpoint folder without a 'latest' file and {len(tags)} tags "
                    f"({', '.join(tags[:8])}{' ...' if len(tags) > 8 else ''}); pick one with --tag"
                )
            return None
        try:
            with open(latest, encoding="utf-8", errors="replace") as f:
                tag = f.read(4096).strip()
        except OSError:
            return None
        if not tag or "\n" in tag or len(tag) > 255:
            return None
        if not os.path.isdir(os.path.join(p, tag)):
            tags = _tags(p)
            have = f"; tags present: {', '.join(tags)} (pick one with --tag)" if tags else ""
            raise CheckpointNotFoundError(
                f"{p}: 'latest' names tag {tag!r} but {os.path.join(p, tag)} does not exist (an interrupted or "
                f"moved save?){have}"
            )
        where = "'latest' names"
    else:
        where = "--tag names"
        if os.sep in tag or tag in ("", ".", ".."):
            raise CheckpointNotFoundError(f"{p}: --tag {tag!r} is not a folder name; pass e.g. --tag global_step14")
        if not os.path.isdir(os.path.join(p, tag)):
            raise CheckpointNotFoundError(f"{p}: --tag {tag!r}: {os.path.join(p, tag)} does not exist")
    tag_dir = os.path.join(p, tag)
    model, optim = _zero_files(tag_dir)
    if not optim or not model:
        what = "*_optim_states.pt" if not optim else "*_model_states.pt"
        raise CheckpointNotFoundError(
            f"{p}: {where} {tag!r} but {tag_dir} holds no {what} files (not a ZeRO checkpoint, or saved "
            "without its optimizer partitions: zero_to_fp32 needs them too)"
        )
    return ZeroCheckpoint(p, tag, tag_dir, model, optim)


# --------------------------------------------------------------------------- reading


def _read(path: str, what: str) -> Any:
    from ckptfix.formats import read_checkpoint

    try:
        return read_checkpoint(path)
    except CkptfixError as e:
        if isinstance(e, CorruptCheckpointError):
            raise CorruptCheckpointError(
                f"{path}: this ZeRO {what} cannot be read ({_first(e)}); it is truncated or corrupt: copy it "
                "again from where training saved it"
            ) from None
        raise


def _first(e: BaseException) -> str:
    s = str(e)
    return s.split(": ", 1)[1] if ": " in s else s


def _int(v: Any) -> Any:
    """A ZeroStageEnum placeholder (or a plain int) as an int; anything else unchanged."""
    if isinstance(v, Stub) and v.args and isinstance(v.args[0], int):
        return v.args[0]
    return v


def _shape(v: Any, path: str, name: str) -> tuple[int, ...]:
    if isinstance(v, Stub):
        v = v.args[0] if v.args else ()
    if isinstance(v, (tuple, list)) and all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in v):
        return tuple(v)
    raise CorruptCheckpointError(f"{path}: param_shapes[{name!r}] is not a shape ({v!r}); the checkpoint is corrupt")


def _pieces(rec: Any, path: str, what: str) -> tuple[str, int, int, str]:
    """(file, byte offset, element count, dtype) of a contiguous tensor record whose bytes are in ``path``."""
    if not isinstance(rec, TensorRecord) or rec.storage is None or rec.storage.file_offset is None:
        raise CorruptCheckpointError(f"{path}: {what} is not a tensor stored in the file; the checkpoint is corrupt")
    if not rec.is_contiguous():
        raise UnsupportedError(f"{path}: {what} is a strided view; DeepSpeed writes flat partitions")
    if rec.dtype not in DTYPE_TO_ST or rec.offset < 0:
        raise UnsupportedError(f"{path}: {what} is a {rec.dtype} tensor at offset {rec.offset}; not a ZeRO partition")
    es = rec.element_size
    start = rec.storage.file_offset + rec.offset * es
    if rec.storage.nbytes is not None and (rec.offset + rec.numel) * es > rec.storage.nbytes:
        raise CorruptCheckpointError(f"{path}: {what} runs past its storage; the partition is truncated or corrupt")
    return rec.storage.source or path, start, rec.numel, rec.dtype


class _Flat:
    """A virtual flat vector: segments (file, byte offset, elements) one after the other."""

    def __init__(self, dtype: str) -> None:
        self.segments: list[tuple[str, int, int]] = []
        self.starts: list[int] = []
        self.numel = 0
        self.dtype = dtype
        self.es = ELEMENT_SIZE[dtype]

    def add(self, path: str, offset: int, numel: int) -> None:
        self.starts.append(self.numel)
        self.segments.append((path, offset, numel))
        self.numel += numel

    def take(self, start: int, n: int) -> list[Piece]:
        """Pieces covering elements ``[start, start + n)``."""
        import bisect

        out: list[Piece] = []
        if n <= 0:
            return out
        i = max(0, bisect.bisect_right(self.starts, start) - 1)
        pos, left = start, n
        while left > 0:
            if i >= len(self.segments):
                raise CorruptCheckpointError("the partitions end before the parameters do")
            path, off, numel = self.segments[i]
            seg_start = self.starts[i]
            inside = pos - seg_start
            k = min(left, numel - inside)
            if k > 0:
                p = Piece(path, off + inside * self.es, k * self.es)
                if out and out[-1].path == p.path and out[-1].offset + out[-1].nbytes == p.offset:
                    out[-1] = Piece(p.path, out[-1].offset, out[-1].nbytes + p.nbytes)
                else:
                    out.append(p)
                pos += k
                left -= k
            i += 1
        return out


def _rank_of(path: str) -> tuple[int, int]:
    m = _OPTIM_RE.match(os.path.basename(path)) or _MODEL3_RE.search(os.path.basename(path))
    if m:
        return int(m.group(1)), int(m.group(2))
    m2 = _MODEL_RE.search(os.path.basename(path))
    return (0, int(m2.group(1))) if m2 else (0, 0)


def read_zero_checkpoint(zc: ZeroCheckpoint) -> ZeroCheckpoint:
    """Read the pickles of a ZeRO checkpoint (never the tensors) and lay out every output tensor's pieces.

    Args:
        zc: from :func:`find_zero_checkpoint`.

    Returns:
        ``zc``, with ``stage``, ``world_size``, ``tensors``, ``shared`` ... filled in.

    Raises:
        ZeroIncompleteError: a rank's optimizer partition is missing.
        ZeroMismatchError: partitions of different world sizes (or of another run) are mixed.
        CorruptCheckpointError: a truncated partition, or a layout that does not add up.
        UnsupportedError: tensor/pipeline parallel checkpoints (several ``mp_rank``), unknown stages.
    """
    if zc.read:
        return zc
    mp_ranks = {_rank_of(f)[1] for f in zc.optim_files}
    if len(mp_ranks) > 1:
        raise UnsupportedError(
            f"{zc.tag_dir}: a model-parallel ZeRO checkpoint ({len(mp_ranks)} mp ranks); zero_to_fp32 and ckptfix "
            "consolidate data-parallel partitions only: use DeepSpeed's ds_to_universal.py"
        )
    ranks = [_rank_of(f)[0] for f in zc.optim_files]
    optim_sds = []
    for f in zc.optim_files:
        cf = _read(f, "optimizer partition")
        osd = cf.obj.get("optimizer_state_dict") if isinstance(cf.obj, dict) else None
        if not isinstance(osd, dict) or "zero_stage" not in osd:
            raise CorruptCheckpointError(f"{f}: no optimizer_state_dict/zero_stage in it; not a ZeRO partition")
        optim_sds.append(osd)
    stage = _int(optim_sds[0]["zero_stage"])
    counts = []
    for f, osd in zip(zc.optim_files, optim_sds, strict=True):
        pc = _int(osd.get("partition_count"))
        ws = max(_int(x) for x in pc) if isinstance(pc, list) and pc else pc
        if not isinstance(ws, int) or ws < 1:
            raise CorruptCheckpointError(f"{f}: partition_count {pc!r} is not a world size; the partition is corrupt")
        counts.append(ws)
        if _int(osd["zero_stage"]) != stage:
            raise ZeroMismatchError(
                f"{zc.tag_dir}: {os.path.basename(f)} was saved with ZeRO stage {_int(osd['zero_stage'])}, "
                f"{os.path.basename(zc.optim_files[0])} with stage {stage}: files of two runs are mixed; "
                "keep one run's files in the folder"
            )
    if len(set(counts)) > 1:
        by = ", ".join(f"{os.path.basename(f)}: {c}" for f, c in zip(zc.optim_files, counts, strict=True))
        raise ZeroMismatchError(
            f"{zc.tag_dir}: the optimizer partitions were saved by runs of different world sizes ({by}); an "
            "old run's files are mixed in: keep only the files of the run you want (each rank's "
            "*_optim_states.pt and *_model_states.pt of one save)"
        )
    world = counts[0]
    want = set(range(world))
    if set(ranks) != want or len(ranks) != world:
        missing = sorted(want - set(ranks))
        extra = sorted(set(ranks) - want)
        if extra or len(ranks) > world:
            raise ZeroMismatchError(
                f"{zc.tag_dir}: {len(ranks)} optimizer partitions for a world size of {world} (ranks "
                f"{', '.join(map(str, extra or ranks))} do not belong to it); an old run's files are mixed in: "
                "keep only one run's files"
            )
        raise ZeroIncompleteError(
            f"{zc.tag_dir}: {len(ranks)} of {world} optimizer partitions; rank(s) "
            f"{', '.join(map(str, missing))} missing (e.g. zero_pp_rank_{missing[0]}_mp_rank_00_optim_states.pt): "
            "a rank did not finish saving, or a file was not copied; copy the missing file(s) from where training "
            "saved them"
        )
    if stage not in (0, 1, 2, 3):  # 0: DeepSpeed's BF16_Optimizer without ZeRO, laid out as 1/2 (as zero_to_fp32)
        raise UnsupportedError(f"{zc.tag_dir}: ZeRO stage {stage!r}; only stages 1, 2 and 3 hold fp32 partitions")

    # model states: stage 3 has one per rank, stage 1/2 one (mp_rank_00)
    if stage <= 2:
        model_files = [f for f in zc.model_files if _MODEL_RE.fullmatch(os.path.basename(f))]
    else:
        model_files = [f for f in zc.model_files if _MODEL3_RE.fullmatch(os.path.basename(f))]
        model_files.sort(key=lambda f: _rank_of(f)[0])
    if not model_files:
        raise CorruptCheckpointError(
            f"{zc.tag_dir}: no {'mp_rank_00' if stage <= 2 else 'zero_pp_rank_0_mp_rank_00'}_model_states.pt; "
            "the parameter shapes are in it: copy it from where training saved it"
        )
    if stage == 3 and len(model_files) != world:
        raise ZeroIncompleteError(
            f"{zc.tag_dir}: {len(model_files)} of {world} *_model_states.pt files of a ZeRO-3 checkpoint; copy the "
            "missing one(s) from where training saved them"
        )
    model_sds = []
    for f in model_files if stage == 3 else model_files[:1]:
        cf = _read(f, "model states file")
        if not isinstance(cf.obj, dict) or "buffer_names" not in cf.obj or "param_shapes" not in cf.obj:
            raise CorruptCheckpointError(f"{f}: no buffer_names/param_shapes in it; not a ZeRO model states file")
        model_sds.append((f, cf.obj))
    mf, msd = model_sds[0]
    zc.stage, zc.world_size = stage, world
    zc.ds_version = msd.get("ds_version") if isinstance(msd.get("ds_version"), str) else None
    module = msd.get("module") or {}
    buffer_names = set(msd.get("buffer_names") or ())
    tensors: list[ZeroTensor] = []
    dtypes: dict[str, int] = {}
    for name, rec in module.items():
        if isinstance(rec, TensorRecord):
            dtypes[rec.dtype] = dtypes.get(rec.dtype, 0) + 1
        if name not in buffer_names:
            continue
        path, off, numel, dt = _pieces(rec, mf, f"buffer {name!r}")
        tensors.append(
            ZeroTensor(
                str(name),
                dt,
                tuple(rec.shape),
                [Piece(path, off, numel * ELEMENT_SIZE[dt])],
                "buffer",
                upcast=dt in _FLOAT and dt != "float32",
            )
        )
    zc.train_dtype = _train_dtype(msd, dtypes)
    # frozen parameters
    frozen_shapes = msd.get("frozen_param_shapes") or {}
    for name, shp in frozen_shapes.items():
        shape = _shape(shp, mf, name)
        n = math.prod(shape)
        if stage <= 2:
            rec = (msd.get("frozen_param_fragments") or {}).get(name)
            path, off, numel, dt = _pieces(rec, mf, f"frozen parameter {name!r}")
            if numel < n:
                raise CorruptCheckpointError(f"{mf}: frozen parameter {name!r} has {numel} of {n} elements")
            tensors.append(ZeroTensor(str(name), dt, shape, [Piece(path, off, n * ELEMENT_SIZE[dt])], "frozen"))
        else:
            flat: _Flat | None = None
            for f, sd in model_sds:
                rec = (sd.get("frozen_param_fragments") or {}).get(name)
                path, off, numel, dt = _pieces(rec, f, f"frozen parameter {name!r}")
                flat = flat or _Flat(dt)
                flat.add(path, off, numel)
            assert flat is not None
            if flat.numel < n:
                raise CorruptCheckpointError(
                    f"{zc.tag_dir}: frozen parameter {name!r} has {flat.numel} of {n} elements"
                )
            tensors.append(ZeroTensor(str(name), flat.dtype, shape, flat.take(0, n), "frozen"))
    groups = msd["param_shapes"]
    if not isinstance(groups, list):
        raise CorruptCheckpointError(f"{mf}: param_shapes is not a list of groups; the checkpoint is corrupt")
    key = "single_partition_of_fp32_groups" if stage <= 2 else "fp32_flat_groups"
    per_rank = []
    for f, osd in zip(zc.optim_files, optim_sds, strict=True):
        g = osd.get(key)
        if not isinstance(g, list):
            raise CorruptCheckpointError(f"{f}: no {key} in it; not a ZeRO stage {stage} partition")
        per_rank.append([_pieces(r, f, f"{key}[{i}]") for i, r in enumerate(g)])
    if stage <= 2:
        tensors += _stage12(zc, groups, per_rank, optim_sds[0].get("param_alignment_paddings"), mf)
    else:
        tensors += _stage3(zc, groups, per_rank, mf)
    zc.tensors = tensors
    shared = msd.get("shared_params") or {}
    zc.shared = [(str(k), str(v)) for k, v in shared.items()] if isinstance(shared, dict) else []
    zc.extra = {
        k: msd[k]
        for k in ("global_steps", "global_samples", "skipped_steps", "dp_world_size", "ds_version")
        if isinstance(msd.get(k), (int, str)) and not isinstance(msd.get(k), bool)
    }
    zc.extra["zero_stage"] = stage
    zc.extra["tag"] = zc.tag
    zc.read = True
    return zc


def _train_dtype(msd: Mapping[str, Any], dtypes: Mapping[str, int]) -> str:
    cfg = msd.get("ds_config")
    if isinstance(cfg, dict):
        for k, name in (("bf16", "bfloat16"), ("bfloat16", "bfloat16"), ("fp16", "float16")):
            sec = cfg.get(k)
            if isinstance(sec, dict) and sec.get("enabled") is True:
                return name
    return max(dtypes, key=lambda d: dtypes[d]) if dtypes else "float32"


def _stage12(
    zc: ZeroCheckpoint, groups: list[Any], per_rank: list[list[tuple[str, int, int, str]]], paddings: Any, mf: str
) -> list[ZeroTensor]:
    out: list[ZeroTensor] = []
    n_groups = len(per_rank[0])
    if any(len(r) != n_groups for r in per_rank) or len(groups) != n_groups:
        raise ZeroMismatchError(
            f"{zc.tag_dir}: the partitions hold {[len(r) for r in per_rank]} param groups, param_shapes "
            f"{len(groups)}: files of different runs are mixed; keep one save's files"
        )
    align = 2 * zc.world_size
    for gi, shapes in enumerate(groups):
        dtype = per_rank[0][gi][3]
        flat = _Flat(dtype)
        for r in per_rank:
            path, off, numel, dt = r[gi]
            if dt != dtype:
                raise ZeroMismatchError(f"{zc.tag_dir}: group {gi} partitions are of dtypes {dtype} and {dt}")
            flat.add(path, off, numel)
        pads = None
        if isinstance(paddings, list) and gi < len(paddings) and paddings[gi] is not None:
            pads = paddings[gi]
            if not isinstance(pads, list) or len(pads) != len(shapes):
                raise CorruptCheckpointError(
                    f"{zc.tag_dir}: group {gi} has {len(shapes)} parameters but "
                    f"{len(pads) if isinstance(pads, list) else pads!r} alignment paddings; the checkpoint is corrupt"
                )
        offset = 0
        for pi, (name, shp) in enumerate(shapes.items()):
            shape = _shape(shp, mf, name)
            n = math.prod(shape)
            if offset + n > flat.numel:
                raise CorruptCheckpointError(
                    f"{zc.tag_dir}: parameter {name!r} (group {gi}) ends at element {offset + n} of a "
                    f"{flat.numel}-element group: the partitions do not hold the model (another run's files?)"
                )
            out.append(ZeroTensor(str(name), dtype, shape, flat.take(offset, n)))
            offset += n
            if pads is not None:
                offset += int(pads[pi])
        if align * math.ceil(offset / align) != align * math.ceil(flat.numel / align):
            raise CorruptCheckpointError(
                f"{zc.tag_dir}: group {gi}: the parameters use {offset} of {flat.numel} elements; the partitions "
                "do not match param_shapes (another run's files mixed in?)"
            )
    return out


def _stage3(
    zc: ZeroCheckpoint, groups: list[Any], per_rank: list[list[tuple[str, int, int, str]]], mf: str
) -> list[ZeroTensor]:
    world = zc.world_size
    dtype = per_rank[0][0][3] if per_rank[0] else "float32"
    flats = []
    for r in per_rank:
        flat = _Flat(dtype)
        for path, off, numel, dt in r:
            if dt != dtype:
                raise ZeroMismatchError(f"{zc.tag_dir}: flat groups of dtypes {dtype} and {dt}")
            flat.add(path, off, numel)
        flats.append(flat)
    if len({f.numel for f in flats}) > 1:
        raise ZeroMismatchError(
            f"{zc.tag_dir}: the ranks' partitions hold {[f.numel for f in flats]} elements; ZeRO-3 partitions are "
            "equal: files of different runs are mixed; keep one save's files"
        )
    out: list[ZeroTensor] = []
    offset = 0
    seen: set[str] = set()
    for shapes in groups:
        for name, shp in shapes.items():
            if name in seen:  # zero_to_fp32 merges the groups into one dict: a repeated name keeps its place
                continue
            seen.add(name)
            shape = _shape(shp, mf, name)
            n = math.prod(shape)
            part = math.ceil(n / world)
            if offset + part > flats[0].numel:
                raise CorruptCheckpointError(
                    f"{zc.tag_dir}: parameter {name!r} ends past the {flats[0].numel}-element partitions: they do "
                    "not hold the model (another run's files?)"
                )
            pieces: list[Piece] = []
            left = n
            for flat in flats:
                k = min(part, left)
                for p in flat.take(offset, k):
                    pieces.append(p)
                left -= k
                if left <= 0:
                    break
            out.append(ZeroTensor(str(name), dtype, shape, pieces))
            offset += part
    if offset != flats[0].numel:
        raise CorruptCheckpointError(
            f"{zc.tag_dir}: the parameters use {offset * world} of {flats[0].numel * world} elements; the partitions "
            "do not match param_shapes (another run's files mixed in?)"
        )
    return out


# --------------------------------------------------------------------------- describing


def summary(zc: ZeroCheckpoint) -> dict[str, Any]:
    """What ``inspect --json`` shows of a ZeRO checkpoint.

    Args:
        zc: a checkpoint (read on demand).

    Returns:
        framework, stage, world size, training dtype, tag, DeepSpeed version, tensors, parameters and bytes.
    """
    read_zero_checkpoint(zc)
    params = [t for t in zc.tensors if t.kind != "buffer"]
    return {
        "framework": "deepspeed",
        "layout": f"zero{zc.stage}",
        "tag": zc.tag,
        "tag_dir": zc.tag_dir,
        "stage": zc.stage,
        "world_size": zc.world_size,
        "train_dtype": zc.train_dtype,
        "ds_version": zc.ds_version,
        "tensors": len(zc.tensors),
        "aliases": zc.aliases(),
        "params": len(params),
        "param_values": sum(t.numel for t in params),
        "param_bytes": sum(t.nbytes for t in params),
        "frozen": sum(t.kind == "frozen" for t in zc.tensors),
        "buffers": len(zc.tensors) - len(params),
        "files": len(zc.model_files) + len(zc.optim_files),
        "partition_bytes": sum(os.path.getsize(f) for f in zc.optim_files),
    }


def describe(zc: ZeroCheckpoint) -> list[tuple[str, str]]:
    """Lines for ``inspect FOLDER``: ``(label, text)`` pairs.

    Args:
        zc: a checkpoint (read on demand).

    Returns:
        The lines: layout, partitions, weights, shared.
    """
    s = summary(zc)
    from ckptfix.text import human_bytes

    shared = ", ".join(f"{a} -> {t}" for a, t in s["aliases"].items()) or "-"
    return [
        ("framework", f"DeepSpeed ZeRO stage {s['stage']} (tag {s['tag']}, deepspeed {s['ds_version'] or '?'})"),
        ("partitions", f"{s['world_size']} rank(s), {s['files']} files, optimizer {human_bytes(s['partition_bytes'])}"),
        ("training", f"{s['train_dtype']} (fp32 master weights in the optimizer partitions)"),
        (
            "weights",
            f"{s['params']} parameters ({s['frozen']} frozen), {s['param_values']:,} values, "
            f"{human_bytes(s['param_bytes'])}; {s['buffers']} buffer(s)",
        ),
        ("shared", shared),
    ]


# --------------------------------------------------------------------------- dtype conversion


def _np() -> Any:
    try:
        import numpy

        return numpy
    except ImportError:  # pragma: no cover - numpy is optional
        return None


def convert_bytes(data: bytes | bytearray | memoryview, src: str, dst: str) -> bytes | bytearray | memoryview:
    """Elements of dtype ``src`` as ``dst``, rounded as torch's ``Tensor.to`` rounds (nearest even).

    Args:
        data: little-endian elements.
        src: ``float32``, ``bfloat16`` or ``float16``.
        dst: ``float32``, ``bfloat16`` or ``float16``.

    Returns:
        The converted bytes (``data`` itself when the dtypes are equal).

    Raises:
        UnsupportedError: another pair of dtypes.
    """
    if src == dst:
        return data
    np = _np()
    if np is not None:
        return _convert_np(np, data, src, dst)
    return _convert_py(bytes(data), src, dst)


def _convert_np(np: Any, data: Any, src: str, dst: str) -> bytes:
    if src == "bfloat16":
        a = (np.frombuffer(data, dtype="<u2").astype("<u4") << 16).view("<f4")
    elif src == "float16":
        a = np.frombuffer(data, dtype="<f2").astype("<f4")
    elif src == "float32":
        a = np.frombuffer(data, dtype="<f4")
    else:
        raise UnsupportedError(f"cannot convert {src} to {dst}")
    if dst == "float32":
        return bytes(a.astype("<f4").tobytes())
    if dst == "float16":
        with np.errstate(over="ignore", invalid="ignore"):
            return bytes(a.astype("<f2").tobytes())
    if dst == "bfloat16":
        u = a.view("<u4")
        r = ((u + (np.uint32(0x7FFF) + ((u >> 16) & 1))) >> 16).astype("<u2")
        r[np.isnan(a)] = 0xFFFF  # what torch's (vectorised) CPU kernel writes for any NaN
        return bytes(r.tobytes())
    raise UnsupportedError(f"cannot convert {src} to {dst}")


def _convert_py(data: bytes, src: str, dst: str) -> bytes:
    import array
    import struct

    if src == "bfloat16":
        h = array.array("H", data)
        if sys.byteorder != "little":
            h.byteswap()
        vals = list(struct.unpack(f"<{len(h)}f", array.array("I", (x << 16 for x in h)).tobytes()))
    elif src == "float16":
        vals = list(struct.unpack(f"<{len(data) // 2}e", data))
    elif src == "float32":
        vals = list(struct.unpack(f"<{len(data) // 4}f", data))
    else:
        raise UnsupportedError(f"cannot convert {src} to {dst}")
    if dst == "float32":
        return struct.pack(f"<{len(vals)}f", *vals)
    if dst == "float16":
        out = bytearray()
        for v in vals:
            try:
                out += struct.pack("<e", v)
            except (OverflowError, struct.error):
                out += b"\x00\x7c" if v > 0 else b"\x00\xfc"
        return bytes(out)
    if dst == "bfloat16":
        us = struct.unpack(f"<{len(vals)}I", struct.pack(f"<{len(vals)}f", *vals))
        halves = (
            0xFFFF if v != v else ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF for u, v in zip(us, vals, strict=True)
        )
        return struct.pack(f"<{len(us)}H", *halves)
    raise UnsupportedError(f"cannot convert {src} to {dst}")


# --------------------------------------------------------------------------- writing


def read_pieces(t: ZeroTensor, fds: Fds, chunk: int = CHUNK) -> Iterator[bytes]:
    """The tensor's source bytes in chunks of at most ``chunk`` bytes (whole elements).

    Args:
        t: a tensor of a read :class:`ZeroCheckpoint`.
        fds: the descriptors to read through.
        chunk: the most bytes per piece yielded.

    Yields:
        The bytes of ``t.pieces`` in order.

    Raises:
        CorruptCheckpointError: a partition file ends inside the tensor.
    """
    es = ELEMENT_SIZE[t.dtype]
    chunk -= chunk % es
    for p in t.pieces:
        fd = fds.get(p.path)
        off, left = p.offset, p.nbytes
        while left > 0:
            n = min(left, chunk)
            b = os.pread(fd, n, off)
            if len(b) != n:
                raise CorruptCheckpointError(
                    f"{p.path}: the file ends inside tensor {t.name!r} (truncated?); copy it again from where "
                    "training saved it"
                )
            yield b
            off += n
            left -= n


def output_dtype(dtype: str | None) -> str | None:
    """The ckptfix dtype name of a ``--dtype`` (``bf16`` -> ``bfloat16``); None keeps each tensor's own.

    Raises:
        UnsupportedError: an unknown name.
    """
    if dtype is None:
        return None
    name = dtype[6:] if dtype.startswith("torch.") else dtype
    try:
        return OUTPUT_DTYPES[name.lower()]
    except KeyError:
        raise UnsupportedError(
            f"--dtype {dtype!r}: choose one of fp32, bf16, fp16 (or float32, bfloat16, float16)"
        ) from None


def zero_state_dict(zc: ZeroCheckpoint, dtype: str | None = None) -> OrderedDict[str, Any]:
    """The consolidated state dict as torch tensors: what ``get_fp32_state_dict_from_zero_checkpoint`` returns.

    Shared parameters are the same tensor object under both names.  Needs torch.

    Args:
        zc: from :func:`find_zero_checkpoint`.
        dtype: as for :func:`ckptfix.convert.zero.convert_zero` (zero_to_fp32's ``to_torch_tensor(..., dtype)``).

    Returns:
        name -> CPU ``torch.Tensor``, in zero_to_fp32's order.

    Raises:
        TorchMissingError: torch is not installed; and as :func:`read_zero_checkpoint`.
    """
    from ckptfix._torch import require_torch

    torch = require_torch("load_anywhere on a DeepSpeed ZeRO checkpoint")
    out_dtype = output_dtype(dtype)
    read_zero_checkpoint(zc)
    fds = Fds()
    sd: OrderedDict[str, Any] = OrderedDict()
    try:
        for t in zc.tensors:
            od = t.out_dtype(out_dtype)
            buf = bytearray(t.numel * ELEMENT_SIZE[od])
            pos = 0
            src = "float32" if t.upcast else t.dtype
            for b in read_pieces(t, fds):
                if t.upcast:
                    b = bytes(convert_bytes(b, t.dtype, "float32"))
                c = convert_bytes(b, src, od)
                buf[pos : pos + len(c)] = c
                pos += len(c)
            tdt = getattr(torch, od)
            sd[t.name] = (torch.frombuffer(buf, dtype=tdt) if buf else torch.empty(0, dtype=tdt)).view(t.shape)
    finally:
        fds.close()
    for alias, target in zc.shared:
        if target in sd:
            sd[alias] = sd[target]
    return sd
