"""How paths are shown to the user: as they typed them, relative to the current directory when under it.

The library works with absolute paths (so a ``chdir`` cannot change what a name means); everything a
user reads -- default output names, "already exists", the notes of sharded rewrites, the trainer's
manifest -- goes through :func:`shown_path`, so ``ckptfix convert model.pt`` says ``model.safetensors``,
not ``/home/me/project/model.safetensors``.
"""

from __future__ import annotations

import os


def shown_path(path: str, *, cwd: str | None = None) -> str:
    """``path`` as a user would write it: relative to ``cwd`` when it lies under it, else unchanged.

    A relative ``path`` is kept as it is; an absolute one under the current directory becomes
    relative (``/home/me/p/out/x.pt`` -> ``out/x.pt``); one outside it (``/tmp/x.pt``, ``../x.pt``
    resolved) stays absolute, since ``../../`` chains are harder to read than the full path.

    Args:
        path: A path.
        cwd: The directory to be relative to (default: the current directory).
    """
    if not path or not os.path.isabs(path):
        return path
    try:
        base = os.path.abspath(cwd) if cwd is not None else os.getcwd()
    except OSError:  # the current directory was removed
        return path
    norm = os.path.normpath(path)
    if norm == base:
        return "."
    prefix = base.rstrip(os.sep) + os.sep
    if norm.startswith(prefix):
        return norm[len(prefix) :]
    return path


# One wording for one mistake, whichever command meets it (each returns the message of an OutputError).


def already_exists(path: str, *, directory: bool = False) -> str:
    """``PATH already exists; pass --force to overwrite it, or -o to choose another path``."""
    other = "another directory" if directory else "another path"
    return f"{shown_path(path)} already exists; pass --force to overwrite it, or -o to choose {other}"


def missing_directory(directory: str) -> str:
    """``DIR: the output directory does not exist; create it, or -o to choose another path``."""
    return f"{shown_path(directory)}: the output directory does not exist; create it, or -o to choose another path"


def permission_denied(path: str) -> str:
    """``PATH: permission denied; -o to choose a writable location``."""
    return f"{shown_path(path)}: permission denied; -o to choose a writable location"


def read_only(path: str) -> str:
    """``PATH: read-only file system; -o to choose a writable location`` (EROFS: a read-only mount).

    Args:
        path: The output (or its directory) on the read-only file system.
    """
    return f"{shown_path(path)}: read-only file system; -o to choose a writable location"


def not_writable(directory: str) -> str:
    """Why ``os.access(directory, W_OK)`` said no, in the words a failed write says it (:func:`read_only` on a
    read-only mount, where access(2) fails EROFS, else :func:`permission_denied`).
    """
    try:
        if os.statvfs(directory).f_flag & os.ST_RDONLY:
            return read_only(directory)
    except (OSError, AttributeError):  # (no statvfs on Windows)
        pass
    return permission_denied(directory)


def cannot_create(path: str) -> str:
    """``PATH: cannot create a file there (DIR exists but accepts no new files); -o to choose another path``.

    For a directory that exists but refuses new files (``/proc``, a FUSE mount...), where
    "does not exist" would be wrong.
    """
    parent = shown_path(os.path.dirname(os.path.abspath(path))) or "."
    return (
        f"{shown_path(path)}: cannot create a file there ({parent} exists but accepts no new files); "
        "-o to choose another path"
    )


def output_is_input(path: str, *, in_place: str | None = None) -> str:
    """``PATH: the output is the input; -o to choose another path`` (plus how to rewrite in place, if offered).

    Args:
        path: The output, which names the input.
        in_place: What ``--in-place`` does for this command (e.g. "replace it"), or None when it has none.
    """
    tail = f", or --in-place to {in_place}" if in_place else ""
    return f"{shown_path(path)}: the output is the input; -o to choose another path{tail}"


# --------------------------------------------------------------------------- secrets in URLs

#: query parameters that carry a secret: presigned URLs' signatures and credentials (S3 v2/v4, GCS, Azure SAS
#: ``sig``), tokens, keys, passwords, authorization, OAuth codes, sessions and assertions; matched by name,
#: case-insensitively, anywhere in the name
#: and percent-encoded too (``X%2DAmz%2DSignature``): masking a harmless parameter costs nothing
_SECRET_PARAM = (
    r"(?:[\w.%-]*?(?:signature|credential|token|secret|password|passwd|pwd|authorization|auth|api[_-]?key|key|sig"
    r"|awsaccesskeyid|googleaccessid|code|session|jwt|assertion)[\w.%-]*)"
)
_PATTERNS: list = []


def _patterns() -> list:
    if not _PATTERNS:
        import re  # compiled where used: display is on every command's start-up path

        _PATTERNS.extend(
            [
                # scheme://user:password@host (a raw '@' in the password too: up to the last '@' before the path;
                # spaces too, as a quoted URL may hold them: "s3://user:pa ss@bucket")
                (re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/\s?#]*(?:[ \t]+[^/\s?#]*)*@"), r"\1***@"),
                # user:password@bucket quoted back by a driver's message, without its scheme
                (re.compile(r"(?<![\w/:.@*-])[\w.~%+-]+:[^\s/@\"'<>]+@(?=[\w.-])"), "***@"),
                # ?X-Amz-Signature=... / &sig=... / ;token=... / #token=...: the value shown as ***
                (re.compile(rf"(?i)([?&;#]{_SECRET_PARAM}=)[^&;#\s\"'<>]*"), r"\1***"),
            ]
        )
    return _PATTERNS


def mask_secrets(text: str) -> str:
    """``text`` with the secrets of the URLs in it masked: ``user:password@`` and signature/credential/token
    query parameters (a presigned URL's ``X-Amz-Signature``, ``X-Amz-Credential``, ``Signature``, ``sig``,
    ``token`` ...) shown as ``***``.  Every display of a path or URL (text, ``--json``, errors) goes through it.

    Returns:
        The text with the secrets masked (unchanged when it holds no ``://``, ``?`` or ``@``).
    """
    if "@" not in text and "?" not in text and "&" not in text and ";" not in text and "#" not in text:
        return text
    for rx, repl in _patterns():
        text = rx.sub(repl, text)
    return text


def url_userinfo(url: str) -> str | None:
    """The ``user:password`` part of a URL (up to the last ``@`` before its path), or None when it has none.

    Args:
        url: a URL as given.

    Returns:
        The userinfo, for masking where a driver quotes it back without its ``@`` (``got 'user:password'``).
    """
    _, sep, rest = url.partition("://")
    head = rest.split("/", 1)[0]
    if not sep or "@" not in head:
        return None
    return head.rsplit("@", 1)[0] or None


def mask_userinfo(text: str, url: str) -> str:
    """``text`` with ``url``'s userinfo, and its password alone, replaced by ``***`` wherever it appears.

    Args:
        text: a message that may quote the URL's parts back (a driver's error).
        url: the URL.

    Returns:
        The text, masked.
    """
    info = url_userinfo(url)
    if info:
        text = text.replace(info, "***")
        password = info.partition(":")[2]
        if password:
            text = text.replace(password, "***")
    return text


def mask_doc(obj: object) -> object:
    """:func:`mask_secrets` of every string (keys too) of a JSON document."""
    if isinstance(obj, str):
        return mask_secrets(obj)
    if isinstance(obj, dict):
        return {mask_secrets(k) if isinstance(k, str) else k: mask_doc(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [mask_doc(v) for v in obj]
    return obj
