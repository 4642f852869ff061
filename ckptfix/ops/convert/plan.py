"""Planning a conversion: which tensors are written, under which names, and which are stored once.

Exact duplicates (tied weights) are stored once and recorded as aliases, the stored name chosen by
:class:`TiedNames`; views of one storage become ``ckptfix.views`` entries when a stored tensor
covers them; an output much larger than its input (expanded views) is refused unless allowed.
"""

from __future__ import annotations

import re
from typing import Any, Mapping, Sequence

from ckptfix.errors import CorruptCheckpointError, KeyConflictError, ResourceLimitError, UnsupportedError
from ckptfix.ops.convert.items import Item, check_dtype, check_view
from ckptfix.ops.convert.report import ConvertReport
from ckptfix.pickles import TensorRecord


class TiedNames:
    """Which name of a group of tied (identical) tensors is stored; the others become aliases.

    In order: a name passed with ``keep`` (``--keep``); else, when ``drop`` patterns are known (the
    ``_tied_weights_keys`` of the transformers class ``config.json`` names), the first name that
    matches none of them; else the first name in the state dict's own order (embeddings come
    before heads, ``cls.predictions.bias`` before ``cls.predictions.decoder.bias``) -- the name
    ``transformers``' own ``save_pretrained`` keeps.
    """

    def __init__(self, keep: Sequence[str] = (), drop: Sequence[str] = (), source: str = "state-dict order") -> None:
        self.keep = set(keep)
        self.drop = [re.compile(p) for p in drop]
        self.source = source
        self.used_keep: set[str] = set()

    def _dropped(self, name: str) -> bool:
        return any(p.fullmatch(name) or p.pattern == name for p in self.drop)

    def choose(self, names: Sequence[str]) -> str:
        """The name to store for one group.

        Args:
            names: the group's names, in state-dict order.

        Returns:
            The name to store.

        Raises:
            KeyConflictError: ``--keep`` names two names of the same tensor.
        """
        kept = [n for n in names if n in self.keep]
        if len(kept) > 1:
            raise KeyConflictError(
                f"--keep {' and '.join(repr(n) for n in kept)}: these names are one tensor (tied), so only one "
                "can be stored; keep just one of them (the others become aliases of it)"
            )
        if kept:
            self.used_keep.add(kept[0])
            return kept[0]
        ok = [n for n in names if not self._dropped(n)]
        return (ok or list(names))[0]


def hf_tied_weights(src: str) -> tuple[list[str], str] | None:
    """The tied-weight names transformers drops, for the class a ``config.json`` beside ``src`` names.

    From ckptfix's table (:mod:`ckptfix.formats.hfarch`), never by importing transformers or torch.

    Args:
        src: the checkpoint file (or its folder).

    Returns:
        ``(names, source)``: the class's ``_tied_weights_keys`` (and its base model's, under its prefix)
        and a description for the report; None when there is no ``config.json`` naming a known
        architecture next to the input (then the state-dict order decides).
    """
    from ckptfix.formats.hfarch import tied_drop

    return tied_drop(src)


def plan_records(
    named: Sequence[tuple[str, TensorRecord]], report: ConvertReport, tied: TiedNames | None = None
) -> tuple[list[Item], dict[str, dict[str, Any]]]:
    """The items to store from tensor records: exact duplicates once, views of one storage restorable.

    Args:
        named: ``(name, record)`` in state-dict order; every record's bytes are a byte range of a file.
        report: gets ``aliases``, ``views`` and ``copied_views``.
        tied: which name of a group of tied tensors is stored (default: the first).

    Returns:
        ``(items, views)``: the items in state-dict order, and the ``ckptfix.views`` entries
        ``{name: {"base", "offset", "shape", "stride"}}``.

    Raises:
        UnsupportedError: a dtype or layout safetensors cannot hold, or bytes not in the file.
        CorruptCheckpointError: a record with impossible offset, shape or stride, or past its storage.
    """
    groups, recs = _group_records(named)
    keep: dict[tuple, str] = {}
    for gkey, names in groups.items():
        stored = (tied or TiedNames()).choose(names)
        keep[gkey] = stored
        for n in names:
            if n != stored:
                report.aliases[n] = stored
    views = _restorable_views(keep, recs, report)
    items = []
    for name, rec in named:
        if name in report.aliases:
            continue
        st = rec.storage
        assert st is not None and st.file_offset is not None
        if rec.is_contiguous() or rec.numel <= 1:
            offset = st.file_offset + rec.offset * rec.element_size
            whole = rec.offset == 0 and rec.nbytes == st.nbytes  # the storage's stored CRC-32 is this tensor's
            crc = st.crc if whole else None
            items.append(Item(name, rec.dtype, tuple(rec.shape), rec.nbytes, path=st.source, offset=offset, crc=crc))
        else:
            items.append(Item(name, rec.dtype, tuple(rec.shape), rec.nbytes, rec=rec))
    return items, views


