#!/usr/bin/env python3
"""Regenerate every console block in README.md and docs/ from real runs.

A block is regenerated when the line before its opening fence is a marker::

    <!-- run: setup=runs mask="python: .*" -->
    ```console
    $ ckptfix inspect runs/dp_epoch1.pt
    (output, rewritten by this script)
    ```

The ``$ `` lines of a block are run in order in one ``bash`` (so ``eval``, ``export`` and
``echo $?`` behave as in a terminal) in a scratch directory: each page starts in its own new,
empty directory (the same one for all blocks of the page, so a block can use files an earlier
one made, and pages never see each other's files), with ``ckptfix`` on PATH and an empty lease
directory (``pick-gpu`` leases never leak from one block into the next), both kept outside
the working directory; what each line prints (stdout and stderr interleaved, as a terminal
shows them) replaces the lines up to the next ``$ ``, as printed: paths are not rewritten,
so a page shows the paths a user sees (ckptfix prints them relative to the current directory).
A block after ``<!-- file: NAME -->`` is not run: its text is written to ``NAME`` in the
scratch directory, for the blocks below it.  Marker fields:

- ``setup=runs``: the scratch directory holds ``runs/`` from
  ``ckptfix train --mode dp --out runs --epochs 1`` (trained once per run of this script);
- ``setup=s3``: a local S3 server (moto, ``tests/s3server.py``) runs for the page, the shell has its
  endpoint and dummy credentials in ``AWS_*``, and bucket ``ckptfix-docs`` holds ``tests/fixtures/ckpt``
  (``s3://ckptfix-docs/ddp.pth`` ...) (docs/remote.md);
- ``setup=hub``: a local Hugging Face Hub endpoint (``tests/hubserver.py``) runs for the page, ``HF_ENDPOINT``
  points at it, and repository ``ckptfix-docs/fixtures`` holds ``tests/fixtures/ckpt``,
  ``ckptfix-docs/sharded`` its ``sharded/`` folder (``hf://ckptfix-docs/fixtures/ddp.pth`` ...) (docs/remote.md);
- ``gpu=SCENARIO``: a recorded nvidia-smi (``tests/fixtures/nvidia-smi/scenarios/SCENARIO``)
  is first on PATH; without it no nvidia-smi is;
- ``mask=REGEX`` (repeatable): text that differs from machine to machine or run to run
  (timings, the Python build); ``--check`` compares with every match replaced by ``…``.

``python docs/gen_docs.py`` rewrites the files; ``--check`` rewrites nothing and exits 1
with a diff when a block no longer matches what the commands print (tests/test_docs.py).

Only pages whose inputs changed are run again.  Each run of a page records in
``docs/gen_docs.stamps.json`` a hash of its inputs -- its blocks' commands, markers and
``file:`` blocks, every ckptfix source file any process of the run imported (logged by an
import hook, so ``exec`` and killed processes count too), this script, the fake nvidia-smi
and the scenarios its ``gpu=`` blocks replay, and the Python, torch, click, safetensors and
numpy versions -- and a hash
of its blocks as shown.  ``--check`` skips a page whose stamp matches both: the blocks were
produced by real runs of the same commands on the same code.  Change any input (a module the
page's commands import, a command line, a dependency's version) and the page runs again;
``--full`` runs every page regardless.  The regeneration (no ``--check``) writes the stamps;
``--check --stamp`` records the pages that match without rewriting a block.
"""

from __future__ import annotations

