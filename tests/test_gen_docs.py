"""docs/gen_docs.py runs a page again only when its inputs changed, and then still catches drift: a page's
stamp (docs/gen_docs.stamps.json) hashes its commands and every ckptfix source its processes imported."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

PAGE = """# A page

Some prose.

<!-- run: -->
```console
$ python3 -c "import ckptfix.value as v; print(v.VALUE)"
1
```
"""


@pytest.fixture
def gen(tmp_path, monkeypatch):
    """gen_docs with its repository root at ``tmp_path``: a one-module ``ckptfix`` and a page that prints it."""
    spec = importlib.util.spec_from_file_location("gen_docs_under_test", REPO / "docs" / "gen_docs.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, mod)  # dataclasses look their module up
    spec.loader.exec_module(mod)
    pkg = tmp_path / "ckptfix"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "value.py").write_text("VALUE = 1\n")
    (pkg / "unused.py").write_text("X = 1\n")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text(PAGE)
    monkeypatch.setattr(mod, "ROOT", tmp_path)
    return mod


def _check(gen, capsys, *extra: str) -> tuple[int, str]:
    rc = gen.main(["--check", *extra, str(gen.ROOT / "docs" / "page.md")])
    return rc, capsys.readouterr().err


def test_an_unchanged_page_is_not_run_again(gen, capsys):
    assert _check(gen, capsys, "--stamp") == (0, "gen_docs: 1 page(s) run, 0 unchanged since their stamp (not run)\n")
    stamp = json.loads((gen.ROOT / "docs" / "gen_docs.stamps.json").read_text())["pages"]["docs/page.md"]
    assert stamp["sources"] == ["ckptfix/__init__.py", "ckptfix/value.py"]  # what the run imported, no more
    assert _check(gen, capsys)[1].startswith("gen_docs: 0 page(s) run, 1 unchanged")
    (gen.ROOT / "ckptfix" / "unused.py").write_text("X = 2\n")  # a module the page does not import
    page = gen.ROOT / "docs" / "page.md"
    page.write_text(page.read_text().replace("Some prose.", "Other prose."))  # prose, not a block
    assert _check(gen, capsys)[1].startswith("gen_docs: 0 page(s) run, 1 unchanged")
    assert _check(gen, capsys, "--full")[1].startswith("gen_docs: 1 page(s) run, 0 unchanged")


@pytest.mark.parametrize("bytecode", ["written", "PYTHONDONTWRITEBYTECODE"])
def test_a_changed_module_reruns_the_page_and_catches_the_drift(gen, capsys, monkeypatch, bytecode):
    """Caught whether the page's processes write ``__pycache__`` or not (issue 36: an edit of the same size within
    the second ran the old bytecode, which Python trusts by size and mtime in whole seconds)."""
    if bytecode == "written":
        monkeypatch.delenv("PYTHONDONTWRITEBYTECODE", raising=False)
    else:
        monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    assert _check(gen, capsys, "--stamp")[0] == 0
    value = gen.ROOT / "ckptfix" / "value.py"
    was = value.stat()
    value.write_text("VALUE = 2\n")
    os.utime(value, ns=(was.st_atime_ns, was.st_mtime_ns))  # the same second, whatever the machine's speed
    rc, err = _check(gen, capsys)
    assert rc == 1 and "-1\n+2" in err and "1 page(s) run" in err


def test_a_changed_command_or_output_reruns_the_page(gen, capsys):
    assert _check(gen, capsys, "--stamp")[0] == 0
    page = gen.ROOT / "docs" / "page.md"
    page.write_text(PAGE.replace("\n1\n```", "\n3\n```"))  # a hand edit of the recorded output
    rc, err = _check(gen, capsys)
    assert rc == 1 and "-3\n+1" in err
    page.write_text(PAGE.replace("print(v.VALUE)", "print(v.VALUE + 1)"))  # a changed command
    rc, err = _check(gen, capsys)
    assert rc == 1 and "-1\n+2" in err


def test_the_regeneration_writes_the_stamp(gen, capsys):
    (gen.ROOT / "ckptfix" / "value.py").write_text("VALUE = 5\n")
    assert gen.main([str(gen.ROOT / "docs" / "page.md")]) == 0
    assert "\n5\n```" in (gen.ROOT / "docs" / "page.md").read_text()
    capsys.readouterr()
    assert _check(gen, capsys)[1].startswith("gen_docs: 0 page(s) run, 1 unchanged")


def test_a_hung_block_is_named(gen, monkeypatch):
    monkeypatch.setattr(gen, "BLOCK_TIMEOUT", 0.5)
    box = gen.Sandbox()
    try:
        with pytest.raises(RuntimeError, match=r"page.md:7: still running after 0.5 s \(hung\?\) at command 2 of 2"):
            box.run_lines(["echo started", "sleep 30"], where="page.md:7")
    finally:
        box.close()


def test_the_committed_stamps_name_existing_pages():
    doc = json.loads((REPO / "docs" / "gen_docs.stamps.json").read_text())
    for key, stamp in doc["pages"].items():
        assert (REPO / key).is_file(), key
        assert all((REPO / s).is_file() for s in stamp["sources"]), key


def test_the_stamps_file_is_not_ignored_by_git():
    """Committed: a fresh clone skips the pages whose stamp matches."""
    p = subprocess.run(["git", "-C", str(REPO), "check-ignore", "-q", "docs/gen_docs.stamps.json"], check=False)
    assert p.returncode == 1


def test_only_the_replayed_nvidia_smi_scenarios_count(gen, capsys, tmp_path, monkeypatch):
    smi = tmp_path / "smi"
    shutil.copytree(gen.SMI, smi)
    monkeypatch.setattr(gen, "SMI", smi)
    page = gen.ROOT / "docs" / "page.md"
    page.write_text(PAGE.replace("<!-- run: -->", "<!-- run: gpu=two_free -->"))
    assert _check(gen, capsys, "--stamp")[0] == 0
    other = next(p for p in (smi / "scenarios").iterdir() if p.name != "two_free")
    (other / "query-gpu.txt").write_text("changed\n")  # a scenario this page does not replay
    assert _check(gen, capsys)[1].startswith("gen_docs: 0 page(s) run, 1 unchanged")
    (smi / "scenarios" / "two_free" / "query-gpu.txt").write_text("changed\n")
    assert _check(gen, capsys)[1].startswith("gen_docs: 1 page(s) run, 0 unchanged")