def _group_records(
    named: Sequence[tuple[str, TensorRecord]],
) -> tuple[dict[tuple, list[str]], dict[str, TensorRecord]]:
    """Names grouped by the exact tensor they are (storage, offset, shape, stride, dtype), after checks."""
    groups: dict[tuple, list[str]] = {}
    recs: dict[str, TensorRecord] = {}
    for name, rec in named:
        check_dtype(name, rec.dtype, rec.kind)
        check_view(name, rec)
        st = rec.storage
        if st is None or st.file_offset is None or st.source is None or st.nbytes is None:
            raise UnsupportedError(
                f"tensor {name!r}: its bytes are not a byte range of the file, so it cannot be copied "
                "without torch; load it with load_anywhere and save it with safetensors"
            )
        if rec.numel and rec.span()[1] * rec.element_size > st.nbytes:
            raise CorruptCheckpointError(
                f"tensor {name!r} reaches past the end of its storage {st.key!r}; the checkpoint is corrupt"
            )
        recs[name] = rec
        groups.setdefault((id(st), rec.offset, rec.shape, rec.stride if rec.numel else (), rec.dtype), []).append(name)
    return groups, recs


def _restorable_views(
    keep: Mapping[tuple, str], recs: Mapping[str, TensorRecord], report: ConvertReport
) -> dict[str, dict[str, Any]]:
    """Views of one storage that are not the same tensor: restorable as views when a stored tensor covers it.

    The others are written as copies (listed in ``report.copied_views``).
    """
    by_storage: dict[int, list[str]] = {}
    for gkey, stored in keep.items():
        by_storage.setdefault(gkey[0], []).append(stored)
    views: dict[str, dict[str, Any]] = {}
    for names in by_storage.values():
        if len(names) < 2:
            continue
        bases = sorted(n for n in names if recs[n].covers_storage())
        for n in sorted(names):
            if bases and n != bases[0] and recs[n].dtype == recs[bases[0]].dtype:
                r = recs[n]
                views[n] = {"base": bases[0], "offset": r.offset, "shape": list(r.shape), "stride": list(r.stride)}
            elif not (bases and n == bases[0]):
                report.copied_views.append(n)
    report.views = {n: v["base"] for n, v in views.items()}
    return views


def has_tied_groups(named: Sequence[tuple[str, Any]]) -> bool:
    """Do two names hold the same tensor (records or torch tensors)?

    Args:
        named: ``(name, tensor)`` pairs.

    Returns:
        True at the first tensor seen twice.
    """
    seen: set[tuple] = set()
    for _, v in named:
        if isinstance(v, TensorRecord):
            k: tuple = (id(v.storage), v.offset, tuple(v.shape), tuple(v.stride), v.dtype)
        else:
            k = (
                v.untyped_storage().data_ptr() if v.numel() else id(v),
                v.storage_offset(),
                tuple(v.shape),
                tuple(v.stride()),
                v.dtype,
            )
        if k in seen:
            return True
        seen.add(k)
    return False


def _torch_dtype_name(t: Any) -> str:
    return str(t.dtype).replace("torch.", "")


def plan_tensors(named: Sequence[tuple[str, Any]], report: ConvertReport, tied: TiedNames | None = None) -> list[Item]:
    """The items to store from torch tensors (inputs that need torch): exact duplicates once.

    Args:
        named: ``(name, tensor)`` in state-dict order.
        report: gets ``aliases``.
        tied: which name of a group of tied tensors is stored (default: the first).

    Returns:
        The items in state-dict order.

    Raises:
        UnsupportedError: a dtype or layout (sparse, quantized, meta) safetensors cannot hold.
    """
    import torch

    groups: dict[tuple, list[str]] = {}
    for name, t in named:
        kind = "dense"
        if t.layout != torch.strided:
            kind = "sparse"
        elif t.is_quantized:
            kind = "quantized"
        elif t.device.type == "meta":
            kind = "meta"
        check_dtype(name, _torch_dtype_name(t), kind)
        if t.device.type != "cpu":
            t = t.cpu()
        ptr = t.untyped_storage().data_ptr() if t.numel() else id(t)
        groups.setdefault((ptr, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype), []).append(name)
    for names in groups.values():
        stored = (tied or TiedNames()).choose(names)
        for n in names:
            if n != stored:
                report.aliases[n] = stored
    items = []
    for name, t in named:
        if name in report.aliases:
            continue
        items.append(Item(name, _torch_dtype_name(t), tuple(t.shape), t.numel() * t.element_size(), tensor=t))
    return items


#: output bytes allowed per input byte, plus a constant, before ``allow_expand`` is needed
EXPAND_FACTOR = 4
EXPAND_SLACK = 64 << 20


