"""One side of a ``diff``: a checkpoint's state dict as named tensors whose bytes are byte ranges (torch-free).

:func:`read_side` reads anything ``inspect`` reads, with the readers the other commands use: a file, index or
DCP directory through :func:`~ckptfix.formats.read_checkpoint` (each tensor a
:class:`~ckptfix.ops.convert.items.Item`: a byte range of its file, a strided view gathered from its storage's span,
or a DCP tensor assembled from its chunks), a framework folder through :func:`~ckptfix.formats.layouts.resolve` (its
weights; a DeepSpeed ZeRO folder as ``zero_to_fp32`` consolidates it, through :mod:`ckptfix.formats.deepspeed`).
The state dict is found as ``inspect`` finds it; names sharing one tensor (tied weights, a converted file's
aliases, DeepSpeed's ``shared_params``) share a ``group``, so they are compared once.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping

from ckptfix.errors import NoTensorsError, UnsupportedError
from ckptfix.files import source
from ckptfix.ops.convert.items import Item, Range

__all__ = ["Side", "SideTensor", "read_side", "retie", "where"]


@dataclass(eq=False)
class SideTensor:
    """A tensor of one side: what it is and where its bytes are."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    numel: int
    element_size: int
    item: Item | None  # its bytes (None: not readable torch-free, ``note`` says why)
    group: int  # names with one group are one tensor
    note: str = ""
    order: tuple[str, int] = ("", 0)  # (file, offset) of its first byte: comparisons run in this order

    @property
    def nbytes(self) -> int:
        """Bytes of its elements."""
        return self.numel * self.element_size


@dataclass(eq=False)
class Side:
    """A checkpoint read for a diff.

    Attributes:
        path: as given.
        format: its format (``torch-zip`` ...; ``deepspeed-zero2`` for a ZeRO folder).
        key_path: where the state dict sits.
        tensors: name -> tensor, in state-dict order.
        entries: the non-tensor entries, briefly (``epoch: 3``, safetensors metadata).
        notes: remarks for the report.
        closers: what to close once compared (DCP data files).
        ties: tied names stored once -> the name stored (from ``config.json``; :func:`retie`), and where from.
    """

    path: str
    format: str
    key_path: tuple[str, ...]
    tensors: dict[str, SideTensor]
    entries: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    closers: list[Callable[[], None]] = field(default_factory=list)
    ties: dict[str, str] = field(default_factory=dict)
    tie_source: str = ""

    def close(self) -> None:
        """Close the files this side opened."""
        for c in self.closers:
            c()
        self.closers.clear()


def where(t: SideTensor) -> tuple[str, int]:
    """Where a tensor's bytes start (file, offset): the comparisons run in this order."""
    return t.order


def read_side(path: str, key: str | None = None) -> Side:
    """Read one side of a diff (no tensor bytes yet).

    Args:
        path: any checkpoint, folder or URL ``inspect`` reads.
        key: where the state dict sits (``state_dict_ema``); found as ``inspect`` finds it otherwise.

    Returns:
        The :class:`Side`.

    Raises:
        As :func:`ckptfix.formats.read_checkpoint`; NoTensorsError: no tensors in it.
    """
    if not source.is_url(path) and os.path.isdir(path):
        from ckptfix.formats.layouts import resolve

        fw = resolve(path)
        if fw is not None:
            from ckptfix.formats.pipelines import is_multi

            if is_multi(fw):  # several models: one component at a time
                from ckptfix.ops.pipelines import diff_refusal

                raise diff_refusal(fw, path)
            if fw.layout.name in ("deepspeed-zero", "hf-storage-dcp"):
                if key is not None:
                    raise UnsupportedError(
                        f"{path}: --key does not apply to a {fw.layout.framework} folder (one model)"
                    )
                if fw.layout.name == "hf-storage-dcp":
                    return _hf_storage_side(path, fw.extra["checkpoint"])
                return _zero_side(path, fw.extra["checkpoint"])
            if fw.layout.consolidated:
                raise UnsupportedError(
                    f"{path}: a {fw.layout.framework} folder is compared through its consolidated file: "
                    f"`ckptfix convert {path} -o model.safetensors`, then diff model.safetensors"
                )
            from ckptfix.formats.layouts import check_inside

            side = _file_side(check_inside(fw, fw.require_weights()), key)
            side.path = path
            return _retie(side, path)
    side = _file_side(path, key)
    return side if source.is_url(path) else _retie(side, path)