import argparse
import difflib
import hashlib
import importlib.metadata
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMI = ROOT / "tests" / "fixtures" / "nvidia-smi"
MARKER = re.compile(r"^<!-- run:(?P<fields>.*?)-->\s*$")
FILE = re.compile(r"^<!-- file: (?P<name>[\w.-]+) -->\s*$")
#: always masked: wall-clock figures
_TRAINED: dict[str, Path | None] = {}
STEP = "::gen-docs-step::"
#: what one block may take before it is reported as hung (generous: a loaded machine is slow, not hung)
BLOCK_TIMEOUT = float(os.environ.get("GEN_DOCS_BLOCK_TIMEOUT", "3600"))
STAMPS_NAME = "gen_docs.stamps.json"
#: logs the file of every ckptfix module a process imports (at import: exec and kill lose nothing), and
#: runs each from its source: a ``__pycache__`` file is trusted by the source's size and mtime in whole seconds,
#: so an edit of the same size within the second (a test, a quick fix) would run the old bytecode while the stamp
#: hashes the new source (issue 36); compiling ckptfix's own modules costs a few ms
IMPORT_HOOK = """\
import os, sys
from importlib.machinery import PathFinder, SourceFileLoader


class _FromSource(SourceFileLoader):
    def get_code(self, fullname):
        return self.source_to_code(self.get_data(self.path), self.path)


class _LogCkptfixImports:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name == "ckptfix" or name.startswith("ckptfix."):
            spec = PathFinder.find_spec(name, path)
            if spec is not None and spec.origin:
                with open(os.environ["GEN_DOCS_IMPORT_LOG"], "a") as f:
                    f.write(spec.origin + "\\n")
                if type(spec.loader) is SourceFileLoader:
                    spec.loader = _FromSource(spec.loader.name, spec.loader.path)
                return spec
        return None


if os.environ.get("GEN_DOCS_IMPORT_LOG"):
    sys.meta_path.insert(0, _LogCkptfixImports)


# gpu= blocks replay a recorded machine: doctor reports torch as the CPU-only build the pages were recorded
# with, whichever build this venv holds (PyPI's default is a CUDA one)
class _CpuTorch:

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(_CpuTorch)
        spec = PathFinder.find_spec(name, path)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            module.version.cuda = module.version.hip = None
            module.__version__ = module.version.__version__ = module.__version__.split("+")[0] + "+cpu"

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("GEN_DOCS_CPU_TORCH"):
    sys.meta_path.insert(0, _CpuTorch)
"""
FIXTURES = ROOT / "tests" / "fixtures" / "frameworks"
#: ``setup=frameworks``: fixture -> the name it has in the page's directory
FRAMEWORK_FOLDERS = {
    "trainer/checkpoint-2": "checkpoint-2",
    "accelerate": "accelerate_state",
    "deepspeed/zero3_fp32": "ds_ckpt",
    "hfstorage/run": "hf_writer.dcp",
    "lightning_dcp": "lightning_fsdp",
    "lightning.ckpt": "lightning.ckpt",
    "hf_llama_bin": "llama",
    "peft_lora_bin": "lora_adapter",
    "diffusers_bin": "sd_pipeline",
    "st_bin": "st_model",
    "torchao/int8dq.pt": "int8dq.pt",
    "fsdp_ranks": "fsdp_ranks",
    "accelerate_fsdp_full": "accelerate_fsdp_full",
    "dcp_unflattened": "dcp_unflattened",
    "torchtune_out": "torchtune_out",
    "pickled/legacy_module.pt": "legacy_model.pt",
    "pickled/agent.pt": "agent.pt",
    "pickled/ts_enum.pt": "resize_scripted.pt",
    "pickled/data.pt": "data.pt",
    "ultralytics/last.pt": "yolo_last.pt",
    "timm/last.pth.tar": "last.pth.tar",
    "timm/ref_dp.safetensors": "ref_dp.safetensors",
}
_SETUP_SOURCES: set[str] = set()  # sources the shared ``setup=runs`` training imported
TIMINGS = [r"\d+(\.\d+)? s/epoch", r"\d[\d,]* samples/s", r"\b\d+\.\d\d ?s\b"]


@dataclass
class Block:
    start: int  # index of the opening fence
    end: int  # index of the closing fence
    setup: str = ""
    gpu: str = ""
    masks: list[str] = field(default_factory=list)
    file: str = ""  # a ``<!-- file: NAME -->`` block: its text is written to NAME, nothing is run