def check_expansion(items: Sequence[Item], input_bytes: int, allow_expand: bool) -> None:
    """Refuse an output much larger than its input (stride-0 / expanded views), unless ``allow_expand``.

    A legitimate 2 KB ``torch.zeros(1).expand(N, N)`` holds N*N elements once written densely;
    the limit is ``4 x input + 64 MiB``.

    Args:
        items: what would be written.
        input_bytes: the input's size.
        allow_expand: write it anyway.

    Raises:
        ResourceLimitError: naming the largest expanded tensor and the output size.
    """
    total = sum(it.nbytes for it in items)
    limit = EXPAND_FACTOR * input_bytes + EXPAND_SLACK
    if allow_expand or total <= limit:
        return
    views = [it for it in items if it.rec is not None] or list(items)
    big = max(views, key=lambda it: it.nbytes)
    raise ResourceLimitError(
        f"tensor {big.name!r} {list(big.shape)} expands to {big.nbytes} bytes (the whole output "
        f"{total} bytes, from {input_bytes} bytes of input; the limit is {EXPAND_FACTOR}x the "
        "input + 64 MiB); pass --allow-expand (allow_expand=True) to write it anyway"
    )


def output_names(
    named: Sequence[tuple[str, Any]],
    opt_named: Sequence[tuple[str, Any]],
    strip_prefix: bool | str | None,
    report: ConvertReport,
    own: Mapping[str, str] | None = None,
) -> tuple[list[tuple[str, Any]], list[str]]:
    """The tensors to write under their final names: the state dict's (prefixes stripped) then the optimizer's.

    Args:
        named: ``(name, tensor)`` of the state dict, in its order.
        opt_named: ``(optimizer.<path>, tensor)`` pairs (empty without ``--include-optimizer``).
        strip_prefix: strip wrapper prefixes (``True``) or exactly this prefix (a string).
        report: gets ``renamed`` and ``optimizer_tensors``.
        own: leading prefixes that are the model's own (:func:`ckptfix.formats.hfarch.own_prefixes`): never stripped
            by ``strip_prefix=True``.

    Returns:
        All pairs to write, and the state dict's names in order.

    Raises:
        KeyConflictError: a tensor named ``__metadata__``, or an optimizer tensor colliding with a state-dict key.
        UnsupportedError: a name that is not valid UTF-8 (a lone surrogate), which a safetensors header cannot hold.
    """
    named = list(named)
    if strip_prefix:
        from ckptfix.ops.prefixes import strip_prefix as _strip

        mapping = dict(named)
        new = _strip(mapping, None if strip_prefix is True else str(strip_prefix), own=own or {})
        report.renamed = sum(1 for a, b in zip(mapping, new, strict=False) if a != b)
        named = list(new.items())
    order = [n for n, _ in named]
    taken = set(order)
    if "__metadata__" in taken:
        raise KeyConflictError(
            "the state dict has a tensor named '__metadata__', which safetensors reserves for "
            "its metadata; rename it before converting"
        )
    seen_opt: set[str] = set()
    for n, _ in opt_named:
        if n in taken:
            raise KeyConflictError(
                f"optimizer tensor {n!r} collides with a state-dict key; convert without --include-optimizer"
            )
        if n in seen_opt:  # two optimizer entries flatten to one name (state keys 1 and "1"; "a.b" and "a"+"b")
            raise KeyConflictError(
                f"two optimizer tensors collide as {n!r} (keys that differ only in type or in dots); "
                "convert without --include-optimizer"
            )
        seen_opt.add(n)
    for n, _ in [*named, *opt_named]:
        if not n.isascii():
            try:
                n.encode("utf-8")
            except UnicodeEncodeError:
                raise UnsupportedError(
                    f"tensor name {ascii(n)} holds a lone surrogate, which a safetensors header (UTF-8 JSON) "
                    "cannot store; load the checkpoint with load_anywhere, rename the key and save it again"
                ) from None
    report.optimizer_tensors = len(opt_named)
    return named + list(opt_named), order


def tied_names(
    named: Sequence[tuple[str, Any]], order: Sequence[str], keep: Sequence[str], src: str, stripped: bool
) -> TiedNames:
    """The rule that picks the stored name of tied tensors: ``keep``, else transformers' class, else order.

    Args:
        named: every ``(name, tensor)`` to write.
        order: the state dict's names (``keep`` must name one of them).
        keep: names to store (``--keep``).
        src: the input, whose folder may hold a ``config.json`` (:func:`hf_tied_weights`).
        stripped: prefixes were stripped (for the message).

    Returns:
        The :class:`TiedNames` to plan with.

    Raises:
        KeyConflictError: a ``keep`` name is not in the state dict.
    """
    taken = set(order)
    missing = [k for k in keep if k not in taken]
    if missing:
        raise KeyConflictError(
            f"--keep {missing[0]!r}: no tensor of that name in the state dict"
            + (" (after --strip-prefix)" if stripped else "")
            + "; pass a name that `ckptfix inspect` lists"
        )
    tied = TiedNames(keep)
    if has_tied_groups(named):
        hf = hf_tied_weights(src)
        if hf is not None:
            tied = TiedNames(keep, hf[0], hf[1])
    return tied
