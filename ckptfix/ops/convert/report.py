"""What a conversion did: :class:`ConvertReport`, the ``--json`` document of ``ckptfix convert``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

#: ``progress(done_bytes, total_bytes)``
Progress = Callable[[int, int], None]


@dataclass
class ConvertReport:
    """What a conversion did.  ``to_dict()`` is the ``--json`` document.

    Attributes:
        source: the input path.
        outputs: the files written (shards in order).
        source_format: the input's format (``torch-zip``, ``safetensors``, ``dcp`` ...).
        direction: ``"to-safetensors"`` or ``"to-torch"``.
        index: the sharded index written, if any.
        key_path: where the state dict sat in the checkpoint.
        tensors: tensors written.
        aliases: ``{alias: stored name}`` of tensors stored once.
        views: ``{view: base}`` of views restorable from a stored base.
        copied_views: views of a shared storage written as copies.
        tied_rule: what chose the stored name of tied tensors (``--keep``, transformers, state-dict order).
        excluded: entries of the checkpoint left out: optimizer entries (``--include-optimizer`` keeps them)
            and entries outside the state dict holding tensors (an EMA copy, a callback's ``kth_value``).
        excluded_tensors: ``{entry: tensors left out}`` of the latter.
        excluded_detail: ``{entry: what it held and how to convert it}`` of the latter.
        not_converted: ``{file: why}`` of a framework folder's other weight files left out (accelerate's
            ``model_1``); in ``to_dict()`` only when not empty.
        skipped: ``{path: why}`` of non-tensor values not kept (200 at most).
        dropped: tensors of the input left out because ``drop`` (``--drop``) asked for it, by name or path.
        placeholders: ``{path: global}`` of placeholders of classes written as plain data.
        converted: ``{path: "was -> now"}`` of values written as plain data.
        subclasses: ``{name: "Int8Tensor -> 0._weight_qdata, ..."}`` of torchao tensors written as their inner
            tensors in torchao's safetensors layout; in ``to_dict()`` only when not empty.
        stubbed_globals: globals the restricted reader turned into placeholders.
        renamed: keys renamed by ``strip_prefix``.
        kept_names: why ``strip_prefix`` renamed nothing though prefixes look like wrappers' (a whole pickled
            module's ``state_dict()`` names are its own); in ``to_dict()`` only when set.
        components: ``{component: {"folder", "kind", "outputs", "problem"}}`` of a folder of several models (a
            diffusers pipeline, a sentence-transformers model): what each became; in ``to_dict()`` only when set.
        optimizer_tensors: optimizer tensors written.
        bytes: tensor bytes written.
        verified: every output was read back and compared.
        used_torch: the input needed torch to read.
        seconds: wall time.
    """

    source: str
    outputs: list[str]
    source_format: str = ""
    direction: str = "to-safetensors"
    index: str | None = None
    key_path: tuple[str, ...] = ()
    tensors: int = 0
    aliases: dict[str, str] = field(default_factory=dict)
    views: dict[str, str] = field(default_factory=dict)
    copied_views: list[str] = field(default_factory=list)
    tied_rule: str | None = None
    excluded: list[str] = field(default_factory=list)
    excluded_tensors: dict[str, int] = field(default_factory=dict)
    excluded_detail: dict[str, str] = field(default_factory=dict)
    not_converted: dict[str, str] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    dropped: list[str] = field(default_factory=list)
    placeholders: dict[str, str] = field(default_factory=dict)
    converted: dict[str, str] = field(default_factory=dict)
    subclasses: dict[str, str] = field(default_factory=dict)
    stubbed_globals: list[str] = field(default_factory=list)
    unnamed: str = ""  # how tensors saved without names were named (a bare tensor, a list/tuple)
    renamed: int = 0
    kept_names: str = ""
    components: dict[str, dict[str, Any]] = field(default_factory=dict)
    optimizer_tensors: int = 0
    bytes: int = 0
    verified: bool = False
    used_torch: bool = False
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-ready data.

        Returns:
            Every field, ``key_path`` as a list and ``seconds`` rounded to milliseconds.
        """
        d = dict(self.__dict__)
        if not d["not_converted"]:
            del d["not_converted"]  # only a framework folder's report has it
        d["key_path"] = list(self.key_path)
        d["seconds"] = round(self.seconds, 3)
        if not d["unnamed"]:  # only for a bare tensor or a list/tuple of tensors
            del d["unnamed"]
        if not d["kept_names"]:
            del d["kept_names"]
        if not d["components"]:  # only a folder of several models' report has it
            del d["components"]
        if not d["subclasses"]:
            del d["subclasses"]
        return d
