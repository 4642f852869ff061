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
- ``gpu=SCENARIO``: a recorded nvidia-smi (``tests/fixtures/nvidia-smi/scenarios/SCENARIO``)
  is first on PATH; without it no nvidia-smi is;
- ``mask=REGEX`` (repeatable): text that differs from machine to machine or run to run
  (timings, the Python build); ``--check`` compares with every match replaced by ``…``.

``python docs/gen_docs.py`` rewrites the files; ``--check`` rewrites nothing and exits 1
with a diff when a block no longer matches what the commands print (tests/test_docs.py).
"""

from __future__ import annotations

import argparse
import difflib
import os
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
            env.update(FAKE_SMI_DIR=str(SMI / "scenarios"), FAKE_SMI_SCENARIO=gpu)
        env.update(
            PATH=os.pathsep.join(path),
            PYTHONPATH=str(ROOT),
            COLUMNS="100",
            NO_COLOR="1",
            CKPTFIX_LEASE_DIR=str(self.root / "leases"),
            PYTHONHASHSEED="0",
        )
        return env

    def run(self, cmd: str, gpu: str = "") -> str:
        return self.run_lines([cmd], gpu)[0]

    def run_lines(self, cmds: list[str], gpu: str = "") -> list[str]:
        """Run ``cmds`` in order in one bash, with no lease taken yet; return what each printed."""
        shutil.rmtree(self.root / "leases", ignore_errors=True)
        script = []
        for i, cmd in enumerate(cmds):  # the step marker keeps $? of the command for the next line
            script += [cmd, f"__rc=$?; printf '\\n{STEP}{i}\\n'; (exit $__rc)"]
        p = subprocess.run(
            ["bash", "-c", "exec 2>&1\n" + "\n".join(script)],
            cwd=self.dir,
            env=self.env(gpu),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=600,
        )
        out = p.stdout.replace(sys.executable, "python3")
        out = re.sub(rf"\bon {re.escape(os.uname().nodename)}\b", "on HOST", out)  # lease holders: no machine name
        parts = re.split(rf"\n{STEP}\d+\n", out)
        if len(parts) != len(cmds) + 1:
            raise RuntimeError(f"a command ended the shell early: {cmds!r}\n{out}")
        return [part.removesuffix("\n") for part in parts[:-1]]

    def setup(self, name: str) -> None:
        if name != "runs" or (self.dir / "runs").exists():
            return
        if _TRAINED.get("runs") is None:  # trained once per run of this script, copied into each file's box
            self.run("ckptfix train --mode dp --out runs --epochs 1 -q")
            keep = Path(tempfile.mkdtemp(prefix="ckptfix-docs-runs-"))
            shutil.copytree(self.dir / "runs", keep / "runs")
            _TRAINED["runs"] = keep
        else:
            shutil.copytree(_TRAINED["runs"] / "runs", self.dir / "runs")

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def render(block_lines: list[str], block: Block, box: Sandbox) -> list[str]:
    box.setup(block.setup)
    cmds = [line for line in block_lines if line.startswith("$ ")]
    outs = box.run_lines([c[2:] for c in cmds], block.gpu)
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


def process(path: Path, check: bool) -> list[str]:
    lines = path.read_text().split("\n")
    blocks = find_blocks(lines)
    if not blocks:
        return []
    box = Sandbox()
    problems: list[str] = []
    try:
        new = list(lines)
        shift = 0
        for b in blocks:  # top-down: a later block may use files an earlier one made
            s, e = b.start + shift, b.end + shift
            body = new[s + 1 : e]
            if b.file:
                (box.dir / b.file).write_text("\n".join(body) + "\n")
                continue
            fresh = render(body, b, box)
            if masked(body, b.masks) == masked(fresh, b.masks):
                continue  # only timings or masked text differ: keep the shown run
            diff = difflib.unified_diff(body, fresh, f"{path.name} (shown)", f"{path.name} (real)", lineterm="")
            problems.append("\n".join(diff))
            new[s + 1 : e] = fresh
            shift += len(fresh) - len(body)
        if not check and new != lines:
            path.write_text("\n".join(new))
    finally:
        box.close()
    return problems


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 when a block is stale")
    ap.add_argument("files", nargs="*", type=Path, help="markdown files (default: README.md and docs/)")
    args = ap.parse_args(argv)
    stale = []
    for f in args.files or doc_files():
        for p in process(f, args.check):
            stale.append(p)
            print(p, file=sys.stderr)
    for keep in _TRAINED.values():
        if keep is not None:
            shutil.rmtree(keep, ignore_errors=True)
    if stale and args.check:
        print(f"{len(stale)} block(s) no longer match: run python docs/gen_docs.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
