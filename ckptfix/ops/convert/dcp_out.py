"""safetensors -> a ``torch.distributed.checkpoint`` (DCP) directory: start a sharded run from released weights.

This direction imports torch (its DCP writer produces the ``.distcp`` files and ``.metadata``, so any
torch that can read DCP reads the result).  The tensors are taken zero-copy from a private mapping of
the safetensors file (``torch.frombuffer`` on the ``mmap``), so nothing is held in memory but the
pages the writer is copying; the output is written into a temporary directory beside the
destination, read back through ckptfix's own torch-free DCP reader (names, dtypes, shapes and every
byte against the source), and only then renamed into place.
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import stat
import tempfile
import threading
import time
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ckptfix._torch import require_torch
from ckptfix.display import already_exists, missing_directory, not_writable, output_is_input
from ckptfix.errors import (
    CkptfixError,
    NoTensorsError,
    OutputError,
    UnsupportedError,
    VerificationError,
)
from ckptfix.files import pins
from ckptfix.files.atomic import fsync_dir, output_error, replace_directory
from ckptfix.files.outputs import OutputOptions
from ckptfix.files.parallel import Tally, resolve_jobs
from ckptfix.formats import Input, classify
from ckptfix.formats.base import Format
from ckptfix.formats.dcp.chunks import Files
from ckptfix.formats.dcp.meta import TensorEntry, read_metadata, validate
from ckptfix.formats.safetensors_fmt import ST_TO_DTYPE, read_header
from ckptfix.formats.sharded import load_index
from ckptfix.formats.stmeta import restore as restore_aliases
from ckptfix.ops.convert.dcp_in import TensorStream
from ckptfix.ops.convert.options import ConvertKeywords, ConvertOptions, options_of, refuse_inapplicable
from ckptfix.ops.convert.report import ConvertReport
from ckptfix.ops.prefixes import strip_prefix_report

if TYPE_CHECKING:
    from typing_extensions import Unpack


def default_dcp_output(src: str) -> str:
    """``model.safetensors`` -> ``model.dcp`` (an index ``model.safetensors.index.json`` -> ``model.dcp``).

    Args:
        src: the safetensors file or index.

    Returns:
        The directory path next to ``src``.
    """
    s = src.rstrip("/" + os.sep)
    base = os.path.basename(s)
    for suffix in (".safetensors.index.json", ".index.json", ".safetensors"):
        if base.endswith(suffix):
            base = base[: -len(suffix)]
            break
    return os.path.join(os.path.dirname(s), base + ".dcp")


def _source_files(inp: Input) -> list[str]:
    """The safetensors files of ``inp`` (one file, or every shard of an index)."""
    src, kind = inp.path, inp.format
    if kind == Format.SAFETENSORS:
        return [src]
    if kind == Format.SHARDED:
        files = list(dict.fromkeys(load_index(src).shards.values()))
        if all(f.endswith(".safetensors") for f in files):
            return files
    raise UnsupportedError(
        f"{src}: not a safetensors file (it is {kind}); convert it to safetensors first "
        "(ckptfix convert SRC -o model.safetensors), then to DCP"
    )


def _check_output(dst: str, src: str, force: bool) -> None:
    if os.path.lexists(dst):
        if not force:
            raise OutputError(already_exists(dst, directory=True))
        if not os.path.isdir(dst) or (os.listdir(dst) and not os.path.isfile(os.path.join(dst, ".metadata"))):
            raise OutputError(f"{dst} exists and is not a DCP checkpoint directory; refusing to replace it")
    if os.path.abspath(dst) == os.path.abspath(src):
        raise OutputError(output_is_input(dst))
    parent = os.path.dirname(os.path.abspath(dst))
    if not os.path.isdir(parent):
        raise OutputError(missing_directory(parent))
    if not os.access(parent, os.W_OK):
        raise OutputError(not_writable(parent))


#: a tensor's bytes in a mapped input file: (mapping, offset, length)
Span = tuple[mmap.mmap, int, int]


def _release(span: Span | None) -> None:
    """Drop a tensor's pages from this process (they are re-read from the file if touched again).

    The mapping is private and never written, so ``MADV_DONTNEED`` only discards clean file pages:
    resident memory stays at the tensors being written, whatever the file's size.
    """
    if span is None or not hasattr(mmap, "MADV_DONTNEED"):
        return
    mm, off, n = span
    a = off - off % mmap.PAGESIZE
    if n > 0:
        try:
            mm.madvise(mmap.MADV_DONTNEED, a, n + off - a)
        except (OSError, ValueError):
            pass


def _viewing(mm: mmap.mmap) -> memoryview:
    """What a tensor over ``mm`` is made from: ``torch.frombuffer`` keeps the object it is given but not a buffer
    export, so a tensor made from the mmap itself lets ``mm.close()`` unmap the pages under it (a later read
    crashes the process).  A memoryview holds an export for as long as the tensor holds it: ``close()`` raises
    ``BufferError`` until the last such tensor is gone, and the mapping goes with it."""
    return memoryview(mm)


def _map_tensors(
    paths: Sequence[str], torch: Any
) -> tuple[dict[str, Any], dict[str, Span], dict[str, str], list[mmap.mmap], int]:
    """(name -> tensor viewing the mapped file, name -> its span, metadata of the first file, the mappings, bytes)."""
    tensors: dict[str, Any] = {}
    spans: dict[str, Span] = {}
    metadata: dict[str, str] = {}
    maps: list[mmap.mmap] = []
    total = 0
    for i, path in enumerate(paths):
        header, start = read_header(path)
        meta = header.pop("__metadata__", None) or {}
        if i == 0 and isinstance(meta, dict):
            metadata = {str(k): str(v) for k, v in meta.items()}
        mm = None
        if pins.fstat(path).st_size > 0:
            with pins.open_binary(path) as f:
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # private: writable, never written
            maps.append(mm)
        for name, h in header.items():
            dtype = ST_TO_DTYPE.get(h.get("dtype"))
            tdtype = getattr(torch, dtype, None) if dtype else None
            if tdtype is None:
                raise UnsupportedError(f"{path}: tensor {name!r} has dtype {h.get('dtype')}, which torch cannot hold")
            if name in tensors:
                raise UnsupportedError(f"{path}: tensor {name!r} is in two shards of the index")
            shape = tuple(int(s) for s in h["shape"])
            a, b = (int(x) for x in h["data_offsets"])
            es = torch.empty((), dtype=tdtype).element_size()
            if b == a:
                tensors[name] = torch.empty(shape, dtype=tdtype)
            else:
                assert mm is not None
                t = torch.frombuffer(_viewing(mm), dtype=tdtype, count=(b - a) // es, offset=start + a)
                tensors[name] = t.view(shape)
                spans[name] = (mm, start + a, b - a)
            total += b - a
    return tensors, spans, metadata, maps, total


def _releasing_planner(spans: dict[str, Span]) -> Any:
    """torch's default save planner, dropping each tensor's pages once its writer thread moved on."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    local = threading.local()

    class ReleasingPlanner(DefaultSavePlanner):
        def resolve_data(self, write_item: Any) -> Any:
            _release(getattr(local, "prev", None))  # this thread wrote it: torch's loader resolves one at a time
            local.prev = spans.get(write_item.index.fqn)
            return super().resolve_data(write_item)

    return ReleasingPlanner()


