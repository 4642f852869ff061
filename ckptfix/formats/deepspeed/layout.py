"""Finding a DeepSpeed ZeRO checkpoint on disk, and the types that describe its consolidated tensors.

:class:`ZeroCheckpoint` (the folder, its partition files, and once read its tensors), :class:`ZeroTensor`
(one output tensor as :class:`Piece` byte ranges of the partition files), :func:`find_zero_checkpoint`
(names only; nothing is unpickled).  Reading the partitions is :mod:`ckptfix.formats.deepspeed.reader`.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from typing import Any

from ckptfix.errors import CheckpointNotFoundError
from ckptfix.files import pins
from ckptfix.pickles import ELEMENT_SIZE

#: the floating dtypes ``--dtype`` applies to
FLOAT_DTYPES = {"float32", "float16", "bfloat16", "float64"}
#: an optimizer partition (``zero_pp_rank_R_mp_rank_M_optim_states.pt``, or bf16_ prefixed)
OPTIM_RE = re.compile(r"(?:.*_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
#: a stage-3 rank's model states
MODEL3_RE = re.compile(r"zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
#: a stage-1/2 model states file
MODEL_RE = re.compile(r"mp_rank_(\d+)_model_states\.pt$")


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
        if dtype is not None and d in FLOAT_DTYPES:
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
    optim = sorted((n for n in names if n.endswith("_optim_states.pt") and OPTIM_RE.match(n)), key=_natural)
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
            from ckptfix.files.containment import check_member

            for part in model + optim:  # partition files that link outside the folder: refused (one rule)
                check_member(p, os.path.basename(part), p)
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
        from ckptfix.files.containment import check_member

        check_member(p, "latest", p)  # a 'latest' that links outside the folder is not read (nor printed)
        try:
            with open(pins.path_for(latest), encoding="utf-8", errors="replace") as f:
                tag = f.read(4096).strip()
        except OSError:
            return None
        if not tag or "\n" in tag or len(tag) > 255:
            return None
        if os.path.isabs(tag) or os.sep in tag or (os.altsep or os.sep) in tag or tag in (".", ".."):
            from ckptfix.errors import UnsupportedError

            raise UnsupportedError(
                f"{p}: 'latest' names {tag!r}, not a tag folder inside the checkpoint folder; refused (a tag is a "
                "folder name such as global_step14: pick one with --tag)"
            )
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
    from ckptfix.files.containment import check_member

    check_member(p, tag, p)  # a tag folder that links outside the checkpoint folder: refused (one rule)
    model, optim = _zero_files(tag_dir)
    for part in model + optim:  # and partition files that do
        check_member(tag_dir, os.path.basename(part), tag_dir)
    if not optim or not model:
        what = "*_optim_states.pt" if not optim else "*_model_states.pt"
        raise CheckpointNotFoundError(
            f"{p}: {where} {tag!r} but {tag_dir} holds no {what} files (not a ZeRO checkpoint, or saved "
            "without its optimizer partitions: zero_to_fp32 needs them too)"
        )
    return ZeroCheckpoint(p, tag, tag_dir, model, optim)
