"""``open_zip``: a zip archive's directory and stored members read without :mod:`zipfile` (start-up).

:mod:`zipfile` imports :mod:`shutil` (and with it :mod:`bz2`, :mod:`lzma`, :mod:`fnmatch`), :mod:`binascii`
and :mod:`pathlib` (with :mod:`urllib.parse` and :mod:`ipaddress`): 2-5 ms of every ``inspect`` and ``scan``,
about a fifth of what they import beyond Click.  A ``torch.save`` archive is the plainest of zips (stored
members, no comment, no encryption, names in UTF-8, a ZIP64 end record), so :func:`open_zip` reads such
an archive itself, with :mod:`zipfile`'s exact rules, and hands anything else to :class:`zipfile.ZipFile`:

- the archive: an end record without a comment as the file's last 22 bytes, a ZIP64 end record and
  locator exactly as :mod:`zipfile` finds them or none, a central directory that ends where the end
  records begin (no data before the archive) and that parses whole;
- each entry: stored, general-purpose flags among "sizes after the data" (0x8) and "UTF-8 name"
  (0x800), no extra field and no comment, a name without NUL, a version :mod:`zipfile` reads;
- opening a member: the local header is what :mod:`zipfile` accepts (signature, the same name) and the
  data ends inside the file; its bytes are checked against the CRC-32 when read to the end, as
  :mod:`zipfile` does (``zipfile.BadZipFile("Bad CRC-32 for file ...")``).

What fails a rule is read by :class:`zipfile.ZipFile` (imported then), which raises its own errors, so every
archive gets what :mod:`zipfile` gives it: the same names, entries, offsets, sizes, CRCs, bytes and errors.
Only the attributes ckptfix reads are kept (:class:`Entry`).
"""

from __future__ import annotations

import os
import struct
import threading
import zlib
from typing import IO, Any, Union

__all__ = ["Entry", "ZipDir", "open_zip"]

_END = struct.Struct("<4s4H2LH")  # zipfile.structEndArchive
_END64_LOCATOR = struct.Struct("<4sLQL")  # zipfile.structEndArchive64Locator
_END64 = struct.Struct("<4sQ2H2L4Q")  # zipfile.structEndArchive64
_CENTRAL = struct.Struct("<4s4B4HL2L5H2L")  # zipfile.structCentralDir
_LOCAL = struct.Struct("<4s2B4HL2L2H")  # zipfile.structFileHeader
_MAX_EXTRACT_VERSION = 63  # zipfile.MAX_EXTRACT_VERSION
_PLAIN_FLAGS = 0x8 | 0x800


class Entry:
    """One member as :class:`zipfile.ZipInfo` describes it (the attributes ckptfix reads)."""

    __slots__ = (
        "filename",
        "orig_filename",
        "header_offset",
        "file_size",
        "compress_size",
        "CRC",
        "compress_type",
        "flag_bits",
        "extract_version",
    )

    def __init__(self, name: str, c: tuple[Any, ...]) -> None:
        self.filename = self.orig_filename = name
        self.extract_version, self.flag_bits, self.compress_type = c[3], c[5], c[6]
        self.CRC, self.compress_size, self.file_size, self.header_offset = c[9], c[10], c[11], c[18]

    def __repr__(self) -> str:
        return f"<Entry {self.filename!r} file_size={self.file_size}>"


