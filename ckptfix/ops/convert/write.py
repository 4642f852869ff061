"""Writing safetensors files with one-pass verification, and the atomic rename of every output.

A tensor that is a byte range of a source file is copied by :mod:`ckptfix.files.fileio` (reflink,
``copy_file_range`` for folio-congruent offsets, else a 1 MiB buffer, into a file whose blocks were
reserved first where that measured faster: :func:`~ckptfix.files.fileio.preallocate`) and read back once: piece by
piece right after each write, compared with the source piece (:func:`~ckptfix.files.fileio.copy_checked`).
With ``fsync`` the read-back follows the flush, the range's cached pages are dropped first so the
bytes come from the device, and a range with a stored CRC-32 (a torch zip record holding exactly the
tensor) is checked against it, one device read instead of two.  Gathered views and torch tensors are
compared chunk by chunk while their bytes are still in our buffer.

When every tensor is a byte range of a local file, the copy runs as a few contiguous streams of about equal
bytes, each in its own thread (:func:`_streams`): ``--jobs N`` streams, and two for 64 MiB or more at the
default ``--jobs 1`` where the process may run on two CPUs (measured faster warm, the same cold);
``CKPTFIX_COPY_STREAMS=N`` sets the number.  The bytes written are the same for any number.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import threading
from typing import Iterator, Mapping, NamedTuple, Sequence

from ckptfix.errors import CkptfixError, CorruptCheckpointError, VerificationError
from ckptfix.files import pins
from ckptfix.files.atomic import fsync_dir, note_finished, output_error
from ckptfix.files.fileio import (
    BUFFER,
    copy_checked,
    copy_pieces,
    copy_range,
    in_user_buffer,
    preallocate,
    pwrite_all,
    verify_crc,
    verify_equal,
)
from ckptfix.files.parallel import Tally, resolve_jobs, run_tasks
from ckptfix.formats.safetensors_fmt import MAX_HEADER, read_header, st_shape
from ckptfix.ops.convert.header import layout, safetensors_header, shard
from ckptfix.ops.convert.items import Fds, Item
from ckptfix.ops.convert.paths import check_outputs, shard_names, temp_for
from ckptfix.ops.convert.remote_in import Sources, copy_group, copy_remote, group_small, is_remote
from ckptfix.ops.convert.report import ConvertReport, Progress

#: bytes per in-kernel copy call: progress moves within a big tensor
STEP = 8 << 20

_SOURCES_LOCK = threading.Lock()

#: a copy of local byte ranges this large or larger runs as contiguous streams (:func:`_streams`)
STREAM_MIN = 64 << 20

#: the streams of such a copy with ``--jobs 1``: two measured faster than one warm (whole ``convert`` against
#: ``cp``, best of 5: 0.98x vs 1.08x at 0.5 GB ``--no-verify``, 0.69x vs 0.97x at 1.47 GB verified), the same
#: or better cold (benchmarks/README.md, issue 25 fourth pass)
STREAMS = 2


class Segment(NamedTuple):
    """A piece of one tensor's bytes: a byte range of a local source file and where it goes in the output."""

    item: Item
    src_path: str
    off: int  # where it starts in the source
    pos: int  # where it goes in the output (absolute)
    size: int
    rel: int  # where it starts in the tensor