def _rows(shape: Sequence[int], rank: int, shards: int) -> tuple[int, int] | None:
    """Rank ``rank``'s rows ``[lo, hi)`` of a tensor split along dim 0 into ``shards`` (FSDP-style ceil
    division; a scalar or a tensor with fewer rows than ranks is written whole by rank 0), or None."""
    if not shape or shape[0] < shards:
        return (0, shape[0] if shape else 0) if rank == 0 else None
    step = -(-shape[0] // shards)
    lo, hi = min(shape[0], rank * step), min(shape[0], (rank + 1) * step)
    return (lo, hi) if lo < hi else None


def _save_sharded(sd: dict[str, Any], spans: dict[str, Span], writer: Any, shards: int, torch: Any) -> None:
    """Save ``sd`` as ``shards`` ranks would (each writes its rows), through torch's planner and writer.

    The steps of ``torch.distributed.checkpoint.save`` run here for every rank in turn, no process
    group needed; each rank's piece is a ``torch.frombuffer`` of exactly its rows of the mapped input.
    """
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

    local = threading.local()

    class RankPlanner(DefaultSavePlanner):
        def __init__(self, rank: int) -> None:
            super().__init__()
            self.rank = rank

        def create_local_plan(self) -> Any:
            items = []
            for fqn, t in self.state_dict.items():
                rows = _rows(tuple(t.shape), self.rank, shards)
                if rows is None:
                    continue
                whole = rows == ((0, t.shape[0]) if t.dim() else (0, 0))
                offsets = (rows[0],) + (0,) * (t.dim() - 1) if t.dim() else ()
                sizes = (rows[1] - rows[0],) + tuple(t.shape[1:]) if t.dim() else ()
                items.append(
                    WriteItem(
                        index=MetadataIndex(fqn, torch.Size(offsets)),
                        type=WriteItemType.TENSOR if whole else WriteItemType.SHARD,
                        tensor_data=TensorWriteData(
                            chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)),
                            properties=TensorProperties.create_from_tensor(t),
                            size=t.size(),
                        ),
                    )
                )
            self.plan = SavePlan(items, planner_data=self.mappings)
            return self.plan

        def resolve_data(self, write_item: Any) -> Any:
            _release(getattr(local, "prev", None))
            fqn = write_item.index.fqn
            t = self.state_dict[fqn]
            span = spans.get(fqn)
            if t.dim() == 0 or tuple(write_item.tensor_data.chunk.sizes) == tuple(t.shape):
                local.prev = span
                return t
            lo, n = write_item.tensor_data.chunk.offsets[0], write_item.tensor_data.chunk.sizes[0]
            if span is None:  # a restored view: its rows, copied (torch's loader would copy them anyway)
                local.prev = None
                return t.narrow(0, lo, n).clone()
            row = t[0].numel() * t.element_size()
            local.prev = (span[0], span[1] + lo * row, n * row)
            piece = torch.frombuffer(
                _viewing(span[0]), dtype=t.dtype, count=n * t[0].numel(), offset=span[1] + lo * row
            )
            return piece.view((n,) + tuple(t.shape[1:]))

    planners = [RankPlanner(r) for r in range(shards)]
    plans = []
    for r, planner in enumerate(planners):
        planner.set_up_planner(sd, storage_meta=writer.storage_meta(), is_coordinator=r == 0)
        writer.set_up_storage_writer(r == 0, rank=r, use_collectives=True)
        plans.append(writer.prepare_local_plan(planner.create_local_plan()))
    plans, metadata = planners[0].create_global_plan(plans)
    plans = writer.prepare_global_plan(plans)
    results = []
    for r, planner in enumerate(planners):
        fut = writer.write_data(planner.finish_plan(plans[r]), planner)
        fut.wait()
        results.append(fut.value())
    writer.finish(metadata, results)