class _Member:
    """A stored member's bytes, read as :class:`zipfile.ZipExtFile` reads a stored member: the same raw reads
    (4 KiB at least), so the CRC-32 is checked at the same call (when the raw reads reach the end)."""

    MIN_READ_SIZE = 4096  # zipfile.ZipExtFile's
    MAX_N = 1 << 31 - 1

    def __init__(self, f: IO[bytes], lock: threading.Lock, start: int, entry: Entry) -> None:
        self._f, self._lock, self._pos, self._entry = f, lock, start, entry
        self._compress_left = entry.compress_size
        self._left = entry.file_size
        self._eof = False
        self._readbuffer = b""
        self._offset = 0
        self._crc = 0
        self.closed = False

    def read(self, n: int | None = -1) -> bytes:
        if self.closed:
            raise ValueError("read from closed file.")
        if n is None or n < 0:
            buf = self._readbuffer[self._offset :]
            self._readbuffer = b""
            self._offset = 0
            while not self._eof:
                buf += self._read1(self.MAX_N)
            return buf
        end = n + self._offset
        if end < len(self._readbuffer):
            buf = self._readbuffer[self._offset : end]
            self._offset = end
            return buf
        n = end - len(self._readbuffer)
        buf = self._readbuffer[self._offset :]
        self._readbuffer = b""
        self._offset = 0
        while n > 0 and not self._eof:
            data = self._read1(n)
            if n < len(data):
                self._readbuffer = data
                self._offset = n
                buf += data[:n]
                break
            buf += data
            n -= len(data)
        return buf

    def _read1(self, n: int) -> bytes:
        if self._eof or n <= 0:
            return b""
        data = self._read2(n)
        self._eof = self._compress_left <= 0
        data = data[: self._left]
        self._left -= len(data)
        if self._left <= 0:
            self._eof = True
        self._crc = zlib.crc32(data, self._crc)
        if self._eof and self._crc != self._entry.CRC:
            import zipfile

            raise zipfile.BadZipFile(f"Bad CRC-32 for file {self._entry.filename!r}")
        return data

    def _read2(self, n: int) -> bytes:
        if self._compress_left <= 0:
            return b""
        n = min(max(n, self.MIN_READ_SIZE), self._compress_left)
        with self._lock:  # members share the file (as zipfile's _SharedFile)
            self._f.seek(self._pos)
            data = self._f.read(n)
            self._pos = self._f.tell()
        self._compress_left -= len(data)
        if not data:
            raise EOFError
        return data

    def close(self) -> None:
        self.closed = True

    def __enter__(self) -> _Member:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ZipDir:
    """The read side of :class:`zipfile.ZipFile` that ckptfix uses, over a plain archive (:func:`open_zip`)."""

    def __init__(self, file: Union[str, "os.PathLike[str]", IO[bytes]], f: IO[bytes], entries: list[Entry]) -> None:
        self._file, self._f, self._own = file, f, not hasattr(file, "read")
        self._entries = entries
        self._by_name = {e.filename: e for e in entries}  # the last of a repeated name, as zipfile
        self._real: Any = None
        self._lock = threading.Lock()
        self._size = f.seek(0, 2)

    def infolist(self) -> list[Entry]:
        return list(self._entries)

    def namelist(self) -> list[str]:
        return [e.filename for e in self._entries]

    def getinfo(self, name: str) -> Entry:
        e = self._by_name.get(name)
        if e is None:
            raise KeyError(f"There is no item named {name!r} in the archive")
        return e

    def open(self, name: str | Entry, mode: str = "r") -> Any:
        if mode != "r":
            raise ValueError('open() requires mode "r"')
        entry = name if isinstance(name, Entry) else self.getinfo(name)
        with self._lock:
            self._f.seek(entry.header_offset)
            head = self._f.read(_LOCAL.size)
            raw = self._f.read(_LOCAL.unpack(head)[10]) if len(head) == _LOCAL.size else b""
        if len(head) == _LOCAL.size:
            h = _LOCAL.unpack(head)
            start = entry.header_offset + _LOCAL.size + h[10] + h[11]
            if h[0] == b"PK\x03\x04" and start + entry.compress_size <= self._size:
                try:
                    local = raw.decode("utf-8" if h[3] & 0x800 else "cp437")
                except UnicodeDecodeError:
                    local = None
                if local == entry.orig_filename:
                    return _Member(self._f, self._lock, start, entry)
        return self._zipfile().open(self._zipfile().infolist()[self._entries.index(entry)])  # its error

    def read(self, name: str | Entry) -> bytes:
        with self.open(name) as f:
            data: bytes = f.read()
            return data

    def _zipfile(self) -> Any:
        if self._real is None:
            import zipfile

            self._real = zipfile.ZipFile(self._file if self._own else self._f)
        return self._real

    def close(self) -> None:
        if self._real is not None:
            self._real.close()
        if self._own:
            self._f.close()

    def __enter__(self) -> ZipDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_zip(file: Union[str, "os.PathLike[str]", IO[bytes]]) -> Any:
    """``zipfile.ZipFile(file)``, read without :mod:`zipfile` when the archive is plain (the module's note).

    Args:
        file: a path, or a seekable binary file (left open when the archive is closed).

    Returns:
        A :class:`ZipDir`, or a :class:`zipfile.ZipFile` for any other archive.

    Raises:
        What ``zipfile.ZipFile(file)`` raises.
    """
    own = not hasattr(file, "read")
    f: IO[bytes] = open(file, "rb") if own else file  # type: ignore[arg-type, assignment]
    try:
        entries = _plain_entries(f)
    except BaseException:
        if own:
            f.close()
        raise
    if entries is None:
        if own:
            f.close()
        import zipfile

        return zipfile.ZipFile(file)
    return ZipDir(file, f, entries)