class Writer:
    """Writes safetensors files; with ``verify`` every byte written is read back once and checked.

    A copied range is checked against the source piece just copied (after an fsync: against the CRC-32
    its source stores, else the source range; :func:`ckptfix.files.fileio.verify_crc`,
    :func:`~ckptfix.files.fileio.verify_equal`); a gathered chunk against the buffer it was written from.
    Together with the structural check in :meth:`check` (header read back, offsets tiling the data
    section exactly, file size), that proves every byte of the file equals the source.
    """

    def __init__(self, total: int, progress: Progress | None, verify: bool) -> None:
        self.tally = Tally(progress, total)
        self.verify = verify
        self.fds = Fds()
        self.sources: Sources | None = None  # remote inputs (URLs), opened on first use
        self.jobs = 1
        self.cancel = threading.Event()  # a failed stream or Ctrl-C: the others stop at their next piece

    def tick(self, n: int) -> None:
        """Count ``n`` bytes done and report progress (thread-safe).

        Args:
            n: bytes just written (or verified).
        """
        self.tally.add(n)

    def write(
        self, path: str, items: list[Item], metadata: Mapping[str, str] | None, fsync: bool, jobs: int = 1
    ) -> None:
        """Write one safetensors file: header, then every item's bytes at its offset.

        Args:
            path: the (temp) file, created empty.
            items: the items in file order, ``begin`` set (:func:`~ckptfix.ops.convert.header.layout`).
            metadata: the ``__metadata__`` entries.
            fsync: flush the file before returning.
            jobs: items written at a time, each at its own offset (same bytes for any number).

        Raises:
            VerificationError: with ``verify``, a chunk did not read back equal.
            CorruptCheckpointError: a source ended early or gave the wrong number of bytes.
        """
        header = safetensors_header(items, metadata)
        self.jobs = jobs
        done_before = self.tally.done
        # no O_TRUNC: the temp file is new and empty, and truncating makes ext4 flush it on close (auto_da_alloc)
        fd = os.open(path, os.O_RDWR)
        try:
            base = len(header)
            # the blocks reserved first where that measured faster (ext4); a full disk is found before any copy
            preallocate(fd, base + sum(it.nbytes for it in items))
            pwrite_all(fd, header, 0)
            # without fsync a copied range is read back right away (still in the page cache); with it, once
            # flushed, from the device
            inline = self.verify and not fsync
            # in the order of the source bytes (the output's layout is fixed already): a cold input is then read
            # sequentially, with the kernel's readahead, as cp reads it
            order = sorted(items, key=_source_order)
            tasks = [functools.partial(self._item, it, fd, base, path, inline) for it in order]
            if any(is_remote(r[0]) for it in order for r in it.ranges() or ()):  # a URL: small neighbours together
                tasks = [
                    functools.partial(self._item, g[0], fd, base, path, inline)
                    if len(g) == 1
                    else functools.partial(self._remote_group, g, fd, base, path)
                    for g in group_small(order)
                ]
            parts = _streams(order, base, jobs) if len(tasks) == len(order) else None
            if parts is not None:  # local byte ranges only: the copy as a few contiguous streams
                tasks = [functools.partial(self._stream, part, fd, path, inline) for part in parts]
                jobs = len(parts)
            run_tasks(tasks, jobs, cancel=self.cancel)
            if fsync:
                os.fsync(fd)
                if self.verify:
                    copied = [it for it in items if it.ranges() is not None]
                    run_tasks([functools.partial(self._check_ranges, it, fd, base, path, True) for it in copied], jobs)
                    # the copy and the check each counted at most half of a range's bytes: the rest, to the byte
                    self.tick(max(0, done_before + sum(it.nbytes for it in items) - self.tally.done))
        finally:
            os.close(fd)

    def _item(self, it: Item, fd: int, base: int, path: str, inline: bool) -> None:
        """One item's bytes at its offset in ``path`` (open as ``fd``)."""
        pos = base + it.begin
        ranges = it.ranges()
        if ranges is not None:
            for src_path, off, size, _crc in ranges:
                if is_remote(src_path):  # a URL: streamed in range requests, checked as received (remote_in)
                    self._remote(it, src_path, off, size, _crc, fd, pos, path, base)
                    pos += size
                    continue
                src = self.fds.get(src_path)
                if inline:
                    # copied and read back piece by piece, each compared with the source piece still in the
                    # buffer: measured cheaper than a CRC-32 of the piece (memcmp runs ~3x faster than zlib's
                    # CRC), so the stored CRC is used by the check after an fsync, where it saves a device read
                    at = copy_checked(src, off, fd, pos, size, None, progress=self.tick)
                    if at is not None:  # compared with the source, not a CRC: the output is wrong
                        self._mismatch(it, src_path, off, fd, pos, size, None, path, pos - base - it.begin, at)
                else:
                    for at in range(0, size, STEP):  # in steps, so that progress moves within a big tensor
                        n = min(STEP, size - at)
                        copy_range(src, off + at, fd, pos + at, n)
                        self.tick(n // 2 if self.verify else n)
                pos += size
            if pos != base + it.begin + it.nbytes:
                raise CorruptCheckpointError(f"tensor {it.name!r}: {pos - base - it.begin} bytes, expected {it.nbytes}")
            return
        for chunk in it.chunks(self.fds):
            n = pwrite_all(fd, chunk, pos)
            if self.verify and not _written_equal(fd, pos, chunk, n):
                raise _differs(path, it, pos - base - it.begin)
            pos += n
            self.tick(n)
        if pos != base + it.begin + it.nbytes:
            raise CorruptCheckpointError(f"tensor {it.name!r}: got {pos - base - it.begin} bytes, expected {it.nbytes}")

    def _stream(self, part: list[Segment], fd: int, path: str, inline: bool) -> None:
        """Copy one stream's segments in order (see :func:`_streams`), each read back as written with ``inline``.

        Neighbouring segments of one source go through :func:`~ckptfix.files.fileio.copy_pieces` together (the source
        read straight through); one that :func:`~ckptfix.files.fileio.copy_range` would reflink or copy in the kernel
        goes alone, that way.
        """
        count = self.tick if inline or not self.verify else (lambda n: self.tick(n // 2))

        def tick(n: int) -> None:  # after every piece written: a stream is a long task, Ctrl-C must not wait for it
            if self.cancel.is_set():
                raise _Cancelled
            count(n)

        run: list[Segment] = []
        for seg in [*part, None]:
            if run and (seg is None or seg.src_path != run[0].src_path or not self._buffered(seg, fd)):
                pieces = [(sg.off, sg.pos, sg.size) for sg in run]
                bad = copy_pieces(self.fds.get(run[0].src_path), pieces, fd, check=inline, progress=tick)
                if bad is not None:
                    sg = run[bad[0]]
                    self._mismatch(sg.item, sg.src_path, sg.off, fd, sg.pos, sg.size, None, path, sg.rel, bad[1])
                run = []
            if seg is None:
                break
            if self._buffered(seg, fd):
                run.append(seg)
                continue
            src = self.fds.get(seg.src_path)
            if inline:
                diff = copy_checked(src, seg.off, fd, seg.pos, seg.size, None, progress=tick)
                if diff is not None:
                    self._mismatch(seg.item, seg.src_path, seg.off, fd, seg.pos, seg.size, None, path, seg.rel, diff)
                continue
            for at in range(0, seg.size, STEP):  # in steps, so that progress moves within a big tensor
                n = min(STEP, seg.size - at)
                copy_range(src, seg.off + at, fd, seg.pos + at, n)
                tick(n)

    @staticmethod
    def _buffered(seg: Segment, fd: int) -> bool:
        return in_user_buffer(seg.off, seg.pos, seg.size, fd)

    def _sources(self) -> Sources:
        if self.sources is None:
            with _SOURCES_LOCK:
                if self.sources is None:
                    self.sources = Sources(self.jobs)
        return self.sources

    def _remote_group(self, group: list[Item], fd: int, base: int, path: str) -> None:
        """Small tensors of one remote object, fetched in one request, each written and compared as written."""

        def write(it: Item, data: memoryview) -> None:
            pos = base + it.begin
            n = pwrite_all(fd, data, pos)
            if n != it.nbytes:
                raise CorruptCheckpointError(f"tensor {it.name!r}: got {n} bytes, expected {it.nbytes}")
            if self.verify and not _written_equal(fd, pos, data, n):
                raise _differs(path, it, 0)

        copy_group(self._sources(), group, write, tick=self.tick)

    def _remote(
        self, it: Item, url: str, off: int, size: int, crc: int | None, fd: int, pos: int, path: str, base: int
    ) -> None:
        """One range of a remote source: pieces fetched in parallel, written in order, each compared as written."""
        sources = self._sources()

        def write(data: bytes, at: int) -> None:
            n = pwrite_all(fd, data, pos + at)
            if self.verify and not _written_equal(fd, pos + at, data, n):
                raise _differs(path, it, pos + at - base - it.begin)

        copy_remote(sources, url, off, size, crc, write, name=it.name, tick=self.tick)

    def close(self) -> None:
        """Close the source files and remote sources opened."""
        self.fds.close()
        if self.sources is not None:
            self.sources.close()
            self.sources = None

    def _check_ranges(self, it: Item, fd: int, base: int, path: str, from_device: bool = False) -> None:
        """Read an item's copied ranges back once (after the fsync): against the source's CRC-32, else the source."""
        pos = base + it.begin
        for src_path, off, size, crc in it.ranges() or ():
            if crc is not None:
                at = verify_crc(fd, pos, size, crc, from_device=from_device)
            elif is_remote(src_path):  # compared with the bytes received as they were written
                at = None
            else:
                at = verify_equal(self.fds.get(src_path), off, fd, pos, size, from_device=from_device)
            if at is not None:
                self._mismatch(it, src_path, off, fd, pos, size, crc, path, pos - base - it.begin, at)
            if not is_remote(src_path):  # a remote range was counted whole as it was received
                self.tick(size // 2)  # the copy counted the other half, or a little less (see write)
            pos += size

    def _mismatch(
        self,
        it: Item,
        src_path: str,
        off: int,
        fd: int,
        pos: int,
        size: int,
        crc: int | None,
        path: str,
        rel: int,
        at: int,
    ) -> None:
        """Raise for a range that did not read back right: a damaged source (its CRC-32 fails) or a bad output.

        ``rel`` is where the range starts in the tensor, ``at`` where in the range the check failed.
        """
        if crc is not None and not is_remote(src_path):
            # the output or the source? comparing the two tells (rare, so the cost does not matter)
            diff = verify_equal(self.fds.get(src_path), off, fd, pos, size)
            if diff is None:
                raise CorruptCheckpointError(
                    f"{src_path}: tensor {it.name!r} does not match the CRC-32 its zip record stores; "
                    "the source file is damaged — re-copy it (or re-save it from where it was made)"
                )
            at = diff
        raise _differs(path, it, rel + at)

    def check(self, path: str, items: list[Item], metadata: Mapping[str, str] | None) -> None:
        """Re-read the written file's header: dtype, shape and offsets of every tensor, metadata, size.

        Args:
            path: the written file.
            items: the items written, ``begin`` set.
            metadata: the metadata written.

        Raises:
            VerificationError: naming what reads back differently.
        """
        try:
            header, start = read_header(path, max_bytes=MAX_HEADER)
        except CkptfixError as e:
            raise VerificationError(f"{path}: the written file does not read back: {e}") from None
        meta = header.pop("__metadata__", None)
        if (meta or None) != (dict(metadata) if metadata else None):
            raise VerificationError(f"{path}: metadata read back differs from what was written")
        if set(header) != {it.name for it in items}:
            raise VerificationError(f"{path}: the written file holds other tensors than the source")
        end = 0
        for it in sorted(items, key=lambda i: i.begin):  # the byte ranges tile the data section exactly
            h = header[it.name]
            if (
                h.get("dtype") != it.st_dtype
                or list(h.get("shape", ())) != st_shape(it.dtype, it.shape)
                or list(h.get("data_offsets", ())) != [it.begin, it.begin + it.nbytes]
                or it.begin != end
            ):
                raise VerificationError(
                    f"{path}: tensor {it.name!r} reads back as {h}, expected dtype "
                    f"{it.st_dtype} shape {list(it.shape)} at [{end}, {end + it.nbytes}]"
                )
            end += it.nbytes
        if os.path.getsize(path) != start + end:
            raise VerificationError(f"{path}: file size {os.path.getsize(path)} != expected {start + end}")


class _Cancelled(Exception):
    """A copy stream stopping because another failed or the caller was interrupted (run_tasks re-raises that)."""


def stream_count(jobs: int, total: int) -> int:
    """How many contiguous streams copy ``total`` bytes of local byte ranges with ``--jobs jobs``.

    ``jobs`` (``0``: one per CPU) when above 1; else :data:`STREAMS` for :data:`STREAM_MIN` bytes or more
    where this process may run on two CPUs or more, else one.  ``CKPTFIX_COPY_STREAMS=N`` sets it (``1``: one
    stream, in this thread).  No stream is smaller than :data:`STREAM_MIN` / 8.
    """
    env = os.environ.get("CKPTFIX_COPY_STREAMS", "").strip()
    if env.isascii() and env.isdigit() and int(env) >= 1:  # "²".isdigit() is True, int("²") raises
        k = int(env)
    elif resolve_jobs(jobs) > 1:
        k = resolve_jobs(jobs)
    elif total >= STREAM_MIN and len(os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else ()) >= 2:
        k = STREAMS
    else:
        k = 1
    return max(1, min(k, total // (STREAM_MIN // 8)))


def _streams(order: Sequence[Item], base: int, jobs: int) -> list[list[Segment]] | None:
    """The copy of ``order`` (items in source order) cut into contiguous streams of about equal bytes.

    Each stream reads its part of the sources in order, straight through the gaps between neighbouring
    tensors (:func:`~ckptfix.files.fileio.copy_pieces`), so a cold input is read as a few sequential streams (the
    kernel reads ahead in each); a tensor may be split between two streams.

    Args:
        order: the items, sorted by source file and offset.
        base: where the data section starts in the output.
        jobs: ``--jobs`` (see :func:`stream_count`).

    Returns:
        The streams' segments (one stream: copied in this thread), or None where the items are not all byte
        ranges of local files (they are then copied one by one, as tasks).

    Raises:
        CorruptCheckpointError: an item whose byte ranges do not add up to its size.
    """
    segs: list[Segment] = []
    for it in order:
        ranges = it.ranges()
        if ranges is None:
            return None
        pos, rel = base + it.begin, 0
        for src_path, off, size, _crc in ranges:
            if is_remote(src_path):
                return None
            segs.append(Segment(it, src_path, off, pos, size, rel))
            pos, rel = pos + size, rel + size
        if rel != it.nbytes:
            raise CorruptCheckpointError(f"tensor {it.name!r}: {rel} bytes, expected {it.nbytes}")
    total = sum(sg.size for sg in segs)
    k = stream_count(jobs, total)
    if k <= 1:
        return [segs] if segs else None
    # cut points: k equal shares, at whole buffers of the copy
    cuts = [total * i // k // BUFFER * BUFFER for i in range(1, k)] + [total]
    parts: list[list[Segment]] = [[]]
    done = 0
    for sg in segs:
        while sg.size:
            room = cuts[len(parts) - 1] - done
            if room <= 0:
                parts.append([])
                continue
            n = min(room, sg.size)
            parts[-1].append(sg._replace(size=n))
            done += n
            sg = sg._replace(off=sg.off + n, pos=sg.pos + n, size=sg.size - n, rel=sg.rel + n)
    return [p for p in parts if p]


def _source_order(it: Item) -> tuple[int, str, int]:
    """Sort key: copied ranges by source file and offset, then the items gathered or built by torch."""
    ranges = it.ranges()
    if not ranges:
        return (1, "", 0)
    return (0, ranges[0][0], ranges[0][1])


def _differs(path: str, it: Item, at: int) -> VerificationError:
    return VerificationError(
        f"{path}: tensor {it.name!r} differs from the source near byte {at} of the tensor "
        "when read back; the output was removed"
    )


def _written_equal(fd: int, pos: int, data: bytes | bytearray | memoryview, n: int) -> bool:
    """Do the ``n`` bytes of the file ``fd`` at ``pos`` equal the first ``n`` bytes of ``data``?

    The file's pages are mapped, not copied, and compared with ``memcmp`` (``bytes.startswith``).
    """
    import mmap

    if not isinstance(data, (bytes, bytearray)):
        data = bytes(data)
    if n == 0:
        return True
    gran = mmap.ALLOCATIONGRANULARITY
    base = pos - pos % gran
    try:
        m = mmap.mmap(
            fd,
            n + (pos - base),
            flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
            prot=mmap.PROT_READ,
            offset=base,
        )
    except (ValueError, OSError):
        return False
    try:
        with memoryview(m) as v, v[pos - base : pos - base + n] as w:
            return len(w) == n and data.startswith(w)
    finally:
        m.close()


@contextlib.contextmanager
def _named_as(tmp: str, final: str) -> Iterator[None]:
    """Verification errors name the output the user asked for, not the temp file (which is removed)."""
    try:
        yield
    except VerificationError as e:
        raise VerificationError(str(e).replace(tmp, final)) from None


def write_outputs(
    dst: str,
    items: Sequence[Item],
    metadata: dict[str, str],
    *,
    max_shard_size: int | None,
    verify: bool,
    fsync: bool,
    force: bool,
    src: str,
    progress: Progress | None,
    report: ConvertReport,
    jobs: int = 1,
) -> None:
    """Write ``items`` as ``dst`` (or as shards + index), through temp files renamed into place once verified.

    Args:
        dst: the output (the shards' base name when sharded).
        items: the tensors in state-dict order.
        metadata: the ``__metadata__`` of every file (and the index's ``metadata``).
        max_shard_size: bytes per shard, or None for one file.
        verify: compare every chunk as written and re-read every header before the rename.
        fsync: flush files and directory.
        force: replace existing outputs.
        src: the input (never overwritten).
        progress: ``progress(done_bytes, total_bytes)``.
        report: gets ``outputs``, ``index``, ``bytes``, ``tensors`` and ``verified``.
        jobs: tensors written at a time (memory: ``jobs`` x the 8 MiB copy buffer).

    Raises:
        OutputError: an output cannot be written or exists without ``force``.
        VerificationError: the written bytes or header do not read back; nothing is left behind.
    """
    shards = shard(items, max_shard_size)
    if len(shards) == 1:
        finals = [dst]
        index_path = None
    else:
        finals = shard_names(dst, len(shards))
        index_path = dst + ".index.json" if dst.endswith(".safetensors") else dst + ".safetensors.index.json"
    check_outputs(finals + ([index_path] if index_path else []), src, force)
    total = sum(it.nbytes for it in items)
    w = Writer(total, progress, verify)
    temps: list[str] = []
    try:
        laid = []
        for final, part in zip(finals, shards, strict=False):
            tmp = temp_for(final)
            temps.append(tmp)
            ordered = layout(part)
            laid.append(ordered)
            with _named_as(tmp, final):
                w.write(tmp, ordered, metadata, fsync, jobs)
        if verify:
            for tmp, final, ordered in zip(temps, finals, laid, strict=False):
                with _named_as(tmp, final):
                    w.check(tmp, ordered, metadata)
            report.verified = True
        if index_path:
            temps.append(_write_index(index_path, finals, shards, total, metadata, fsync))
        pins.check_unchanged()
        for tmp, final in zip(temps, finals + ([index_path] if index_path else []), strict=False):
            try:
                os.replace(tmp, final)
            except OSError as e:
                raise output_error(e, final) from None
            note_finished(final)
        temps.clear()
        if fsync:
            fsync_dir(dst)
    finally:
        w.close()
        for tmp in temps:
            try:
                os.unlink(tmp)
            except OSError:
                pass
    report.outputs = finals
    report.index = index_path
    report.bytes = total
    report.tensors = len(items)


def _write_index(
    index_path: str, finals: list[str], shards: list[list[Item]], total: int, metadata: dict[str, str], fsync: bool
) -> str:
    """The sharded index (``weight_map`` in state-dict order) written to a temp file; returns its path."""
    weight_map = {}
    for final, part in zip(finals, shards, strict=False):
        for it in part:
            weight_map[it.name] = os.path.basename(final)
    doc = {"metadata": {"total_size": total, **metadata}, "weight_map": weight_map}
    idx_tmp = temp_for(index_path)
    with open(idx_tmp, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    return idx_tmp