def _verify(out: str, final: str, expected: dict[str, Any], spans: dict[str, Span], torch: Any, progress: Any) -> None:
    """Read ``out`` back through ckptfix's DCP reader: the same names, dtypes, shapes and bytes."""

    def fail(what: str) -> VerificationError:
        return VerificationError(f"{final}: {what} when read back; nothing was written")

    try:
        meta = read_metadata(out)
        meta.check_safe()
        validate(meta)
    except CkptfixError as e:
        raise fail(f"the written checkpoint does not read ({e})") from None
    if set(meta.entries) != set(expected):
        raise fail("the checkpoint holds other entries than the source")
    with Files(out) as files, warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # frombuffer of a read-only block: only compared
        for name, t in expected.items():
            entry = meta.entries[name]
            if not isinstance(entry, TensorEntry):
                raise fail(f"entry {name!r} is not a tensor")
            want = str(t.dtype).removeprefix("torch.")
            if entry.dtype != want or tuple(entry.shape) != tuple(t.shape):
                raise fail(f"tensor {name!r} is {entry.dtype} {list(entry.shape)}, expected {want} {list(t.shape)}")
            if t.numel() == 0:
                continue
            span = spans.get(name)
            flat = None if span else t.contiguous().reshape(-1).view(torch.uint8)  # a view: its bytes, in memory
            size = span[2] if span else t.numel() * t.element_size()
            pos = 0
            for block in TensorStream(files, entry):
                n = len(block)
                if pos + n > size:
                    raise fail(f"tensor {name!r} has more than {size} bytes")
                if span:  # memcmp against the mapped input
                    with memoryview(span[0]) as m, m[span[1] + pos : span[1] + pos + n] as w:
                        same = block.startswith(w)
                else:
                    assert flat is not None
                    same = torch.equal(torch.frombuffer(block, dtype=torch.uint8), flat[pos : pos + n])
                if not same:
                    raise fail(f"tensor {name!r} differs from the source near byte {pos}")
                pos += n
                progress(n)
            if pos != size:
                raise fail(f"tensor {name!r} has {pos} bytes, expected {size}")
            _release(span)


