"""What a conversion may be asked, and in which direction each option applies.

:class:`ConvertOptions` holds the options of the conversion itself (the output side is
:class:`~ckptfix.files.outputs.OutputOptions`); every field says, once, the directions it applies to
(``metadata["applies"]``), and :func:`refuse_inapplicable` refuses the ones given for another
direction (:class:`~ckptfix.errors.OptionNotApplicableError`, exit 32) instead of ignoring them.

The directions: ``safetensors`` (a checkpoint, sharded index, DCP directory -> safetensors), ``pt``
(safetensors -> a torch ``.pth``), ``dcp`` (safetensors -> a DCP directory), and the two folder
consolidations to safetensors, ``zero`` (DeepSpeed ZeRO) and ``hfstorage`` (torch's
HuggingFaceStorageWriter), and ``pipeline`` (a folder of several models to the same folder in safetensors).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping, Sequence

from ckptfix.files.outputs import OutputKeywords, OutputOptions, given_fields, refuse_given

__all__ = [
    "Direction",
    "DIRECTIONS",
    "ConvertOptions",
    "ConvertKeywords",
    "OUTPUT_APPLIES",
    "options_of",
    "refuse_inapplicable",
    "keywords_of",
]

Direction = Literal["safetensors", "pt", "dcp", "zero", "hfstorage", "pipeline", "fsdp-ranks"]
DIRECTIONS: tuple[Direction, ...] = ("safetensors", "pt", "dcp", "zero", "hfstorage", "pipeline", "fsdp-ranks")

#: how a refusal names each direction, and where an option of it applies
_WHERE: dict[str, str] = {
    "safetensors": "conversion to safetensors",
    "pt": "conversion back to torch (a .safetensors input, -o NAME.pth or --to pt)",
    "dcp": "DCP output (-o DIR.dcp or --to dcp, from a safetensors input)",
    "zero": "DeepSpeed ZeRO checkpoint folders (with a 'latest' file or *_optim_states.pt partitions)",
    "hfstorage": "torch HuggingFaceStorageWriter folders",
    "pipeline": "folders of several models (diffusers' model_index.json, sentence-transformers' modules.json)",
    "fsdp-ranks": "folders of FSDP per-rank DTensor files (pytorch_model_fsdp_0_rank0.bin ...)",
}


def _opt(default: Any, flag: str, applies: Sequence[str]) -> Any:
    return field(default=default, metadata={"flag": flag, "applies": frozenset(applies)})


@dataclass(frozen=True)
class ConvertOptions:
    """The options of a conversion (see :func:`ckptfix.ops.convert.convert` for each one's meaning).

    Attributes:
        to: ``"safetensors"``, ``"pt"`` or ``"dcp"``; None: the paths decide.
        strip_prefix: ``True`` strips wrapper prefixes; a string strips that one.
        max_shard_size: ``"5GB"`` or bytes: shard the safetensors output.
        include_optimizer: also write optimizer tensors as ``optimizer.<path>``.
        allow_globals, trust: the loading policy for inputs that need torch.
        ckptfix_metadata: ``False`` writes only ``{"format": "pt"}``.
        keep: of tied tensors, store these names.
        allow_expand: allow outputs over 4x the input + 64 MiB.
        drop: tensors to leave out (names or ``fnmatch`` patterns).
        strict: refuse tensors outside the state dict too (by default they are left out and reported).
        restore_wrapper: back to torch: rebuild the checkpoint dict around the state dict.
        shards: DCP output: write as this many ranks would.
        tag, dtype: a DeepSpeed ZeRO folder: the tag to consolidate; the floating dtype written.
        component: a folder of several models (diffusers pipeline, sentence-transformers): convert only this one.
    """

    to: str | None = _opt(None, "--to", DIRECTIONS)
    strip_prefix: bool | str | None = _opt(False, "--strip-prefix", ("safetensors", "dcp"))
    max_shard_size: int | str | None = _opt(None, "--max-shard-size", ("safetensors", "zero"))
    include_optimizer: bool = _opt(False, "--include-optimizer", ("safetensors", "fsdp-ranks"))
    allow_globals: Sequence[str] = _opt((), "--allow-global", ("safetensors",))
    trust: bool = _opt(False, "--trust", ("safetensors",))
    ckptfix_metadata: bool = _opt(True, "ckptfix_metadata=", ("safetensors", "dcp", "zero", "hfstorage", "fsdp-ranks"))
    keep: Sequence[str] = _opt((), "--keep", ("safetensors",))
    allow_expand: bool = _opt(False, "--allow-expand", ("safetensors",))
    drop: Sequence[str] = _opt((), "--drop", ("safetensors",))
    strict: bool = _opt(False, "--strict", ("safetensors",))
    restore_wrapper: bool = _opt(False, "--restore-wrapper", ("pt",))
    shards: int = _opt(1, "--shards", ("dcp",))
    tag: str | None = _opt(None, "--tag", ("zero",))
    dtype: str | None = _opt(None, "--dtype", ("zero",))
    component: str | None = _opt(None, "--component", ("pipeline",))

    def given(self) -> list[str]:
        """The fields set away from their defaults, in declaration order."""
        return given_fields(self)


_FIELDS = frozenset(f.name for f in dataclasses.fields(ConvertOptions))
_APPLIES: dict[str, frozenset[str]] = {f.name: f.metadata["applies"] for f in dataclasses.fields(ConvertOptions)}

#: the :class:`~ckptfix.files.outputs.OutputOptions` fields a conversion uses, and in which directions
OUTPUT_APPLIES: dict[str, frozenset[str]] = {
    "output": frozenset(DIRECTIONS),
    "force": frozenset(DIRECTIONS),
    "fsync": frozenset(DIRECTIONS),
    "verify": frozenset(DIRECTIONS),
    "jobs": frozenset(("safetensors", "dcp", "zero", "hfstorage", "fsdp-ranks")),
    "key": frozenset(("safetensors",)),
}


class ConvertKeywords(OutputKeywords, total=False):
    """The keywords of :func:`ckptfix.ops.convert.convert` and its entry points: both objects' fields."""

    to: str | None
    strip_prefix: bool | str | None
    max_shard_size: int | str | None
    include_optimizer: bool
    allow_globals: Sequence[str]
    trust: bool
    ckptfix_metadata: bool
    keep: Sequence[str]
    allow_expand: bool
    drop: Sequence[str]
    strict: bool
    restore_wrapper: bool
    shards: int
    tag: str | None
    dtype: str | None
    component: str | None


def options_of(
    dst: object,
    out: OutputOptions | None,
    options: ConvertOptions | None,
    keywords: Mapping[str, Any],
) -> tuple[OutputOptions, ConvertOptions]:
    """The two objects from an entry point's arguments: ``keywords`` replace fields of ``out``/``options``.

    Args:
        dst: the positional output (a path, or None: ``out.output``).
        out, options: objects the caller built, or None (defaults).
        keywords: keywords of either object.

    Returns:
        ``(OutputOptions, ConvertOptions)``.

    Raises:
        TypeError: a keyword of neither.
    """
    conv = {k: v for k, v in keywords.items() if k in _FIELDS}
    rest = {k: v for k, v in keywords.items() if k not in _FIELDS}
    o = OutputOptions.build(out, rest).with_output(dst)
    c = dataclasses.replace(options, **conv) if options is not None else ConvertOptions(**conv)
    return o, c


def refuse_inapplicable(direction: str, out: OutputOptions, options: ConvertOptions) -> None:
    """Refuse every option given that ``direction`` does not use (nothing has been read or written yet).

    Args:
        direction: one of :data:`DIRECTIONS`.
        out, options: what the caller asked.

    Raises:
        OptionNotApplicableError: naming the options, the direction, and where they apply.
    """
    for obj, applies in ((out, OUTPUT_APPLIES), (options, _APPLIES)):
        bad = [n for n in obj.given() if n != "to" and direction not in applies.get(n, ())]
        places = sorted({d for n in bad for d in applies.get(n, ())}, key=DIRECTIONS.index)
        why = "" if places else "a conversion always writes a new output (-o chooses where), never replacing its input"
        refuse_given(obj, bad, _WHERE[direction], " and ".join(_WHERE[d] for d in places), why)


def keywords_of(out: OutputOptions, options: ConvertOptions) -> dict[str, Any]:
    """Both objects as keywords, the fields given only, ``output`` left out (for code that takes ``**kw``).

    Args:
        out, options: the objects.

    Returns:
        field name -> value.
    """
    kw = {k: v for k, v in out.keywords().items() if k != "output"}
    kw.update((n, getattr(options, n)) for n in options.given())
    return kw