def parse_marker(text: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for item in shlex.split(text):
        k, _, v = item.partition("=")
        out.setdefault(k, []).append(v)
    return out


def find_blocks(lines: list[str]) -> list[Block]:
    blocks = []
    for i, line in enumerate(lines):
        m = MARKER.match(line)
        fm = FILE.match(line)
        if not (m or fm) or i + 1 >= len(lines) or not lines[i + 1].startswith("```"):
            continue
        end = next(j for j in range(i + 2, len(lines)) if lines[j].startswith("```"))
        if fm:
            blocks.append(Block(i + 1, end, file=fm["name"]))
            continue
        f = parse_marker(m["fields"])
        blocks.append(Block(i + 1, end, (f.get("setup") or [""])[0], (f.get("gpu") or [""])[0], f.get("mask", [])))
    return blocks


class Sandbox:
    """A scratch directory with ``ckptfix`` (this checkout) on PATH."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="ckptfix-docs-"))
        self.dir = self.root / "work"  # the page's working directory: empty at the start
        self.dir.mkdir()
        self.bin = self.root / "bin"
        self.bin.mkdir()
        exe = self.bin / "ckptfix"
        exe.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m ckptfix "$@"\n')
        exe.chmod(0o755)
        self.site = self.root / "site"
        self.site.mkdir()
        (self.site / "sitecustomize.py").write_text(IMPORT_HOOK)
        self.import_log = self.root / "imports.log"
        self.extra_env: dict[str, str] = {}

    def env(self, gpu: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("CUDA_", "CKPTFIX_", "FAKE_SMI"))}
        path = [str(self.bin), str(Path(sys.executable).parent), "/usr/bin", "/bin"]
        if gpu:
            smi = self.bin / "smi"
            smi.mkdir(exist_ok=True)
            link = smi / "nvidia-smi"
            if not link.exists():
                shutil.copy(SMI / "fake-nvidia-smi.sh", link)
                link.chmod(0o755)
            path.insert(0, str(smi))
            env.update(FAKE_SMI_DIR=str(SMI / "scenarios"), FAKE_SMI_SCENARIO=gpu, GEN_DOCS_CPU_TORCH="1")
        env.update(
            PATH=os.pathsep.join(path),
            PYTHONPATH=os.pathsep.join([str(self.site), str(ROOT)]),
            GEN_DOCS_IMPORT_LOG=str(self.import_log),
            COLUMNS="100",
            NO_COLOR="1",
            CKPTFIX_LEASE_DIR=str(self.root / "leases"),
            PYTHONHASHSEED="0",
        )
        env.update(self.extra_env)
        return env

    def sources(self) -> set[str]:
        """The ckptfix source files (relative to the repository) the processes run so far imported."""
        if not self.import_log.exists():
            return set()
        out = set()
        for line in self.import_log.read_text().splitlines():
            path = Path(line).resolve()
            if path.is_relative_to(ROOT) and path.is_file():
                out.add(path.relative_to(ROOT).as_posix())
        return out

    def run(self, cmd: str, gpu: str = "", where: str = "") -> str:
        return self.run_lines([cmd], gpu, where)[0]

    def run_lines(self, cmds: list[str], gpu: str = "", where: str = "") -> list[str]:
        """Run ``cmds`` in order in one bash, with no lease taken yet; return what each printed.

        A block still running after ``BLOCK_TIMEOUT`` seconds is hung: the error names it (``where``: the
        page and line), its commands, and what it had printed.
        """
        shutil.rmtree(self.root / "leases", ignore_errors=True)
        script = []
        for i, cmd in enumerate(cmds):  # the step marker keeps $? of the command for the next line
            script += [cmd, f"__rc=$?; printf '\\n{STEP}{i}\\n'; (exit $__rc)"]
        try:
            p = subprocess.run(
                ["bash", "-c", "exec 2>&1\n" + "\n".join(script)],
                cwd=self.dir,
                env=self.env(gpu),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                timeout=BLOCK_TIMEOUT,
            )
        except subprocess.TimeoutExpired as e:
            said = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
            step = said.count(STEP)
            raise RuntimeError(
                f"{where or 'a block'}: still running after {BLOCK_TIMEOUT:g} s (hung?) at command {step + 1} of "
                f"{len(cmds)}: {cmds[min(step, len(cmds) - 1)]!r}\nit printed:\n{said[-4000:]}"
            ) from None
        out = p.stdout.replace(sys.executable, "python3")  # paths are shown as users see them: no rewriting,
        # except the private lease directory, shown as the default one (/tmp/ckptfix-leases-<uid>)
        out = out.replace(str(self.root / "leases"), f"/tmp/ckptfix-leases-{os.getuid()}")
        out = re.sub(rf"\bon {re.escape(os.uname().nodename)}\b", "on HOST", out)  # lease holders: no machine name
        parts = re.split(rf"\n{STEP}\d+\n", out)
        if len(parts) != len(cmds) + 1:
            raise RuntimeError(f"a command ended the shell early: {cmds!r}\n{out}")
        return [part.removesuffix("\n") for part in parts[:-1]]

    def setup(self, name: str) -> None:
        if name == "frameworks":
            self.frameworks()
            return
        if name == "s3":
            self.extra_env = s3_server().env()
            return
        if name == "hub":
            self.extra_env = {
                "HF_ENDPOINT": hub_server().url,
                "HF_HUB_OFFLINE": "0",
                "HF_HUB_DISABLE_IMPLICIT_TOKEN": "1",
            }
            return
        if name != "runs" or (self.dir / "runs").exists():
            return
        if _TRAINED.get("runs") is None:  # trained once per run of this script, copied into each file's box
            before = self.sources()
            self.run("ckptfix train --mode dp --out runs --epochs 1 -q", where="setup=runs")
            _SETUP_SOURCES.update(self.sources() - before)
            keep = Path(tempfile.mkdtemp(prefix="ckptfix-docs-runs-"))
            shutil.copytree(self.dir / "runs", keep / "runs")
            _TRAINED["runs"] = keep
        else:
            shutil.copytree(_TRAINED["runs"] / "runs", self.dir / "runs")

    def frameworks(self) -> None:
        """``setup=frameworks``: folders the frameworks wrote (tests/fixtures/frameworks), as users hold them."""
        for src, dst in FRAMEWORK_FOLDERS.items():
            to = self.dir / dst
            if to.exists():
                continue
            if (FIXTURES / src).is_dir():
                shutil.copytree(FIXTURES / src, to, ignore=shutil.ignore_patterns("expected*", "VERSIONS", "make*.py"))
            else:
                shutil.copy(FIXTURES / src, to)
            for f in sorted((FIXTURES / src).rglob("*")) if (FIXTURES / src).is_dir() else [FIXTURES / src]:
                if f.is_file():
                    _SETUP_SOURCES.add(f.relative_to(ROOT).as_posix())

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


_S3: list = []  # the local S3 server of ``setup=s3`` (one per run of this script)


def s3_server():
    """``setup=s3``: moto's S3 server (started once, stopped at exit), bucket ``ckptfix-docs`` = tests/fixtures/ckpt."""
    if not _S3:
        import atexit

        sys.path.insert(0, str(ROOT / "tests"))
        from s3server import S3Server

        srv = S3Server(bucket="ckptfix-docs").start()
        atexit.register(srv.stop)
        for f in sorted((ROOT / "tests" / "fixtures" / "ckpt").iterdir()):
            if f.name.startswith("make_"):
                continue
            srv.upload(f, f.name)
            _SETUP_SOURCES.update(
                p.relative_to(ROOT).as_posix() for p in ([f] if f.is_file() else sorted(f.rglob("*"))) if p.is_file()
            )
        _S3.append(srv)
    return _S3[0]


_HUB: list = []  # the local Hub endpoint of ``setup=hub`` (one per run of this script)


def hub_server():
    """``setup=hub``: tests/hubserver.py in a thread (a daemon: it ends with this script), serving the fixtures."""
    if not _HUB:
        import threading

        sys.path.insert(0, str(ROOT / "tests"))
        from hubserver import HubServer

        ckpt = ROOT / "tests" / "fixtures" / "ckpt"
        srv = HubServer(
            {"ckptfix-docs/fixtures": {"main": str(ckpt)}, "ckptfix-docs/sharded": {"main": str(ckpt / "sharded")}}
        )
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        _SETUP_SOURCES.update(p.relative_to(ROOT).as_posix() for p in sorted(ckpt.rglob("*")) if p.is_file())
        _HUB.append(srv)
    return _HUB[0]


def render(block_lines: list[str], block: Block, box: Sandbox, where: str = "") -> list[str]:
    box.setup(block.setup)
    cmds = [line for line in block_lines if line.startswith("$ ")]
    outs = box.run_lines([c[2:] for c in cmds], block.gpu, where)
    out: list[str] = []
    for line, text in zip(cmds, outs, strict=True):
        out.append(line)
        text = text.rstrip("\n")
        out.extend(text.split("\n") if text else [])
    return out


def masked(lines: list[str], masks: list[str]) -> list[str]:
    pats = [re.compile(p) for p in TIMINGS + masks]
    res = []
    for line in lines:
        for p in pats:
            line = p.sub("…", line)
        res.append(line)
    return res


def _sha(*parts: str | bytes) -> str:
    h = hashlib.sha256()
    for part in parts:
        b = part.encode() if isinstance(part, str) else part
        h.update(len(b).to_bytes(8, "little") + b)
    return h.hexdigest()


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "-"


def _file_sha(rel: str) -> str:
    p = ROOT / rel
    return _sha(p.read_bytes()) if p.is_file() else "missing"


def _common_inputs() -> list[str]:
    """What every page depends on besides its commands and the modules it imports."""
    return [
        f"python {platform.python_version()} {platform.machine()}",
        *(f"{d} {_version(d)}" for d in ("torch", "click", "safetensors", "numpy")),
        f"gen_docs.py {_sha(Path(__file__).resolve().read_bytes())}",
    ]


def _scenario_inputs(blocks: list[Block]) -> list[str]:
    """The fake nvidia-smi and the recorded scenarios the page's ``gpu=`` blocks replay (not the others)."""
    names = sorted({b.gpu for b in blocks if b.gpu})
    if not names:
        return []
    files = [SMI / "fake-nvidia-smi.sh"]
    for name in names:
        files += sorted(p for p in (SMI / "scenarios" / name).rglob("*") if p.is_file())
    return [f"{p.relative_to(SMI).as_posix()} {_sha(p.read_bytes()) if p.is_file() else 'missing'}" for p in files]


def page_inputs(lines: list[str], blocks: list[Block], sources: list[str]) -> str:
    """The hash of everything a page's run depends on: its blocks' commands, markers and ``file:`` blocks,
    the ckptfix sources its processes imported, the nvidia-smi scenarios it replays, and
    :func:`_common_inputs`."""
    parts = list(_common_inputs()) + _scenario_inputs(blocks)
    for b in blocks:
        body = lines[b.start + 1 : b.end]
        marker = lines[b.start - 1]
        parts.append(marker + "\n" + "\n".join(body if b.file else [ln for ln in body if ln.startswith("$ ")]))
    parts += [f"{rel} {_file_sha(rel)}" for rel in sorted(sources)]
    return _sha(*parts)


def shown(lines: list[str], blocks: list[Block]) -> str:
    """The hash of a page's blocks as shown (prose around them may change without a rerun)."""
    return _sha(*("\n".join(lines[b.start - 1 : b.end + 1]) for b in blocks))


def stamps_path() -> Path:
    return ROOT / "docs" / STAMPS_NAME


def load_stamps() -> dict[str, dict]:
    try:
        doc = json.loads(stamps_path().read_text())
    except (OSError, ValueError):
        return {}
    pages = doc.get("pages") if isinstance(doc, dict) else None
    return pages if isinstance(pages, dict) else {}


def save_stamps(pages: dict[str, dict]) -> None:
    doc = {
        "about": "written by docs/gen_docs.py: a page whose inputs and blocks match its stamp is not run again",
        "pages": dict(sorted(pages.items())),
    }
    tmp = stamps_path().with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1, sort_keys=False) + "\n")
    os.replace(tmp, stamps_path())