def _retie(side: Side, path: str) -> Side:
    """Note the tied names a Hugging Face model stores once (GPT-2's ``lm_head.weight``): ``side.ties``.

    ``save_pretrained`` drops them and ``from_pretrained`` re-ties them (the ``config.json`` beside the
    weights names the class; its ``_tied_weights_keys`` from :mod:`ckptfix.formats.hfarch`); :func:`retie` adds
    them where the other side stores them.
    """
    from ckptfix.formats.hfarch import ARCHITECTURES, architectures, read_config

    found = architectures(path)
    cfg = read_config(path)
    if not found or cfg is None or cfg.get("tie_word_embeddings") is False:
        return side
    for _, arch in found:
        side.ties.update(arch.tied)
        base = ARCHITECTURES.get(arch.base) if arch.base else None
        if base is not None:
            side.ties.update({f"{arch.prefix}.{k}": f"{arch.prefix}.{v}" for k, v in base.tied.items()})
    side.tie_source = "config.json " + ", ".join(n for n, _ in found)
    return side


def retie(side: Side, other: Side) -> None:
    """Add the tied names ``side`` stores once (``side.ties``) that ``other`` stores, as the tensor they share.

    So a Trainer folder diffed against a ``torch.save`` of the loaded model (which holds ``lm_head.weight``) does
    not report it missing, and diffed against its ``convert`` output (which stores it once too) needs nothing.
    """
    added = []
    for dropped, target in side.ties.items():
        t = side.tensors.get(target)
        if dropped in side.tensors or dropped not in other.tensors or t is None:
            continue
        side.tensors[dropped] = SideTensor(dropped, t.dtype, t.shape, t.numel, t.element_size, t.item, t.group,
                                           t.note, t.order)  # fmt: skip
        added.append(f"{dropped} = {target}")
    if added:
        side.notes.append(f"{side.path}: {'; '.join(added)} (tied, stored once: {side.tie_source})")


def _brief(v: Any) -> str:
    """A non-tensor entry in a few words, comparable across formats (values for plain scalars)."""
    from ckptfix.pickles import TensorRecord, is_tensor_like
    from ckptfix.pickles.stub import Stub, global_name

    if isinstance(v, TensorRecord) or is_tensor_like(v):
        return f"tensor {getattr(v, 'dtype', '?')} {list(getattr(v, 'shape', ()))}"
    if isinstance(v, Stub):
        return f"object {global_name(type(v))}"
    if isinstance(v, Mapping):
        return f"dict ({len(v)} keys)"
    if isinstance(v, (list, tuple)):
        if all(isinstance(x, (int, float, str, bool)) or x is None for x in v) and len(repr(v)) <= 80:
            return repr(list(v))
        return f"{type(v).__name__} ({len(v)} items)"
    if isinstance(v, (int, float, bool, str)) or v is None:
        s = repr(v)
        return s if len(s) <= 80 else s[:77] + "..."
    return type(v).__name__


def _file_side(path: str, key: str | None) -> Side:
    from ckptfix.formats import Format, SafetensorsDetails, classify, read_checkpoint
    from ckptfix.formats.statedict import locate_state_dict

    inp = classify(path)
    cf = read_checkpoint(inp)
    from ckptfix.formats.zipfmt import big_endian_parts

    if big := big_endian_parts(cf):
        from ckptfix.errors import UnsupportedError

        raise UnsupportedError(
            f"{big[0]}: its storages are big-endian (byteorder 'big'); diff compares bytes in this machine's order "
            "and does not swap them: `ckptfix convert` it to safetensors first (torch.load swaps them) and diff that"
        )
    if cf.format == Format.DCP:
        return _dcp_side(path, cf, key)
    obj = cf.state_root
    key_path, sd, _kind = locate_state_dict(obj, key)
    entries: dict[str, str] = {}
    if isinstance(cf.details, SafetensorsDetails) or cf.format == Format.SHARDED:
        from ckptfix.formats import stmeta

        meta = cf.details.metadata if isinstance(cf.details, SafetensorsDetails) else _shard_meta(cf)
        sd = stmeta.logical_state_dict(sd, meta)
        for k, v in stmeta.extra(meta).items():  # a converted checkpoint's own entries (epoch, config ...)
            entries[str(k)] = _brief(v)
        for k, v in meta.items():
            if k != "format" and not k.startswith("ckptfix."):
                entries[f"__metadata__/{k}"] = _brief(v)
    else:
        if key_path and isinstance(obj, Mapping):
            for k, v in obj.items():
                if str(k) != key_path[0]:
                    entries[str(k)] = _brief(v)
        for k, v in sd.items():
            from ckptfix.pickles import is_tensor_like

            if not is_tensor_like(v):
                entries["/".join((*key_path, str(k)))] = _brief(v)
    tensors = _record_tensors(sd)
    if not tensors:
        raise NoTensorsError(f"{path}: no tensors in its state dict; `ckptfix inspect {path}` shows what it holds")
    return Side(path, str(cf.format), tuple(key_path), tensors, entries)


