"""Which reader claims a file's bytes, decided as ``torch.load`` decides, in the same order.

``torch.load(path)`` (torch 2.13, ``torch/serialization.py``) dispatches on content:

1. the first four bytes are ``PK\\x03\\x04`` (``_is_zipfile``): torch's zip reader; an archive
   holding ``constants.pkl`` (``_is_torchscript_zip``) goes to ``torch.jit.load`` and is refused
   with ``weights_only=True``;
2. else ``tarfile.open(fileobj=f, mode="r:")`` at offset 0 (``_legacy_load``): if it opens, the
   file is a pre-0.4 tar checkpoint whatever else it holds (any error but ``TarError`` propagates);
3. else the file is unpickled from its first byte (a legacy stream's magic number, or any pickle).

(A path ending in ``.safetensors`` goes to ``safetensors.torch.load_file`` before all of that; by
content, ckptfix takes a file as safetensors only when its header is valid.)  A file that several
readers could claim (a tar archive whose first member's name is a pickle, a pickle with a zip
appended) is read as torch reads it, and :func:`readings` lists every other way it can be read so
that ``scan`` checks each one and reports the worst.
"""

from __future__ import annotations

import io
import re
import struct
from typing import Any

from ckptfix.errors import ResourceLimitError
from ckptfix.files import pins, source

ZIP_MAGIC = b"PK\x03\x04"

#: safetensors' own limit on its JSON header (``MAX_HEADER_SIZE`` in the safetensors crate)
SAFETENSORS_MAX_HEADER = 100_000_000

#: the most one read of tarfile may ask while sniffing (a GNU long-name or PAX record's size)
_TAR_READ_CAP = 16 << 20

#: the first bytes of a pickle: ``PROTO`` 2..5, or an opcode protocols 0 and 1 open with
_PROTO = re.compile(rb"\x80[\x02-\x05]")
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


class _Capped(io.RawIOBase):
    """A read-only view of a file that refuses reads over :data:`_TAR_READ_CAP` (tarfile trusts size fields)."""

    def __init__(self, f: Any) -> None:
        self.f = f

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, off: int, whence: int = 0) -> int:
        return int(self.f.seek(off, whence))

    def tell(self) -> int:
        return int(self.f.tell())

    def read(self, n: int | None = -1) -> bytes:
        if n is None or n < 0 or n > _TAR_READ_CAP:
            raise ResourceLimitError(
                f"a tar header asks to read {n} bytes at once (over {_TAR_READ_CAP >> 20} MiB); "
                "the file is crafted or damaged"
            )
        return bytes(self.f.read(n))

    def readinto(self, b: Any) -> int:
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)


def tar_opens(path: str) -> bool | None:
    """What torch's legacy loader does with ``tarfile.open(fileobj=f, mode="r:")`` at offset 0.

    Args:
        path: a file.

    Returns:
        True: it opens, so ``torch.load`` reads the file as a pre-0.4 tar checkpoint; False: ``TarError``,
        so torch goes on to unpickle it; None: tarfile raises something else, which ``torch.load``
        lets through (the load fails before any pickle is read).

    Raises:
        ResourceLimitError: a tar header whose size field asks for more than 16 MiB in one read.
    """
    with source.open_file(path) as f:
        if _bad_tar_checksum(f.read(512)):  # tarfile's ReadError, known without importing tarfile (start-up)
            return False
        f.seek(0)
        import tarfile

        try:
            with tarfile.open(fileobj=_Capped(f), mode="r:", format=tarfile.PAX_FORMAT):
                return True
        except tarfile.TarError:
            return False
        except ResourceLimitError:
            raise
        except Exception:  # noqa: BLE001 - torch lets any other error through: the load fails
            return None


def zip_where_tar_stopped(path: str) -> bool:
    """Whether ``torch.load(path)`` raises "is a zip archive" after its tar reader fails (nothing unpickled).

    torch's legacy loader tries ``tarfile`` at offset 0; on ``TarError`` it checks for a zip local header
    (``PK\\x03\\x04``) at the offset where tarfile stopped reading (512 after a refused first header), not at
    0, and raises if one is there.  A file whose start is no zip can so be refused by torch as one.

    Args:
        path: a file whose first bytes are not a zip's and that tarfile refuses (:func:`tar_opens` False).

    Returns:
        True where torch raises instead of unpickling.
    """
    with source.open_file(path) as f:
        if _bad_tar_checksum(f.read(512)):
            return f.read(4) == ZIP_MAGIC
        f.seek(0)
        import tarfile

        try:
            with tarfile.open(fileobj=_Capped(f), mode="r:", format=tarfile.PAX_FORMAT):
                return False
        except tarfile.TarError:
            return f.read(4) == ZIP_MAGIC
        except Exception:  # noqa: BLE001 - tarfile raised what torch lets through: tar_opens says None
            return False