def _page_key(path: Path) -> str:
    path = path.resolve()
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)


def is_current(path: Path, stamp: dict | None) -> bool:
    """Whether ``path``'s blocks were produced by a run with today's inputs (its stamp matches)."""
    if not stamp:
        return False
    lines = path.read_text().split("\n")
    blocks = find_blocks(lines)
    sources = stamp.get("sources")
    if not isinstance(sources, list):
        return False
    return stamp.get("shown") == shown(lines, blocks) and stamp.get("inputs") == page_inputs(lines, blocks, sources)


def process(path: Path, check: bool) -> tuple[list[str], dict | None]:
    """Run ``path``'s blocks; return the diffs of stale blocks and the page's new stamp (None: no blocks)."""
    lines = path.read_text().split("\n")
    blocks = find_blocks(lines)
    if not blocks:
        return [], None
    box = Sandbox()
    problems: list[str] = []
    uses_setup = False
    try:
        new = list(lines)
        shift = 0
        for b in blocks:  # top-down: a later block may use files an earlier one made
            s, e = b.start + shift, b.end + shift
            body = new[s + 1 : e]
            if b.file:
                (box.dir / b.file).write_text("\n".join(body) + "\n")
                continue
            uses_setup = uses_setup or bool(b.setup)
            fresh = render(body, b, box, f"{path.name}:{b.start + 1}")
            if masked(body, b.masks) == masked(fresh, b.masks):
                continue  # only timings or masked text differ: keep the shown run
            diff = difflib.unified_diff(body, fresh, f"{path.name} (shown)", f"{path.name} (real)", lineterm="")
            problems.append("\n".join(diff))
            new[s + 1 : e] = fresh
            shift += len(fresh) - len(body)
        if not check and new != lines:
            path.write_text("\n".join(new))
        sources = sorted(box.sources() | (_SETUP_SOURCES if uses_setup else set()))
    finally:
        box.close()
    final = new if not check else lines
    final_blocks = find_blocks(final)
    stamp = {"inputs": page_inputs(final, final_blocks, sources), "shown": shown(final, final_blocks)}
    return problems, {**stamp, "sources": sources}


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 when a block is stale")
    ap.add_argument("--full", action="store_true", help="run every page, even those whose stamp matches")
    ap.add_argument("--stamp", action="store_true", help="with --check: record the stamps of the pages that match")
    ap.add_argument("files", nargs="*", type=Path, help="markdown files (default: README.md and docs/)")
    args = ap.parse_args(argv)
    stamps = load_stamps()
    stale = []
    ran = skipped = 0
    for f in args.files or doc_files():
        key = _page_key(f)
        if not args.full and is_current(f, stamps.get(key)):
            skipped += 1
            continue
        problems, stamp = process(f, args.check)
        ran += stamp is not None
        for p in problems:
            stale.append(p)
            print(p, file=sys.stderr)
        if stamp is None or (args.check and problems):
            stamps.pop(key, None)
        else:  # regenerated (the page now shows this run), or checked and matching
            stamps[key] = stamp
    for keep in _TRAINED.values():
        if keep is not None:
            shutil.rmtree(keep, ignore_errors=True)
    if not args.check or args.stamp:
        save_stamps(stamps)
    print(f"gen_docs: {ran} page(s) run, {skipped} unchanged since their stamp (not run)", file=sys.stderr)
    if stale and args.check:
        print(f"{len(stale)} block(s) no longer match: run python docs/gen_docs.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