def _shard_meta(cf: Any) -> dict[str, str]:
    """The first safetensors shard's metadata of a sharded checkpoint (where convert writes it)."""
    from ckptfix.formats import SafetensorsDetails, ShardedDetails

    d = cf.details
    if isinstance(d, ShardedDetails):
        for shard in d.shards.values():
            if isinstance(shard.details, SafetensorsDetails):
                return dict(shard.details.metadata)
    return {}


def _record_tensors(sd: Mapping[str, Any]) -> dict[str, SideTensor]:
    """Tensor records as :class:`SideTensor`: a contiguous one as its byte range, a strided view to gather."""
    from ckptfix.ops.convert.items import Item, check_view
    from ckptfix.pickles import ELEMENT_SIZE, TensorRecord, is_tensor_like

    out: dict[str, SideTensor] = {}
    groups: dict[tuple, int] = {}
    for k, v in sd.items():
        name = str(k)
        if not is_tensor_like(v):
            continue
        if not isinstance(v, TensorRecord):  # a torch tensor (a TorchScript archive's derived state dict)
            out[name] = SideTensor(name, str(v.dtype).replace("torch.", ""), tuple(v.shape), v.numel(),
                                   v.element_size(), None, id(v), "built by torch code; not a byte range")  # fmt: skip
            continue
        st = v.storage
        gkey = (id(st), v.offset, tuple(v.shape), tuple(v.stride), v.dtype) if st is not None else (id(v),)
        group = groups.setdefault(gkey, len(groups))
        es = ELEMENT_SIZE.get(v.dtype, 1)
        note = ""
        item = None
        order = ("", 0)
        if v.kind != "dense":
            note = f"a {v.kind} tensor: only dense tensors are compared"
        elif v.dtype not in ELEMENT_SIZE:
            note = f"dtype {v.dtype} is not compared"
        elif st is None or st.file_offset is None or st.source is None:
            note = "its bytes are not a byte range of the file (built by code); compare after `ckptfix convert`"
        else:
            check_view(name, v)
            first, end = v.span()
            if st.nbytes is not None and end * es > st.nbytes:
                from ckptfix.errors import CorruptCheckpointError

                raise CorruptCheckpointError(
                    f"tensor {name!r} reaches past its storage {st.key!r}; the checkpoint is corrupt"
                )
            order = (st.source, st.file_offset + first * es)
            if v.is_contiguous():
                item = Item(name, v.dtype, tuple(v.shape), v.nbytes, path=st.source, offset=order[1])
            else:
                item = Item(name, v.dtype, tuple(v.shape), v.nbytes, rec=v)
        out[name] = SideTensor(name, v.dtype, tuple(int(s) for s in v.shape), v.numel, es, item, group, note, order)
    return out