def _bad_tar_checksum(block: bytes) -> bool:
    """Whether ``tarfile`` refuses ``block`` (a file's first 512 bytes) as the first header, raising ``ReadError``.

    The checks of ``tarfile.TarInfo.frombuf`` before anything else is read: a short block (empty or
    truncated header), or a checksum field that does not hold the block's checksum (``nti`` of bytes
    148-156 is not octal, or equals neither the unsigned nor the signed sum).  An all-zero block (tarfile
    opens an empty archive) and a base-256 checksum field are left to tarfile itself.
    """
    if len(block) < 512:
        return True
    if block.count(0) == 512 or block[148] in (0o200, 0o377):
        return False
    try:
        field = block[148:156].split(b"\0", 1)[0].decode("ascii")
        chksum = int(field.strip() or "0", 8)
    except ValueError:  # UnicodeDecodeError too
        return True
    rest = block[:148] + block[156:512]
    unsigned = 256 + sum(rest)
    signed = unsigned - 256 * sum(1 for b in rest if b >= 128)
    return chksum not in (unsigned, signed)


def torch_branch(path: str) -> str:
    """The branch ``torch.load(path)`` takes for a file by content: ``zip``, ``tar``, ``tar-error`` or ``pickle``.

    Args:
        path: a file (not named ``*.safetensors``: those torch hands to safetensors by name).

    Returns:
        ``zip`` (``PK\\x03\\x04`` first), ``tar`` (tarfile opens it), ``tar-error`` (tarfile raises an
        error torch does not catch), ``zip-error`` (torch raises "is a zip archive":
        :func:`zip_where_tar_stopped`), else ``pickle``.
    """
    with source.open_file(path) as f:
        if f.read(4) == ZIP_MAGIC:
            return "zip"
    opens = tar_opens(path)
    if opens is False and zip_where_tar_stopped(path):
        return "zip-error"
    return "tar" if opens else "pickle" if opens is False else "tar-error"


def safetensors_header_ok(path: str, max_json: int) -> bool:
    """Whether ``path`` starts with a valid safetensors header: a length within the file and safetensors'
    limit, then a JSON object of that many bytes.

    Args:
        path: a file.
        max_json: the most header bytes parsed; a longer header that opens with ``{`` is taken as
            safetensors without parsing it (its reader then names the limit).

    Returns:
        True for a safetensors header.
    """
    size = source.getsize(path)
    with source.open_file(path) as f:
        head = f.read(9)
        if len(head) < 9 or head[8:9] != b"{":
            return False
        (n,) = struct.unpack("<Q", head[:8])
        if not 2 <= n <= min(size - 8, SAFETENSORS_MAX_HEADER):
            return False
        if n > max_json:
            return True
        f.seek(8)
        raw = f.read(n)
    try:
        import json  # here, not at the top: start-up of inspect/scan

        obj = json.loads(raw)
    except (ValueError, RecursionError):
        return False
    return isinstance(obj, dict)


def starts_like_pickle(path: str, limit: int = 1 << 20) -> bool:
    """Whether the file opens with a pickle ``torch.load`` would unpickle: ``PROTO`` 2..5, or a protocol 0/1
    pickle (no ``PROTO``) that either runs to ``STOP`` or names a global (``GLOBAL``/``INST``) before failing.

    Text that merely starts with an opcode letter (``hello``, ``class Foo:``) is not a pickle: it fails
    before any ``STOP`` and names no importable global.

    Args:
        path: a file.
        limit: how many bytes of the first pickle to read.

    Returns:
        True for a pickle.
    """
    from ckptfix.pickles.opcodes import PickleLimits, scan_globals

    with source.open_file(path) as f:
        # a URL: 64 KiB first; the whole limit only when the first pickle runs past it (the same answer)
        head = f.read(min(limit, 64 << 10) if source.is_url(path) else limit)
        if source.is_url(path) and not _PROTO.match(head) and len(head) < limit and head:
            from ckptfix.pickles.opcodes import PickleLimits, scan_globals

            res = scan_globals(head, limits=PickleLimits.from_env())
            if res.error and "truncated" in res.error:
                f.seek(0)
                head = f.read(limit)
    if _PROTO.match(head):
        return True
    if not head:
        return False
    res = scan_globals(head, limits=PickleLimits.from_env())
    if res.error is None and res.end > 0:
        return True
    return any(_IDENT.fullmatch(m) and _IDENT.fullmatch(n) for m, n in res.pairs)


def zip_appended(path: str) -> bool:
    """Whether :mod:`zipfile` finds an archive with pickles in a file that does not start with one (a zip
    appended to a pickle): ``torch.load`` unpickles the start, other zip readers open the end.

    Args:
        path: a file.

    Returns:
        True when an archive with a ``.pkl`` member is found.
    """
    import zipfile

    try:
        if source.is_url(path):
            with source.open_file(path) as f:
                if not zipfile.is_zipfile(f):
                    return False
                with zipfile.ZipFile(f) as zf:
                    return any(n.endswith(".pkl") for n in zf.namelist())
        if not zipfile.is_zipfile(pins.path_for(path)):
            return False
        with zipfile.ZipFile(pins.path_for(path)) as zf:
            return any(n.endswith(".pkl") for n in zf.namelist())
    except Exception:  # noqa: BLE001 - a damaged archive is no reading
        return False
