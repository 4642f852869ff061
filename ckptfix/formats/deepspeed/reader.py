"""Reading a ZeRO checkpoint's pickles (never its tensors) and laying out every output tensor's byte ranges.

Stage 1/2 and stage 3 layouts as zero_to_fp32.py reads them (see :mod:`ckptfix.formats.deepspeed`).
"""

from __future__ import annotations

import itertools
import math
import os
from typing import Any, Mapping

from ckptfix.errors import (
    CkptfixError,
    CorruptCheckpointError,
    UnsupportedError,
    ZeroIncompleteError,
    ZeroMismatchError,
)
from ckptfix.formats.deepspeed.layout import (
    FLOAT_DTYPES,
    MODEL3_RE,
    MODEL_RE,
    OPTIM_RE,
    Piece,
    ZeroCheckpoint,
    ZeroTensor,
)
from ckptfix.formats.safetensors_fmt import DTYPE_TO_ST
from ckptfix.pickles import ELEMENT_SIZE, Stub, TensorRecord

# --------------------------------------------------------------------------- reading


def _read(path: str, what: str) -> Any:
    from ckptfix.formats import read_checkpoint
    from ckptfix.formats.zipfmt import big_endian_parts

    try:
        cf = read_checkpoint(path)
    except CkptfixError as e:
        if isinstance(e, CorruptCheckpointError):
            raise CorruptCheckpointError(
                f"{path}: this ZeRO {what} cannot be read ({_first(e)}); it is truncated or corrupt: copy it "
                "again from where training saved it"
            ) from None
        raise
    if big_endian_parts(cf):  # the partitions are copied as raw bytes: never in the wrong order
        raise UnsupportedError(
            f"{path}: this ZeRO {what} has big-endian storages (byteorder 'big', saved on a big-endian machine); "
            "ckptfix consolidates little-endian ZeRO folders only: run DeepSpeed's zero_to_fp32.py on it"
        )
    return cf


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
    m = OPTIM_RE.match(os.path.basename(path)) or MODEL3_RE.search(os.path.basename(path))
    if m:
        return int(m.group(1)), int(m.group(2))
    m2 = MODEL_RE.search(os.path.basename(path))
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
    have = set(ranks)
    if len(have) < len(ranks):  # two files of one rank (zero_pp_rank_0_... and bf16_zero_pp_rank_0_..., or rank_00)
        seen: dict[int, str] = {}
        for f, r in zip(zc.optim_files, ranks, strict=True):
            if r in seen:
                raise ZeroMismatchError(
                    f"{zc.tag_dir}: {seen[r]} and {os.path.basename(f)} are both rank {r}'s optimizer partition; "
                    "files of two saves (or two optimizers) are mixed: keep one file per rank"
                )
            seen[r] = os.path.basename(f)
    if world != len(ranks) or any(not 0 <= r < world for r in have):
        # (never a set of range(world): partition_count is the file's word, 2**40 in a hostile one)
        extra = sorted(r for r in have if not 0 <= r < world)
        missing = list(itertools.islice((r for r in range(world) if r not in have), 5)) if world > len(have) else []
        if extra or len(ranks) > world:
            raise ZeroMismatchError(
                f"{zc.tag_dir}: {len(ranks)} optimizer partitions for a world size of {world} (ranks "
                f"{', '.join(map(str, extra or ranks))} do not belong to it); an old run's files are mixed in: "
                "keep only one run's files"
            )
        more = " ..." if world - len(have) > len(missing) else ""
        raise ZeroIncompleteError(
            f"{zc.tag_dir}: {len(ranks)} of {world} optimizer partitions; rank(s) "
            f"{', '.join(map(str, missing))}{more} missing "
            f"(e.g. zero_pp_rank_{missing[0]}_mp_rank_00_optim_states.pt): "
            "a rank did not finish saving, or a file was not copied; copy the missing file(s) from where training "
            "saved them"
        )
    if stage not in (0, 1, 2, 3):  # 0: DeepSpeed's BF16_Optimizer without ZeRO, laid out as 1/2 (as zero_to_fp32)
        raise UnsupportedError(f"{zc.tag_dir}: ZeRO stage {stage!r}; only stages 1, 2 and 3 hold fp32 partitions")

    # model states: stage 3 has one per rank, stage 1/2 one (mp_rank_00)
    if stage <= 2:
        model_files = [f for f in zc.model_files if MODEL_RE.fullmatch(os.path.basename(f))]
    else:
        model_files = [f for f in zc.model_files if MODEL3_RE.fullmatch(os.path.basename(f))]
        model_files.sort(key=lambda f: _rank_of(f)[0])
        mranks = [_rank_of(f)[0] for f in model_files]
        if len(set(mranks)) < len(mranks):
            dup = next(r for r in mranks if mranks.count(r) > 1)
            raise ZeroMismatchError(
                f"{zc.tag_dir}: two *_model_states.pt files of rank {dup} (zero_pp_rank_{dup}_ and a zero-padded "
                "name): files of two saves are mixed; keep one file per rank"
            )
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
                upcast=dt in FLOAT_DTYPES and dt != "float32",
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
        if paddings is not None and not isinstance(paddings, list):
            raise CorruptCheckpointError(
                f"{zc.tag_dir}: param_alignment_paddings is {type(paddings).__name__}, not a list per param group; "
                "the checkpoint is corrupt"
            )
        if isinstance(paddings, list) and gi < len(paddings) and paddings[gi] is not None:
            pads = paddings[gi]
            if not isinstance(pads, list) or len(pads) != len(shapes):
                raise CorruptCheckpointError(
                    f"{zc.tag_dir}: group {gi} has {len(shapes)} parameters but "
                    f"{len(pads) if isinstance(pads, list) else pads!r} alignment paddings; the checkpoint is corrupt"
                )
            for pi, pad in enumerate(pads):
                # a padding fills up to the next alignment boundary: an int in [0, 2 * world); anything else
                # would make parameters overlap (negative) or skip the partitions' elements
                if isinstance(pad, bool) or not isinstance(pad, int) or not 0 <= pad < max(align, 1) * 1024:
                    raise CorruptCheckpointError(
                        f"{zc.tag_dir}: group {gi}: alignment padding {pi} is {pad!r} (a padding is a small "
                        "non-negative int); the checkpoint is corrupt or hostile"
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