def convert_to_dcp(
    src: str | os.PathLike,
    dst: str | os.PathLike | None = None,
    *,
    outputs: OutputOptions | None = None,
    options: ConvertOptions | None = None,
    **keywords: Unpack[ConvertKeywords],
) -> ConvertReport:
    """Write a safetensors file (or a sharded safetensors index) as a DCP checkpoint directory.

    The result loads with ``torch.distributed.checkpoint.load(model.state_dict(), checkpoint_id=dst,
    no_dist=True)`` (or under a process group, any number of ranks) and with ckptfix's DCP reader.
    Tied tensors a ckptfix-written file stored once are written under each of their names.

    Args:
        src: a ``.safetensors`` file or ``*.safetensors.index.json`` (or its directory).
        dst: the output directory (default: ``src`` with ``.dcp``); overrides ``outputs.output``.
        outputs, options, keywords: :class:`~ckptfix.files.outputs.OutputOptions` and
            :class:`~ckptfix.ops.convert.options.ConvertOptions`, or their fields as keywords; the ones that apply:
        strip_prefix: ``True`` strips wrapper prefixes (``module.`` ...); a string strips that one.
        verify: read the written checkpoint back (ckptfix's DCP reader) and compare every byte.
        force: replace an existing output (only a DCP directory, or an empty one).
        fsync: flush the files and directories to disk before returning.
        progress: ``progress(done_bytes, total_bytes)``.
        jobs: threads torch's writer uses (``0``: one per CPU).
        shards: write the checkpoint as this many ranks would: ``__<rank>_<n>.distcp`` files, each tensor
            split along dim 0 (ceil division, as FSDP does; tensors with fewer rows than ranks and scalars
            are written whole by rank 0).
        ckptfix_metadata: unused here (DCP has no place for it); accepted for symmetry with the other direction.

    Returns:
        A ``ConvertReport`` with ``direction="to-dcp"``.

    Raises:
        UnsupportedError: a non-safetensors input, or a dtype torch lacks.  OptionNotApplicableError: an
            option that only applies to another direction (writing safetensors ...).  OutputError: the
            output exists (without ``force``) or cannot be written.
        TorchMissingError: torch is not installed.  VerificationError: the output did not read back
            equal (nothing is left behind).
    """
    t0 = time.perf_counter()
    o, c = options_of(dst, outputs, options, keywords)
    refuse_inapplicable("dcp", o, c)
    strip_prefix, verify, force, fsync, progress, jobs, shards = (
        c.strip_prefix, o.verify, o.force, bool(o.fsync), o.progress, o.jobs, c.shards
    )  # fmt: skip
    if shards < 1:
        raise UnsupportedError(f"--shards {shards}: pass a number of ranks, 1 or more")
    given, src = src, os.fspath(src)
    out = o.output.rstrip("/" + os.sep) if o.output is not None else default_dcp_output(src)
    paths = _source_files(classify(given))  # the router's Input, or the one sniff here
    _check_output(out, src, force)
    torch = require_torch("convert to DCP")
    import torch.distributed.checkpoint as dcp

    report = ConvertReport(source=src, outputs=[out], source_format="safetensors", direction="to-dcp")
    report.used_torch = True
    tensors, spans, metadata, maps, total = _map_tensors(paths, torch)
    sd = restore_aliases(tensors, metadata)  # tied names back, in the recorded order
    if strip_prefix:
        new_sd, detail = strip_prefix_report(sd, strip_prefix if isinstance(strip_prefix, str) else None)
        report.renamed = sum(1 for a, b in zip(sd, new_sd, strict=False) if a != b)
        sd = dict(new_sd)
    if not sd:
        raise NoTensorsError(f"{src}: the safetensors file holds no tensors, so there is nothing to write")
    by_id = {id(tensors[n]): sp for n, sp in spans.items()}
    spans = {k: by_id[id(v)] for k, v in sd.items() if id(v) in by_id}  # aliases share their tensor's span
    n_entries = len(sd)
    report.aliases = {k: v for k, v in json.loads(metadata.get("ckptfix.aliases", "{}") or "{}").items()}
    tally = Tally(progress, total * (2 if verify else 1))
    parent = os.path.dirname(os.path.abspath(out))
    try:
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.", suffix=".tmp", dir=parent)
    except OSError as e:
        raise output_error(e, out) from None
    try:
        os.chmod(tmp, 0o777 & ~_umask())
        writer = dcp.FileSystemWriter(tmp, thread_count=resolve_jobs(jobs), sync_files=fsync)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "no process group: saving as a single process"
            if shards > 1:
                _save_sharded(sd, spans, writer, shards, torch)
            else:
                dcp.save(sd, storage_writer=writer, planner=_releasing_planner(spans), no_dist=True)
        for span in spans.values():
            _release(span)
        tally.add(total)
        if verify:
            _verify(tmp, out, sd, spans, torch, tally.add)
            report.verified = True
        if fsync:
            fsync_dir(os.path.join(tmp, ".metadata"))
        replace_directory(tmp, out, fsync=fsync)
        tmp = ""
    except OSError as e:
        raise output_error(e, out) from None
    finally:
        del sd, tensors
        for m in maps:
            try:
                m.close()
            except BufferError:  # a tensor still views it (_viewing), e.g. in a traceback: unmapped with the last one
                pass
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    report.tensors = n_entries
    report.bytes = total
    report.seconds = time.perf_counter() - t0
    return report


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask & (stat.S_IRWXU | stat.S_IRWXG | stat.S_IRWXO)
