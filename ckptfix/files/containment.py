"""One rule for every multi-file container: its member files stay inside its directory.

A sharded index's shards and a DCP directory's ``.metadata`` and data files are opened by name
relative to the container's directory.  A member that is a symlink resolving elsewhere would let a
downloaded checkpoint read (and a rename copy into its output) any file the user can read, so it is
refused (:class:`~ckptfix.errors.UnsupportedError`, exit 8) by every command, before anything is
read.  The one exception is the Hugging Face hub cache, whose ``snapshots/<rev>/`` files are links
into ``../../blobs/``.
"""

from __future__ import annotations

import os

from ckptfix.errors import UnsupportedError


def allowed_roots(base: str) -> list[str]:
    """The real directories the members of a container in ``base`` may resolve into.

    Returns:
        ``base`` resolved, plus the hub cache's ``blobs`` directory when ``base`` is a snapshot.
    """
    roots = [os.path.realpath(base)]
    parent = os.path.dirname(os.path.abspath(base))
    if os.path.basename(parent) == "snapshots":  # Hugging Face hub cache: files link to ../../blobs/<hash>
        roots.append(os.path.realpath(os.path.join(os.path.dirname(parent), "blobs")))
    return roots


def inside(path: str, roots: list[str]) -> bool:
    """True when the resolved ``path`` is one of ``roots`` or below one."""
    return any(path == r or path.startswith(r.rstrip(os.sep) + os.sep) for r in roots)


def check_member(base: str, name: str, what: str) -> None:
    """Refuse the member ``name`` of the container directory ``base`` when it resolves outside it.

    A member that does not exist passes (the caller reports it missing in its own words).

    Raises:
        UnsupportedError: ``name`` is a link resolving outside ``base``.
    """
    p = os.path.join(base, name)
    if not os.path.lexists(p):
        return
    real = os.path.realpath(p)
    if not inside(real, allowed_roots(base)):
        raise UnsupportedError(
            f"{what}: {name} is a link to {real}, outside the checkpoint directory; refused "
            "(copy the file into the directory)"
        )


def remote_name_escapes(name: str) -> bool:
    """Whether a member name read from a remote container (a sharded index's shard, a DCP data file) could name
    something other than a file below the container's URL once joined to it.

    A URL decodes ``%2e%2e`` to ``..`` (the client normalises it away before the request: ``dir/%2e%2e/x`` is
    ``/x``), ``?`` and ``#`` start a query (another S3 version, another object) or a fragment, and ``://`` a whole
    URL; none of these is a file name a writer of checkpoints produces.

    Returns:
        True when the name must be refused.
    """
    from urllib.parse import unquote

    if any(c in name for c in "?#\\\x00") or "://" in name or any(ord(c) < 32 or ord(c) == 127 for c in name):
        return True
    decoded = name
    for _ in range(3):  # decoded until stable (a server may decode twice)
        decoded, prev = unquote(decoded), decoded
        if decoded == prev:
            break
    if decoded.count("/") != name.count("/") or "\\" in decoded:
        return True  # an encoded separator: the server may split on it, the checks above did not
    parts = decoded.split("/")
    return decoded.startswith("/") or ".." in parts or any(c in decoded for c in "?#\x00")