def _plain_entries(f: IO[bytes]) -> list[Entry] | None:
    """The entries of a plain archive (the module's note), or None for :mod:`zipfile` to read."""
    try:
        size = f.seek(0, 2)
        if size < _END.size + _END64_LOCATOR.size + _END64.size:
            return None
        f.seek(size - _END.size - _END64_LOCATOR.size - _END64.size)
        tail = f.read()
    except (OSError, ValueError):
        return None
    if len(tail) != _END.size + _END64_LOCATOR.size + _END64.size:
        return None
    end = _END.unpack(tail[-_END.size :])
    if end[0] != b"PK\x05\x06" or end[7] != 0:  # an archive comment: zipfile searches for the record
        return None
    size_cd, offset_cd, location = end[5], end[6], size - _END.size
    loc = _END64_LOCATOR.unpack(tail[_END64.size : _END64.size + _END64_LOCATOR.size])
    if loc[0] == b"PK\x06\x07":
        rec = _END64.unpack(tail[: _END64.size])
        if loc[1] != 0 or loc[3] > 1 or rec[0] != b"PK\x06\x06":
            return None
        size_cd, offset_cd = rec[8], rec[9]
        location -= _END64.size + _END64_LOCATOR.size
    if location - size_cd - offset_cd != 0 or size_cd > (64 << 20):  # data before the archive; a huge directory
        return None
    try:
        f.seek(offset_cd)
        data = f.read(size_cd)
    except (OSError, ValueError):
        return None
    if len(data) != size_cd:
        return None
    entries: list[Entry] = []
    pos = 0
    while pos < size_cd:
        if pos + _CENTRAL.size > size_cd:
            return None
        c = _CENTRAL.unpack_from(data, pos)
        name_end = pos + _CENTRAL.size + c[12]
        if (
            c[0] != b"PK\x01\x02"
            or c[13]
            or c[14]  # an extra field (ZIP64 sizes...) or a comment
            or name_end > size_cd
            or c[6] != 0  # not stored
            or c[10] != c[11]  # a stored member's two sizes differ
            or c[5] & ~_PLAIN_FLAGS
            or c[3] > _MAX_EXTRACT_VERSION
        ):
            return None
        try:
            name = data[pos + _CENTRAL.size : name_end].decode("utf-8" if c[5] & 0x800 else "cp437")
        except UnicodeDecodeError:
            return None
        if "\x00" in name or (os.sep != "/" and os.sep in name) or (os.altsep and os.altsep in name):
            return None
        entries.append(Entry(name, c))
        pos = name_end
    return entries
