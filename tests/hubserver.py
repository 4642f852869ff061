"""A local Hugging Face Hub endpoint for the ``hf://`` tests: just what ``huggingface_hub.HfFileSystem`` calls.

:class:`HubServer` (a :class:`http.server.ThreadingHTTPServer` on ``127.0.0.1`` at a free port) serves model
repositories, each a set of revisions, each revision a local folder (a branch name and its 40-hex commit both
resolve to it).  Point ``HfFileSystem`` at it with ``HF_ENDPOINT=<server.url>`` (or ``endpoint=``).  The
endpoints, as ``huggingface_hub`` 1.x/2.x uses them (``hf_api.py``, ``hf_file_system.py``, ``file_download.py``):

* ``GET /api/models/{ns}/{name}[/revision/{rev}]`` (``repo_info``; without a revision: ``main``):
  ``{"id", "sha", "siblings"}``;
* ``GET /api/models/{ns}/{name}/tree/{rev}[/{path}]?recursive=&expand=`` (``list_repo_tree``): one page,
  ``{"type": "file"|"directory", "path", "size", "oid"}`` entries (no ``xetHash``: plain HTTP downloads);
* ``POST /api/models/{ns}/{name}/paths-info/{rev}`` (``get_paths_info``), form ``paths=...&paths=...``;
* ``GET|HEAD /{ns}/{name}/resolve/{rev}/{path}``: the file, one ``bytes=a-b`` range (206 + ``Content-Range``),
  ``ETag`` (the blob's id), ``X-Repo-Commit``, ``Accept-Ranges``.

A repository in :attr:`HubServer.private` is answered 401 ``RepoNotFound`` (as the Hub answers a request without
a token), one in :attr:`HubServer.gated` has its files answered 401 ``GatedRepo``.
With :attr:`HubServer.lfs_from` set, files of that size or more are LFS files as on the Hub: ``resolve`` answers
302 to a signed ``/cdn/{commit}/{path}?sig=N`` URL with ``X-Linked-Size``/``X-Linked-Etag``; :meth:`HubServer.expire`
makes the URLs handed out so far answer 403, as an expired presigned URL does.
With :attr:`HubServer.hostile` set, ranged GETs of files are answered by that function (a lying or sick server).
Anything else (``huggingface_hub`` also asks for ``/api/agent-harnesses`` once per process) is a 404.
Errors carry the Hub's ``X-Error-Code`` (``RepoNotFound``, ``RevisionNotFound``, ``EntryNotFound``), which
``huggingface_hub`` maps to its typed errors.  Every request is logged with the body bytes sent
(:attr:`HubServer.log`) so tests count requests and bytes instead of timing anything.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.server
import json
import os
import re
import threading
import urllib.parse
from dataclasses import dataclass
from typing import Any, Iterator

_RANGE = re.compile(r"bytes=(\d+)-(\d*)$")
_API = re.compile(r"^/api/models/([^/]+/[^/]+)(?:/(revision|tree|paths-info)/([^/]+)(?:/(.*))?)?$")
_RESOLVE = re.compile(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")
_CDN = re.compile(r"^/cdn/([0-9a-f]{40})/(.+)$")


@dataclass
class Hit:
    method: str
    path: str
    range: str | None
    status: int
    sent: int = 0


def _blob_id(path: str) -> str:
    """The git blob id of a file (what the Hub reports as ``oid`` for a non-LFS file)."""
    h = hashlib.sha1()
    h.update(b"blob %d\0" % os.path.getsize(path))
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class Handler(http.server.BaseHTTPRequestHandler):
    server: HubServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:
        pass

    def _record(self, method: str, status: int) -> Hit:
        hit = Hit(method, self.path, self.headers.get("Range"), status)
        with self.server.lock:
            self.server.log.append(hit)
        return hit

    def _error(self, method: str, code: int, error_code: str | None = None) -> None:
        # recorded before the answer: a client that gives up on this answer may count the requests at once
        self._record(method, code)
        body = json.dumps({"error": error_code or f"HTTP {code}"}).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        if error_code:
            self.send_header("X-Error-Code", error_code)
        self.end_headers()
        if method != "HEAD":
            self.wfile.write(body)

    def _json(self, method: str, doc: Any) -> None:
        body = json.dumps(doc).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        hit = self._record(method, 200)
        with self.server.lock:
            hit.sent += len(body)

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_HEAD(self) -> None:
        self._dispatch("HEAD")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def _dispatch(self, method: str) -> None:
        parsed = urllib.parse.urlsplit(self.path)
        path = urllib.parse.unquote(parsed.path)
        query = urllib.parse.parse_qs(parsed.query)
        form: dict[str, list[str]] = {}
        if method == "POST":
            n = int(self.headers.get("Content-Length") or 0)
            form = urllib.parse.parse_qs(self.rfile.read(n).decode())
        with self.server.lock:
            fault = self.server.faults.pop(0) if self.server.faults else None
        if fault is not None:
            return self._error(method, fault)
        m = _API.match(path)
        if m is not None:
            repo, kind, rev, rest = m.groups()
            kind, rev = kind or "revision", rev or "main"  # GET /api/models/{repo}: its default branch
            root, sha = self._revision(method, repo, rev)
            if root is None:
                return None
            if kind == "revision" and method == "GET":
                files = self.server.files(root)
                return self._json(method, {"id": repo, "sha": sha, "siblings": [{"rfilename": f} for f in files]})
            if kind == "tree" and method == "GET":
                return self._tree(method, root, rest or "", query.get("recursive", ["False"])[0].lower() == "true")
            if kind == "paths-info" and method == "POST":
                out = [e for p in form.get("paths", []) if (e := self.server.entry(root, p.strip("/"))) is not None]
                return self._json(method, out)
            return self._error(method, 405)
        m = _RESOLVE.match(path)
        if m is not None and method in ("GET", "HEAD"):
            repo, rev, rel = m.groups()
            if repo in self.server.gated:  # listed, but its files need the conditions accepted (and a token)
                return self._error(method, 401, "GatedRepo")
            root, sha = self._revision(method, repo, rev)
            if root is None:
                return None
            if self.server.is_lfs(os.path.join(root, rel)):
                return self._redirect(method, root, sha or "", rel)
            return self._file(method, root, sha or "", rel)
        m = _CDN.match(path)
        if m is not None and method in ("GET", "HEAD"):
            sha, rel = m.groups()
            root = next((r for revs in self.server.repos.values() for r, c in revs.values() if c == sha), None)
            if root is None or query.get("sig", [""])[0] != str(self.server.signature):
                return self._error(method, 403)  # as S3 answers an expired presigned URL
            return self._file(method, root, sha, rel)
        return self._error(method, 404, "RepoNotFound")

    def _revision(self, method: str, repo: str, rev: str) -> tuple[str | None, str | None]:
        revs = self.server.repos.get(repo)
        if repo in self.server.private:  # as the Hub answers a request without a token: 401, "not found"
            self._error(method, 401, "RepoNotFound")
            return None, None
        if revs is None:
            self._error(method, 404, "RepoNotFound")
            return None, None
        for name, (root, sha) in revs.items():
            if rev in (name, sha):
                return root, sha
        self._error(method, 404, "RevisionNotFound")
        return None, None

    def _tree(self, method: str, root: str, rel: str, recursive: bool) -> None:
        top = os.path.join(root, rel) if rel else root
        if not os.path.isdir(top):
            return self._error(method, 404, "EntryNotFound")
        out = []
        for dirpath, dirnames, filenames in os.walk(top):
            dirnames.sort()
            for name in sorted(dirnames) + sorted(filenames):
                e = self.server.entry(root, os.path.relpath(os.path.join(dirpath, name), root).replace(os.sep, "/"))
                if e is not None:
                    out.append(e)
            if not recursive:
                break
        return self._json(method, out)

    def _redirect(self, method: str, root: str, sha: str, rel: str) -> None:
        """An LFS file, as the Hub answers it: 302 to a signed CDN URL, its size and hash in ``X-Linked-*``."""
        fpath = os.path.join(root, rel)
        if not os.path.isfile(fpath):
            return self._error(method, 404, "EntryNotFound")
        oid = self.server.blob_id(fpath)
        self.send_response(302)
        self.send_header(
            "Location", f"{self.server.url}/cdn/{sha}/{urllib.parse.quote(rel)}?sig={self.server.signature}"
        )
        self.send_header("X-Linked-Size", str(os.path.getsize(fpath)))
        self.send_header("X-Linked-Etag", f'"{oid}"')
        self.send_header("ETag", f'"{oid}"')
        self.send_header("X-Repo-Commit", sha)
        self.send_header("Content-Length", "0")
        self.end_headers()
        self._record(method, 302)

    def _file(self, method: str, root: str, sha: str, rel: str) -> None:
        fpath = os.path.join(root, rel)
        if not os.path.isfile(fpath):
            return self._error(method, 404, "EntryNotFound")
        size = os.path.getsize(fpath)
        etag = f'"{self.server.blob_id(fpath)}"'
        rng = self.headers.get("Range")
        hostile = self.server.hostile
        if hostile is not None and rng and method == "GET":  # a sick or lying server answers the range itself
            m = _RANGE.match(rng.strip())
            if m:
                self._record(method, 206)
                try:
                    hostile(self, int(m.group(1)), int(m.group(2)) + 1 if m.group(2) else size, size)
                except (BrokenPipeError, ConnectionResetError):
                    pass
                return None
        start, end, status = 0, size, 200
        if rng:
            m = _RANGE.match(rng.strip())
            if not m:
                return self._error(method, 416)
            start = int(m.group(1))
            end = min(size, int(m.group(2)) + 1) if m.group(2) else size
            if start >= size or start >= end:
                return self._error(method, 416)
            status = 206
        self.send_response(status)
        self.send_header("Content-Length", str(end - start))
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("ETag", etag)
        self.send_header("X-Repo-Commit", sha)
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
        self.end_headers()
        hit = self._record(method, status)
        if method == "HEAD":
            return
        with open(fpath, "rb") as f:
            f.seek(start)
            left = end - start
            while left > 0:
                chunk = f.read(min(1 << 20, left))
                if not chunk:
                    break
                with self.server.lock:
                    hit.sent += len(chunk)
                try:
                    self.wfile.write(chunk)
                except (BrokenPipeError, ConnectionResetError):
                    break
                left -= len(chunk)


class HubServer(http.server.ThreadingHTTPServer):
    """Serve model repositories (``{"user/repo": {"main": folder, "v1": other_folder}}``) as the Hub does.

    Each revision gets a fixed fake commit id (40 hex digits, :meth:`commit`) that resolves like its name.
    """

    daemon_threads = True

    def __init__(self, repos: dict[str, dict[str, str]]) -> None:
        self.lock = threading.Lock()
        self.log: list[Hit] = []
        self.faults: list[int] = []  # statuses answered to the next requests, whatever they are
        self.private: set[str] = set()  # repositories answered 401 RepoNotFound (no token)
        self.gated: set[str] = set()  # repositories whose files are answered 401 GatedRepo
        self.lfs_from: int | None = None  # files of at least this size are LFS: redirected to a signed /cdn/ URL
        #: answers ranged GETs of files itself when set: ``(handler, start, end, size) -> None`` writes the whole reply
        self.hostile: Any = None
        self.signature = 0  # the /cdn/ URLs' signature: :meth:`expire` makes the ones handed out so far 403
        self._blobs: dict[tuple[str, int, int], str] = {}
        self.repos: dict[str, dict[str, tuple[str, str]]] = {}
        for repo, revs in repos.items():
            self.repos[repo] = {
                name: (root, hashlib.sha1(f"{repo}@{name}".encode()).hexdigest()) for name, root in revs.items()
            }
        super().__init__(("127.0.0.1", 0), Handler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def commit(self, repo: str, rev: str = "main") -> str:
        """The fake commit id a revision of ``repo`` resolves to."""
        return self.repos[repo][rev][1]

    def move(self, repo: str, rev: str, root: str) -> str:
        """Point branch ``rev`` of ``repo`` at another folder (a new commit, as a push does); the old commit still
        resolves by its id.  Returns the new commit id."""
        with self.lock:
            revs = self.repos[repo]
            old_root, old_sha = revs[rev]
            revs[old_sha] = (old_root, old_sha)
            sha = hashlib.sha1(f"{repo}@{rev}@{len(revs)}".encode()).hexdigest()
            revs[rev] = (root, sha)
        return sha

    def is_lfs(self, fpath: str) -> bool:
        return self.lfs_from is not None and os.path.isfile(fpath) and os.path.getsize(fpath) >= self.lfs_from

    def expire(self) -> None:
        """The signed CDN URLs handed out so far expire (403 from now on)."""
        with self.lock:
            self.signature += 1

    def blob_id(self, fpath: str) -> str:
        st = os.stat(fpath)
        key = (fpath, st.st_size, st.st_mtime_ns)
        with self.lock:
            got = self._blobs.get(key)
        if got is None:
            got = _blob_id(fpath)
            with self.lock:
                self._blobs[key] = got
        return got

    def files(self, root: str) -> list[str]:
        out = []
        for dirpath, _dirs, names in os.walk(root):
            out += [os.path.relpath(os.path.join(dirpath, n), root).replace(os.sep, "/") for n in names]
        return sorted(out)

    def entry(self, root: str, rel: str) -> dict[str, Any] | None:
        """A tree / paths-info entry for ``rel`` in ``root``, or None when there is nothing there."""
        full = os.path.join(root, rel)
        if os.path.isdir(full):
            return {"type": "directory", "path": rel, "oid": hashlib.sha1(rel.encode()).hexdigest()}
        if os.path.isfile(full):
            size = os.path.getsize(full)
            out: dict[str, Any] = {"type": "file", "path": rel, "size": size, "oid": self.blob_id(full)}
            if self.is_lfs(full):
                out["lfs"] = {"oid": self.blob_id(full), "size": size, "pointerSize": 134}
            return out
        return None

    def fault(self, status: int, count: int = 1) -> None:
        """Answer the next ``count`` requests (any endpoint) with ``status``."""
        with self.lock:
            self.faults.extend([status] * count)

    def reset(self) -> None:
        with self.lock:
            self.log.clear()
            self.faults.clear()
            self.private.clear()
            self.gated.clear()
            self.lfs_from = None
            self.hostile = None

    def sent(self) -> int:
        """Body bytes of file content and JSON sent so far."""
        with self.lock:
            return sum(h.sent for h in self.log)

    def file_bytes(self) -> int:
        """Body bytes of file content (``resolve``) sent so far."""
        with self.lock:
            return sum(h.sent for h in self.log if "/resolve/" in h.path)

    def requests(self) -> list[Hit]:
        with self.lock:
            return list(self.log)


@contextlib.contextmanager
def serving(repos: dict[str, dict[str, str]]) -> Iterator[HubServer]:
    """A :class:`HubServer` in a thread, shut down after the block."""
    srv = HubServer(repos)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield srv
    finally:
        srv.shutdown()
        srv.server_close()
        t.join(5)


__all__ = ["HubServer", "Hit", "serving"]