def _dcp_side(path: str, cf: Any, key: str | None) -> Side:
    """A DCP directory: each tensor assembled from its chunks (or its row blocks' byte ranges), as convert does."""
    from ckptfix.formats import DcpDetails
    from ckptfix.formats.dcp.chunks import Files
    from ckptfix.formats.dcp.meta import TensorEntry, validate
    from ckptfix.ops.convert.dcp_in import DcpItem
    from ckptfix.pickles import ELEMENT_SIZE, TensorRecord

    assert isinstance(cf.details, DcpDetails)
    meta = cf.details.metadata
    meta.check_safe()
    validate(meta)
    key_path, sd = cf.state_dict(key)
    files = Files(path)
    tensors: dict[str, SideTensor] = {}
    entries: dict[str, str] = {}
    for i, (k, v) in enumerate(sd.items()):
        name = str(k)
        e = meta.entries.get(v.storage.key) if isinstance(v, TensorRecord) and v.storage is not None else None
        if not isinstance(e, TensorEntry):
            entries["/".join((*key_path, name))] = _brief(v)
            continue
        shape = tuple(int(s) for s in e.shape)
        item = DcpItem(name, e.dtype, shape, e.nbytes, entry=e, files=files)
        es = ELEMENT_SIZE.get(e.dtype, 1)
        tensors[name] = SideTensor(name, e.dtype, shape, e.nbytes // es if es else 0, es, item, i, "", (path, i))
    if not tensors:
        files.close()
        raise NoTensorsError(f"{path}: the DCP checkpoint holds no tensors at {'/'.join(key_path) or 'top level'}")
    if isinstance(cf.obj, Mapping) and key_path:
        for k, v in cf.obj.items():
            if str(k) != key_path[0]:
                entries[str(k)] = _brief(v)
    return Side(path, "dcp", tuple(key_path), tensors, entries, closers=[files.close])


def _zero_side(path: str, zc: Any) -> Side:
    """A DeepSpeed ZeRO folder: zero_to_fp32's state dict, each tensor its byte range(s) in the partitions."""
    from ckptfix.formats.deepspeed import read_zero_checkpoint
    from ckptfix.ops.convert.zero import _items
    from ckptfix.pickles import ELEMENT_SIZE

    read_zero_checkpoint(zc)
    items = {it.name: it for it in _items(zc, None)}
    tensors: dict[str, SideTensor] = {}
    for i, (name, it) in enumerate(items.items()):
        es = ELEMENT_SIZE[it.dtype]
        numel = it.nbytes // es
        order = (it.path, it.offset) if it.path is not None else (path, i)
        tensors[name] = SideTensor(name, it.dtype, tuple(it.shape), numel, es, it, i, "", order)
    for alias, target in zc.aliases().items():
        t = tensors.get(target)
        if t is not None:
            tensors[alias] = SideTensor(alias, t.dtype, t.shape, t.numel, t.element_size, t.item, t.group, "", t.order)
    entries = {str(k): _brief(v) for k, v in zc.extra.items()}
    return Side(path, f"deepspeed-zero{zc.stage}", (), tensors, entries)


def _hf_storage_side(path: str, hf: Any) -> Side:
    """torch's ``HuggingFaceStorageWriter`` folder: each tensor assembled from its ranks' chunks, as convert does."""
    from ckptfix.formats.hfstorage import read_hf_storage
    from ckptfix.formats.safetensors_fmt import ST_TO_DTYPE

    read_hf_storage(hf)
    tensors: dict[str, SideTensor] = {}
    for i, t in enumerate(hf.tensors):
        dtype = ST_TO_DTYPE[t.st_dtype]
        shape = tuple(int(s) for s in t.shape)
        item = _HfStorageItem(t.name, dtype, shape, t.nbytes, tensor=t)
        first = min(t.chunks, key=lambda c: (c.path, c.data_offset)) if t.chunks else None
        order = (first.path, first.data_offset) if first is not None else (path, i)
        tensors[t.name] = SideTensor(t.name, dtype, shape, t.nbytes // t.element_size, t.element_size, item, i, "",
                                     order)  # fmt: skip
    return Side(path, "hf-storage-dcp", (), tensors)


class _HfStorageItem(Item):
    """A ``HuggingFaceStorageWriter`` tensor: its chunks' contiguous runs, in the order they lie in the tensor."""

    def _runs(self) -> list[tuple[int, str, int, int]]:
        """(offset in the tensor, file, offset in the file, bytes) of every run, sorted, replicas once."""
        from ckptfix.formats.hfstorage import chunk_runs

        t = self.tensor
        seen: dict[int, tuple[int, str, int, int]] = {}
        for c in t.chunks:
            for s_off, d_off, n in chunk_runs(t, c):
                if n and (d_off not in seen or seen[d_off][3] < n):
                    seen[d_off] = (d_off, c.path, s_off, n)
        return [seen[k] for k in sorted(seen)]

    def ranges(self) -> list[Range] | None:
        """The tensor as byte ranges of the shards when the runs tile it end to end (row or column sharding)."""
        out: list[Range] = []
        at = 0
        for d_off, f, s_off, n in self._runs():
            if d_off != at:
                return None  # overlapping or uncovered runs: assembled window by window (:meth:`chunks`)
            if out and out[-1][0] == f and out[-1][1] + out[-1][2] == s_off:
                out[-1] = (f, out[-1][1], out[-1][2] + n, None)
            else:
                out.append((f, s_off, n, None))
            at += n
        return out if at == self.nbytes else None

    def chunks(self, fds: Any) -> Iterator[bytearray]:
        """The tensor's bytes in windows of 8 MiB; elements no chunk covers read as zeros (as torch's consolidation)."""
        import bisect

        runs = self._runs()
        starts = [r[0] for r in runs]
        window = 8 << 20
        for w in range(0, self.nbytes, window):
            end = min(self.nbytes, w + window)
            buf = bytearray(end - w)
            view = memoryview(buf)
            i = max(0, bisect.bisect_right(starts, w) - 1)
            while i < len(runs) and runs[i][0] < end:
                d_off, f, s_off, n = runs[i]
                lo, hi = max(d_off, w), min(d_off + n, end)
                if hi > lo:
                    k = os.preadv(fds.get(f), [view[lo - w : hi - w]], s_off + lo - d_off)
                    if k != hi - lo:
                        from ckptfix.errors import CorruptCheckpointError

                        raise CorruptCheckpointError(f"{f}: ends inside tensor {self.name!r} (truncated?)")
                i += 1
            yield buf
